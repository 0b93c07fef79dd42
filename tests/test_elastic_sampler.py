"""pt.elastic.ElasticSampler: whatever sizes the world goes through within an epoch,
every sample is used exactly once, and each commit's count is a prefix of the
epoch's order. The ranks are simulated here in one process: each world is a list
of samplers that use their batches in lockstep, as synchronous training does."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.elastic import ElasticSampler
from paratrain.elastic.sampler import batch_plan, step_plan


def world(size, w, batch_size=None, seed=3, state=None, global_batch=None):
    ranks = [ElasticSampler(range(size), seed=seed, batch_size=batch_size, rank=r, num_replicas=w,
                            global_batch=global_batch) for r in range(w)]
    for s in ranks:
        s.set_epoch(1)
        if state is not None:
            s.load_state_dict(state)
    return ranks


def batches_of(sampler, b):
    """What a DataLoader of num_workers=0 hands the training loop, one batch at a time."""
    if sampler.batched:
        yield from iter(sampler)   # given as batch_sampler=
        return
    batch = []
    for i in sampler:
        batch.append(i)
        if len(batch) == b:
            yield batch
            batch = []
    if batch:
        yield batch


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 300), b=st.integers(1, 9), deal=st.sampled_from(["samples", "batches", "global"]),
       worlds=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12)), min_size=1, max_size=5))
def test_every_sample_once_through_any_sequence_of_world_sizes(size, b, deal, worlds):
    """worlds: (ranks, steps before the next change); the last world runs to the end.
    deal: sample by sample, batches of b per rank, or a global batch of 6 + b a step."""
    used, state = [], None
    for n, (w, steps) in enumerate(worlds):
        ranks = world(size, w, b if deal == "batches" else None, state=state,
                      global_batch=6 + b if deal == "global" else None)
        streams = [batches_of(s, b) for s in ranks]
        last = n == len(worlds) - 1
        step = 0
        while last or step < steps:
            got = [next(it, None) for it in streams]
            if all(g is None for g in got):
                break
            for g in got:
                used.extend(g or [])
            step += 1
        state = ranks[0].state_dict()   # rank 0's share is the largest: its count is the world's
        if len({s.handed_out for s in ranks}) == 1:
            assert all(s.state_dict() == state for s in ranks[1:])   # in lockstep every rank commits the same
        order = ranks[0].permutation().tolist()
        assert sorted(used) == sorted(order[:state["start"]]), "a commit's count is a prefix of the order"
    assert sorted(used) == list(range(size))    # each sample exactly once: none repeated, none skipped


@pytest.mark.parametrize("rest,w,g", [(24, 3, 8), (25, 3, 8), (26, 4, 8), (2, 3, 8), (0, 2, 4), (13, 4, 4)])
def test_a_global_batch_is_the_same_whatever_the_world_size(rest, w, g):
    """Each step takes g samples (the last step of the epoch what is left, or, when that
    is fewer than the ranks, the step before takes it too), cut in shares that differ by
    one at most; every rank takes part in every step."""
    plan = step_plan(rest, w, g)
    steps = list(zip(*plan))
    assert sum(map(sum, steps)) == rest
    if rest % g == 0 or rest % g >= w:
        assert [sum(s) for s in steps] == [sum(s) for s in zip(*step_plan(rest, 1, g))]
    for s in steps:
        assert max(s) - min(s) <= 1 and (min(s) >= 1 or rest < w), plan


def test_a_global_batch_smaller_than_the_world_is_refused():
    with pytest.raises(ValueError, match="at least the world size"):
        ElasticSampler(range(10), global_batch=2, rank=0, num_replicas=3)


@pytest.mark.parametrize("rest,w,b", [(20, 3, 4), (25, 3, 4), (26, 3, 4), (2, 3, 4), (0, 2, 4), (13, 4, 1)])
def test_batched_ranks_get_the_same_number_of_batches_and_share_every_sample(rest, w, b):
    plan = batch_plan(rest, w, b)
    assert sum(map(sum, plan)) == rest
    if rest >= w:
        assert len({len(p) for p in plan}) == 1, plan
        assert all(b <= max(p) <= b + 1 or len(p) == 1 for p in plan if p), plan


def test_uneven_rest_without_batch_size_differs_by_at_most_one_sample():
    ranks = world(10, 3)
    assert [len(s) for s in ranks] == [4, 3, 3]
    assert sorted(i for s in ranks for i in s) == list(range(10))


def test_a_new_epoch_starts_over_and_the_same_epoch_resumes():
    s = ElasticSampler(range(50), seed=1, rank=0, num_replicas=2)
    s.set_epoch(0)
    first = list(s)
    s.set_epoch(1)
    assert s.used() == 0
    assert list(s) != first   # another order: the permutation is seeded by the epoch
    state = s.state_dict()
    assert state["epoch"] == 1 and state["start"] == 50   # 25 used by each of 2 ranks
    s.record(10)   # a prefetching loader: only 10 really used here
    assert s.used() == 20
    s.load_state_dict({**state, "start": 20})
    s.set_epoch(1)   # the training function called again: the same epoch goes on
    assert s.start == 20 and len(s) == 15


def test_a_saved_sampler_over_other_data_is_refused():
    s = ElasticSampler(range(50), seed=1, rank=0, num_replicas=2)
    with pytest.raises(ValueError, match="over 40 samples"):
        s.load_state_dict({"epoch": 0, "start": 0, "seed": 1, "size": 40})
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        s.reset(2, 2)
