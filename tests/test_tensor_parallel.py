"""Tensor parallelism: ColumnParallelLinear, RowParallelLinear
and the differentiable collectives, through real processes, against one process
(tests/workers/tensor_parallel.py)."""
import pytest

from conftest import launch, passed_on_every_rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])   # 4: also pt.mesh(dp=2, tp=2) with DataParallel over dp
def test_layers_and_collectives_equal_one_process(n):
    res = launch(n, "tensor_parallel.py")
    passed_on_every_rank(res, "tensor parallel", n)


@pytest.mark.timeout(180)
def test_the_mesh_puts_tensor_parallel_groups_inside_a_host():
    """Two pretend hosts of 2 ranks, the hierarchical backend: pt.mesh(dp=2, tp=2) gives
    each TP group the shm engine and DP the path between hosts, and DP x TP still equals
    one process (with every other check of the worker)."""
    res = launch(4, "tensor_parallel.py", "hierarchical", env={"PARATRAIN_PRETEND_HOSTS": "2"})
    passed_on_every_rank(res, "tensor parallel", 4)


@pytest.mark.timeout(120)
def test_a_checkpoint_written_at_tp2_resumes_at_tp3_and_in_one_process(tmp_path):
    """The gathered model and Adam state, written by 2 ranks, resliced for 3 (and for 1:
    a TP = 1 'group' of one rank) equal one process's after the same step, and one
    more step later."""
    path = str(tmp_path / "tp2.pt")
    res = launch(2, "tensor_checkpoint.py", "save", path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    for n in (3, 1):
        res = launch(n, "tensor_checkpoint.py", "load", path)
        passed_on_every_rank(res, "tensor checkpoint load", n)


def test_a_cut_layer_s_collectives_count_as_waiting_not_compute():
    """pt.tensor's collectives time the blocks they run in (traffic.seconds), and a --tp
    training step counts that time as waiting, once, as a data-parallel wait is: the
    trainer's compute_seconds leaves it out."""
    import time

    import torch

    from paratrain.parallel.data import CommStats
    from paratrain.parallel.tensor import functional
    from paratrain.train.strategies.base import LastStepTraffic

    class SlowPair:   # rank 0 of two whose partner holds the same tensor and arrives 20 ms late
        rank, world_size = 0, 2

        def all_reduce(self, tensor, op="sum"):
            time.sleep(0.02)
            tensor.mul_(2)

    step, stats = LastStepTraffic(2), CommStats()
    step.start()
    x = torch.ones(3, requires_grad=True)
    y = functional.all_reduce(x, SlowPair())
    y.sum().backward()   # g's backward is the identity: no collective
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(x.grad, torch.ones(3))
    assert functional.traffic.calls["all_reduce"] == 1
    step.count_blocked(stats)
    assert 0.02 <= stats.wait_seconds == stats.comm_seconds < 1.0
    first = stats.wait_seconds
    step.count_blocked(stats)   # nothing more happened: nothing more counted
    assert stats.wait_seconds == first
    untouched = CommStats()
    LastStepTraffic(1).count_blocked(untouched)   # no tensor parallelism: records nothing
    assert untouched.wait_seconds == 0
