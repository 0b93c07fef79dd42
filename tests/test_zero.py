"""pt.ZeRO (issue 27): stages 1-3 step for step equal to DataParallel with Adam and
SGD with momentum, clipping included, and the bytes each stage holds against the
ZeRO paper's formulas (tests/workers/zero.py)."""
import pytest

from conftest import launch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_zero_stages_equal_data_parallel_and_hold_the_papers_bytes(n):
    res = launch(n, "zero.py")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert out.count("zero passed on rank") == n, out[-4000:]
