"""pt.ZeRO: stages 1-3 step for step equal to DataParallel with Adam and
SGD with momentum, clipping included, and the bytes each stage holds against the
ZeRO paper's formulas (tests/workers/zero.py)."""
import pytest

from conftest import launch, passed_on_every_rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_zero_stages_equal_data_parallel_and_hold_the_papers_bytes(n):
    res = launch(n, "zero.py")
    passed_on_every_rank(res, "zero", n)


@pytest.mark.timeout(240)
def test_a_checkpoint_of_2_ranks_resumes_exactly_on_3(tmp_path):
    """Written at world size 2 (at stage 1, 3 and 2), the gathered model and Adam state load
    at world size 3 (at stage 3, 2 and 1) equal to one process, and one step later too."""
    pairs = [(1, 3), (3, 2), (2, 1)]
    paths = ",".join(str(tmp_path / f"zero{i}.pt") for i in range(len(pairs)))
    res = launch(2, "zero.py", "save", paths, ",".join(str(saved) for saved, _ in pairs))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    res = launch(3, "zero.py", "load", paths, ",".join(str(loaded) for _, loaded in pairs))
    passed_on_every_rank(res, "zero checkpoint load", 3)
