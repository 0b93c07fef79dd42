"""Pipeline parallelism: the schedules on their own (simulated against each
other: no deadlock, the papers' bubble), the balanced cut, and pt.pipeline.split
+ pt.Pipeline through real processes against one process on the whole batch
(tests/workers/pipeline.py)."""
import random
import re

import pytest

from conftest import launch, outputs, spawn
from paratrain.parallel.pipeline import partition, schedules

# ---- schedules, simulated ----------------------------------------------------------------------


def _cases():
    for schedule in schedules.SCHEDULES:
        for p in (2, 3, 4):
            for m in range(1, 10):
                for v in ((2, 3) if schedule == "interleaved" else (1,)):
                    if schedule == "interleaved" and m % p:
                        continue
                    yield schedule, p, m, v


@pytest.mark.parametrize("schedule,p,m,v", list(_cases()))
@pytest.mark.quick
def test_every_schedule_runs_each_action_once_without_deadlock(schedule, p, m, v):
    makespan, busy, trace = schedules.simulate(schedule, p, m, v)
    kinds = "FBW" if schedule in schedules.SPLIT_BACKWARD else "FB"
    for r in range(p):
        done = [(k, mb, c) for k, mb, c, _, _ in trace[r]]
        assert sorted(done) == sorted((k, mb, c) for k in kinds for mb in range(m) for c in range(v))
    per_action = {"F": 1, "B": 1, "W": 1} if "W" in kinds else {"F": 1, "B": 2}
    assert all(b == m * v * sum(per_action.values()) for b in busy)


@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
@pytest.mark.quick
def test_bubble_is_the_papers(schedule):
    for p in (2, 3, 4):
        for m in range(p, 3 * p + 1):
            v = 2 if schedule == "interleaved" else 1
            if schedule == "interleaved" and m % p:
                continue
            makespan, busy, _ = schedules.simulate(schedule, p, m, v)
            bubble = 1 - sum(busy) / (p * makespan)
            assert bubble == pytest.approx(schedules.bubble_formula(schedule, p, m, v)), (p, m)


@pytest.mark.quick
def test_zero_bubble_idles_a_third_of_one_forward_one_backward():
    for p in (2, 3, 4):
        for m in range(p, 4 * p):
            zb, _, _ = schedules.simulate("zb-h1", p, m)
            one, _, _ = schedules.simulate("1f1b", p, m, cost={"F": 1.0, "B": 2.0})
            assert zb - 3 * m == pytest.approx((one - 3 * m) / 3)


@pytest.mark.quick
def test_one_forward_one_backward_holds_at_most_p_minus_rank_microbatches():
    def peak(trace):
        live = best = 0
        for kind, *_ in trace:
            live += {"F": 1, "B": -1}.get(kind, 0)
            best = max(best, live)
        return best
    p, m = 4, 12
    _, _, one = schedules.simulate("1f1b", p, m)
    _, _, gpipe = schedules.simulate("gpipe", p, m)
    assert [peak(t) for t in one] == [p - r for r in range(p)]
    assert [peak(t) for t in gpipe] == [m] * p


@pytest.mark.quick
def test_zero_bubble_holds_at_most_2p_microbatches_between_forward_and_weight_gradient():
    """The bound the W placement keeps on every rank (schedules._zero_bubble_h1), and the
    last stage runs its last F and B before its W's: the first stage waits for that B."""
    for p in (2, 3, 4):
        for m in range(1, 4 * p):
            _, _, trace = schedules.simulate("zb-h1", p, m)
            for t in trace:
                live = best = 0
                for kind, *_ in t:
                    live += {"F": 1, "W": -1}.get(kind, 0)
                    best = max(best, live)
                assert best <= min(2 * p, m), (p, m, best)
    last = [kind for kind, *_ in schedules.actions("zb-h1", 1, 2, 4)]
    assert last == ["F", "B"] * 4 + ["W"] * 4


@pytest.mark.quick
def test_interleaved_needs_microbatches_in_groups_of_ranks():
    with pytest.raises(ValueError, match="multiple of the number of pipeline ranks"):
        schedules.actions("interleaved", 0, 2, 3, 2)


# ---- the balanced cut ---------------------------------------------------------------------------


def _brute_force(costs, k):
    import itertools
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.quick
def test_balance_finds_the_cheapest_largest_stage():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 5, 13]) + rng.random() for _ in range(n)]
        starts = partition.balance(costs, k)
        assert starts[0] == 0 and len(starts) == k and all(a < b for a, b in zip(starts, starts[1:]))
        bounds = (*starts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert worst == pytest.approx(_brute_force(costs, k))
        greedy = (*partition.balance_greedy(costs, k), n)
        assert max(sum(costs[a:b]) for a, b in zip(greedy, greedy[1:])) >= worst - 1e-9


# ---- through real processes ---------------------------------------------------------------------


def _passed(res, n, count):
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert out.count("passed on rank") == n * count, out[-4000:]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("p", [2, 3])
def test_loss_and_gradients_equal_one_process(p):
    """GPipe, 1F1B and ZB-H1 (one launch); m in {1, p-1, p, 2p+1}; an nn.Sequential
    cut unevenly, a skip connection across a stage, and the gpt model cut by torch.fx."""
    ms = sorted({1, p - 1, p, 2 * p + 1})
    res = launch(p, "pipeline.py", "equiv", "mlp,skip,gpt", "gpipe,1f1b,zb-h1", ",".join(map(str, ms)), timeout=450)
    _passed(res, p, 3 * 3 * len(ms))


@pytest.mark.timeout(180)
def test_stages_talk_over_gloo_too():
    """The transport is the group's point to point: the torch backend carries it as well."""
    res = launch(2, "pipeline.py", "equiv", "skip,gpt", "zb-h1", "1,3", env={"PARATRAIN_BACKEND": "torch"})
    _passed(res, 2, 4)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,ms", [(2, "3,5"), (3, "7")])
def test_zb_h1_first_stage_runs_weights_while_its_last_gradients_travel(p, ms):
    """A slow last stage: the first stage, past its last F, waits for each B's gradient
    and runs its pending W's meanwhile (checked on its executed order), and the
    gradients still equal one process's."""
    res = launch(p, "pipeline.py", "equiv", "mlp,gpt", "zb-h1", ms, "--slow-last", "0.05")
    _passed(res, p, 2 * len(ms.split(",")))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,schedule,extra", [(2, "1f1b", []), (3, "gpipe", []),
                                              (2, "interleaved", ["--virtual", "2"])])
