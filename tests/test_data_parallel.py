"""DataParallel and DataParallelNaive through real processes started by the
launcher, checked against a single-process run of the same model on the whole
batch (tests/workers/data_parallel.py), plus the sampler."""
import pytest
import torch

from conftest import launch


def _passed(res, n, mode, backend="shm"):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert res.stdout.count(f"data-parallel {mode} passed on {backend}") == n, out[-4000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n,backend,algorithm", [(2, "shm", None), (3, "shm", None), (2, "shm", "ring"),
                                                 (3, "shm", "naive"), (2, "torch", None), (3, "torch", None)])
def test_equals_single_process_with_whole_batch(n, backend, algorithm, no_leftover_segments):
    args = ["equiv"] + (["--algorithm", algorithm] if algorithm else [])
    _passed(launch(n, "data_parallel.py", *args, env={"PARATRAIN_BACKEND": backend}), n, "equiv", backend)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,n", [("no_sync", 2), ("unused", 3), ("join", 3), ("compress", 2), ("linear_grads", 2),
                                    ("linear_grads", 3)])
def test_modes(mode, n):
    _passed(launch(n, "data_parallel.py", mode), n, mode)


@pytest.mark.timeout(120)
def test_join_on_gloo():
    _passed(launch(2, "data_parallel.py", "join", env={"PARATRAIN_BACKEND": "torch"}), 2, "join", "torch")


@pytest.mark.timeout(120)
def test_different_models_are_refused():
    res = launch(2, "data_parallel.py", "mismatch")
    _passed(res, 2, "mismatch")
    assert "ranks [1] built a different model from rank 0" in res.stdout


def test_sampler_shards_are_disjoint_equal_and_reshuffled():
    from paratrain import DistributedSampler
    data = list(range(103))
    for drop_last in (False, True):
        shards = [DistributedSampler(data, num_replicas=4, rank=r, seed=7, drop_last=drop_last) for r in range(4)]
        for s in shards:
            s.set_epoch(0)
        idx = [list(s) for s in shards]
        assert len({len(i) for i in idx}) == 1  # equal length on every rank: nobody waits for a straggling shard
        flat = sum(idx, [])
        if drop_last:
            assert len(flat) == 100 and len(set(flat)) == 100
        else:
            assert len(flat) == 104 and set(flat) == set(range(103))  # padded with one repeat
    a = DistributedSampler(data, num_replicas=2, rank=0, seed=7)
    a.set_epoch(0)
    e0 = list(a)
    a.set_epoch(1)
    assert list(a) != e0  # a new order each epoch
    b = DistributedSampler(data, num_replicas=2, rank=0, seed=7)
    b.set_epoch(1)
    assert list(b) == list(a)  # the same seed and epoch give the same order on every run


def test_buckets_reverse_order_first_small_and_by_dtype():
    from paratrain.parallel.buckets import assign
    ps = [torch.zeros(100_000), torch.zeros(300_000), torch.zeros(10, dtype=torch.float64), torch.zeros(400_000)]
    got = assign(ps, bucket_bytes=2_000_000, first_bucket_bytes=1_000_000)
    shapes = [[p.numel() for p in b] for b in got]
    # reversed: 400k (1.6 MB) alone in the first bucket (cap 1 MB, but a bucket takes at least one tensor),
    # then the float64 tensor on its own (dtype change), then 300k + 100k floats (1.6 MB <= 2 MB)
    assert shapes == [[400_000], [10], [300_000, 100_000]]
