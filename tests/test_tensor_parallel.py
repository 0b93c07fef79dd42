"""Tensor parallelism (issue 26, in progress): ColumnParallelLinear, RowParallelLinear
and the differentiable collectives, through real processes, against one process
(tests/workers/tensor_parallel.py)."""
import pytest

from conftest import launch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])   # 4: also pt.mesh(dp=2, tp=2) with DataParallel over dp
def test_layers_and_collectives_equal_one_process(n):
    res = launch(n, "tensor_parallel.py")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert out.count("tensor parallel passed on rank") == n, out[-4000:]