def test_stages_past_the_first_send_input_gradients_before_weight_gradients(p, schedule, extra):
    """Under the schedules without W, a stage past the first computes its input gradient,
    sends it, then its weight gradients: the previous stage waits a W less. Checked at
    each stage's first send of a step (no linear weight has a gradient yet), with the
    gradients equal to one process's after it."""
    res = launch(p, "pipeline.py", "equiv", "mlp,gpt", schedule, str(2 * p), "--send-before-weights", *extra)
    _passed(res, p, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p", [2, 3])
def test_interleaved_equals_one_process(p):
    res = launch(p, "pipeline.py", "equiv", "mlp,gpt", "interleaved", f"{p},{2 * p}", "--virtual", "2", timeout=200)
    _passed(res, p, 4)


@pytest.mark.timeout(180)
def test_cut_at_named_points_and_by_measured_time():
    res = launch(2, "pipeline.py", "equiv", "gpt", "1f1b", "4", "--points", "blocks.2")
    _passed(res, 2, 1)
    assert "stage 1: blocks.2..head" in res.stderr   # the cut, printed by rank 0
    res = launch(3, "pipeline.py", "equiv", "gpt", "zb-h1", "3", "--by", "time")
    _passed(res, 3, 1)
    assert "cut by time" in res.stderr and "ms forward+backward" in res.stderr


@pytest.mark.timeout(180)
def test_two_pipelines_by_two_replicas_equal_one_process():
    _passed(launch(4, "pipeline.py", "equiv", "mlp,gpt", "1f1b", "2,4", "--dp", "2"), 4, 4)


@pytest.mark.timeout(120)
def test_bad_input_is_refused_on_every_rank():
    res = launch(2, "pipeline.py", "bad")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    expected = {
        "stages": "2 stages but the model has only 1 layers",
        "untraceable": "torch.fx cannot trace Branchy (TraceError: symbolically traced variables cannot be used "
                       "as inputs to control flow). Pass sample=",
        "point": "split point 'blocks.9' is not a layer of the model",
        "m0": "microbatches must be an int of at least 1",
        "schedule": "unknown schedule '2f2b'",
        "batch": "a batch of 8 cannot be cut into 3 equal micro-batches",
        "disagree": "the ranks of the pipeline disagree",
        "targets": "the last stage (rank 1) needs targets",
    }
    for case, words in expected.items():
        for rank in range(2):
            line = next((x for x in out.splitlines() if f"case {case} refused on rank {rank}:" in x), "")
            assert words in line, (case, rank, out[-3000:])


@pytest.mark.timeout(90)
def test_a_dead_stage_is_named_by_its_neighbours():
    procs = spawn(3, "pipeline.py", "die", env={"PARATRAIN_TIMEOUT": "120"})
    out = outputs(procs, 60)   # far below the 120 s timeout: the death was noticed, not waited out
    for rank in (0, 2):
        assert f"rank {rank} caught PeerError" in out[rank], out[rank][-2000:]
        assert re.search(r"rank 1 \(pid \d+\) died", out[rank]), out[rank][-2000:]


@pytest.mark.timeout(60)
def test_a_step_s_wait_at_its_end_counts_as_waiting_not_compute(monkeypatch):
    """After its actions a stage waits on the others (its last sends, the loss from the last
    stage: the last stage waits there for the first to finish its backward); that wait
    is the step's waited_seconds, which paratrain train takes out of its compute. One
    stage here, its loss's broadcast made 30 ms slow."""
    import time

    import torch

    import paratrain as pt
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    group = pt.init(backend="shm")
    try:
        stage = pt.pipeline.split(model, group=group, stages=1)
        pipe = pt.Pipeline(stage, group=group, microbatches=2, loss_fn=torch.nn.functional.cross_entropy)
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        pipe.step(x, y)
        quick = pipe.waited_seconds
        broadcast = group.broadcast

        def late(*args, **kwargs):
            time.sleep(0.03)
            return broadcast(*args, **kwargs)
        monkeypatch.setattr(group, "broadcast", late)
        t0 = time.perf_counter()
        pipe.step(x, y)
        took = time.perf_counter() - t0
    finally:
        pt.destroy()
    assert quick < 0.03 <= pipe.waited_seconds < took
