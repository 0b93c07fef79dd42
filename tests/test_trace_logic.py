"""The trace's logic without processes: intervals, the clock estimate, the merge and the analysis
on hand-made rank files whose answers are known."""
import gzip
import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from paratrain.trace import analysis, chrome, clock, recorder

intervals = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=8)


def covered(xs):
    return {t for a, b in xs for t in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_interval_arithmetic_matches_sets_of_points(xs, ys):
    ux, uy = analysis.union(xs), analysis.union(ys)
    assert covered(ux) == covered(xs)
    assert all(b <= c for (_, b), (c, _) in zip(ux, ux[1:]))   # sorted, disjoint
    assert covered(analysis.intersect(ux, uy)) == covered(xs) & covered(ys)
    assert covered(analysis.subtract(ux, uy)) == covered(xs) - covered(ys)
    assert analysis.length(ux) == len(covered(xs))


def test_the_clock_estimate_finds_a_skew_within_its_uncertainty():
    """Rank r's clock reads rank 0's minus 2.5 ms; the legs of each round trip take
    10-200 us, unequally. The estimate must be within its stated uncertainty of the truth,
    and the uncertainty that of the shortest round trip."""
    rng = random.Random(0)
    skew, samples = -2.5e-3, []
    true = 100.0
    for _ in range(clock.ROUNDS):
        t0 = true + skew
        there, back = rng.uniform(10e-6, 200e-6), rng.uniform(10e-6, 200e-6)
        t1 = true + there                    # rank 0's clock when the ping arrives
        t2 = true + there + back + skew      # rank r's when the answer is back
        samples.append((t0, t1, t2))
        true += 0.01
    offset, uncertainty = clock.best_offset(samples)
    assert abs(offset - (-skew)) <= uncertainty + 1e-12
    assert uncertainty == pytest.approx(min((t2 - t0) / 2 for t0, _, t2 in samples))


def write_rank(directory, rank, spans, offset=0.0, world=2):
    header = {"role": "rank", "index": rank, "pid": 1, "host": "h", "offset_s": offset, "uncertainty_s": 0.0}
    with open(directory / f"rank-{rank}.jsonl", "w") as f:
        f.write(json.dumps(header) + "\n")
        for s in spans:
            f.write(json.dumps(s) + "\n")


def collective(seq, rank, t0, t1, ranks=(0, 1)):
    return ["all_reduce", "comm", "comm world", t0, t1,
            {"op": "all_reduce", "group": "world", "seq": seq, "bytes": 64, "ranks": list(ranks), "rank": rank}]


def two_ranks(tmp_path, offset1=0.0):
    """Two steps of 10 ms. Rank 0 computes 4 ms, then all-reduces from 4 to 9 ms; rank 1
    computes 7 ms (3 ms longer: it is late), and all-reduces from 7 to 9 ms. So rank 0 waits
    3 ms and both move bytes for 2 ms; rank 0 idles the last 1 ms, rank 1 too. Rank 1's
    clock runs ``offset1`` behind rank 0's, and its file says so."""
    r0, r1 = [], []
    for k in range(2):
        base = k * 0.010
        r0 += [["step", "step", "compute", base, base + 0.010, {"step": k + 1}],
               ["forward", "compute", "compute", base, base + 0.004, {"cpu_s": 0.004}],
               collective(k + 1, 0, base + 0.004, base + 0.009)]
        r1 += [["step", "step", "compute", base, base + 0.010, {"step": k + 1}],
               ["forward", "compute", "compute", base, base + 0.007, {"cpu_s": 0.007}],
               collective(k + 1, 1, base + 0.007, base + 0.009)]
    shift = lambda spans: [[n, c, t, a - offset1, b - offset1, x] for n, c, t, a, b, x in spans]  # noqa: E731
    write_rank(tmp_path, 0, r0)
    write_rank(tmp_path, 1, shift(r1), offset=offset1)


def test_the_merge_splits_each_collective_at_the_last_arrival_and_moves_clocks(tmp_path):
    two_ranks(tmp_path, offset1=0.5)   # rank 1's clock half a second behind: the merge moves it back
    path = chrome.merge(str(tmp_path))
    events = analysis.load(path)
    waits = {(e["pid"], round(e["dur"])) for e in events if e.get("cat") == "wait"}
    assert waits == {(0, 3000), (1, 0)}
    transfers = sorted(round(e["dur"]) for e in events if e.get("cat") == "transfer")
    assert transfers == [2000] * 4
    flows = {}
    for e in events:
        if e.get("ph") in "stf" and e.get("cat") == "flow":
            flows.setdefault(e["id"], []).append(e["ph"])
    assert sorted(flows.values()) == [["s", "f"], ["s", "f"]]

    rows = {r["rank"]: r for r in analysis.breakdown(events)}
    r0, r1 = rows[0], rows[1]
    assert r0["compute_s"] == pytest.approx(0.008) and r0["wait_s"] == pytest.approx(0.006)
    assert r0["exposed_comm_s"] == pytest.approx(0.004) and r0["idle_s"] == pytest.approx(0.002)
    assert r1["compute_s"] == pytest.approx(0.014) and r1["wait_s"] == pytest.approx(0.0)
    for r in rows.values():
        parts = r["compute_s"] + r["data_s"] + r["exposed_comm_s"] + r["wait_s"] + r["idle_s"]
        assert parts == pytest.approx(r["step_s"])
    # Own work per step: 7 ms and 10 ms; the median of two is 8.5 ms, so rank 1 is 1.18x it.
    assert analysis.stragglers(list(rows.values())) == [{"rank": 1, "factor": pytest.approx(10 / 8.5)}]
    late = analysis.last_arrivals(events, steps=2)
    assert late == [{"op": "all_reduce", "rank": 1, "share": 1.0, "calls": 2,
                     "others_wait_s_per_step": pytest.approx(0.003)}]


def test_the_report_names_the_rank_waited_for_longest_not_the_one_last_most_often(tmp_path):
    """In two of three steps rank 1 reaches the all-reduce 0.1 ms after rank 0; in the
    third rank 0 comes 5 ms after rank 1. Rank 0 held the others up: 5 ms in three steps."""
    lateness = ((1, 0.0001), (1, 0.0001), (0, 0.005))
    for rank in (0, 1):
        spans = []
        for k, (late, by) in enumerate(lateness):
            base = k * 0.010
            start = base + 0.002 + (by if rank == late else 0.0)
            spans += [["step", "step", "compute", base, base + 0.010, {"step": k + 1}],
                      collective(k + 1, rank, start, base + 0.008)]
        write_rank(tmp_path, rank, spans)
    late = analysis.last_arrivals(analysis.load(chrome.merge(str(tmp_path))), steps=3)
    assert late == [{"op": "all_reduce", "rank": 0, "share": pytest.approx(1 / 3), "calls": 3,
                     "others_wait_s_per_step": pytest.approx(0.005 / 3)}]


def test_waits_before_the_first_step_are_told_apart_from_the_steps(tmp_path):
    """A setup collective where rank 1 waits 0.4 s for rank 0 (a pipeline timing its cut
    does so) is not 0.2 s a step of waiting: the steps' own figure stays rank 1's 3 ms,
    and the setup's wait is reported in all, apart."""
    two_ranks(tmp_path)
    for rank, start in ((0, -0.1), (1, -0.5)):
        path = tmp_path / f"rank-{rank}.jsonl"
        header, *lines = path.read_text().splitlines()
        setup = collective(0, rank, start, -0.09)
        path.write_text("\n".join([header, json.dumps(setup), *lines]) + "\n")
    late = analysis.last_arrivals(analysis.load(chrome.merge(str(tmp_path))), steps=2)
    assert late == [{"op": "all_reduce", "rank": 1, "share": 1.0, "calls": 2,
                     "others_wait_s_per_step": pytest.approx(0.003)},
                    {"op": "all_reduce", "rank": 0, "share": 1.0, "calls": 1,
                     "others_wait_s": pytest.approx(0.4), "outside": True}]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_collective_the_forward_waits_in_is_not_compute(tmp_path, blocking):
    """Each rank's forward spans 10 ms of a 10 ms step. Inside it rank 0 calls an all-reduce
    at 2 ms, rank 1 at 5 ms; both end at 6 ms. Called blocking (a tensor-parallel layer's),
    rank 0 waited 3 ms and both moved bytes for 1 ms, with no compute beside them; each got
    4 ms of CPU, so of rank 0's 6 ms of compute 2 were starved, of rank 1's 9 ms 5. On a
    lane (async_op, a bucket under backward) the forward went on beside it and all 10 ms
    are compute."""
    for rank, start in ((0, 0.002), (1, 0.005)):
        call = collective(1, rank, start, 0.006)
        if blocking:
            call[5]["blocking"] = True
        write_rank(tmp_path, rank, [["step", "step", "compute", 0.0, 0.010, {"step": 1}],
                                    ["forward", "compute", "compute", 0.0, 0.010, {"cpu_s": 0.004}], call])
    rows = {r["rank"]: r for r in analysis.breakdown(analysis.load(chrome.merge(str(tmp_path))))}
    if blocking:
        assert rows[0]["compute_s"] == pytest.approx(0.006) and rows[1]["compute_s"] == pytest.approx(0.009)
        assert rows[0]["wait_s"] == pytest.approx(0.003) and rows[1]["wait_s"] == pytest.approx(0.0)
        assert rows[0]["exposed_comm_s"] == pytest.approx(0.001) == rows[1]["exposed_comm_s"]
        assert rows[0]["overlap"] == 0.0 == rows[1]["overlap"]
        assert rows[0]["starved_s"] == pytest.approx(0.002) and rows[1]["starved_s"] == pytest.approx(0.005)
    else:
        for r in rows.values():
            assert r["compute_s"] == pytest.approx(0.010) and r["wait_s"] == 0.0 and r["overlap"] == 1.0
    for r in rows.values():
        assert r["compute_s"] + r["data_s"] + r["exposed_comm_s"] + r["wait_s"] + r["idle_s"] == \
            pytest.approx(r["step_s"])


@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_a_bsp_round_names_the_worker_it_waited_for(tmp_path, mode):
    """Two parameter-server workers, one server, two 10 ms steps. Worker 0 computes 4 ms and
    its push reaches the server at 5 ms; worker 1 computes 8 ms, its push arrives at 9 ms;
    both have the next weights at 10 ms. Under BSP worker 0 waited 4 ms of its step for
    worker 1's push, and the rounds name worker 1; under ASP nobody waits for a round."""
    server = []
    for rank, (computed, pushed) in enumerate(((0.004, 0.005), (0.008, 0.009))):
        spans = []
        for k in range(2):
            base = k * 0.010
            spans += [["step", "step", "compute", base, base + 0.010, {"step": k + 1}],
                      ["forward", "compute", "compute", base, base + computed, {}],
                      ["ps.step", "comm", "comm ps", base + computed, base + 0.010, {"clock": k}]]
            server.append(["push", "compute", "compute", base + pushed, base + pushed + 0.0005,
                           {"worker": rank, "clock": k, "mode": mode}])
        write_rank(tmp_path, rank, spans)
    header = {"role": "server", "index": 0, "pid": 2, "host": "h", "offset_s": 0.0, "uncertainty_s": 0.0}
    (tmp_path / "server-0.jsonl").write_text("\n".join(json.dumps(x) for x in [header, *server]) + "\n")
    events = analysis.load(chrome.merge(str(tmp_path)))
    rows = {r["rank"]: r for r in analysis.breakdown(events)}
    late = analysis.last_arrivals(events, steps=2)
    if mode == "bsp":
        assert rows[0]["wait_s"] == pytest.approx(0.008) and rows[1]["wait_s"] == 0.0
        assert rows[0]["exposed_comm_s"] == pytest.approx(0.004) and rows[1]["exposed_comm_s"] == pytest.approx(0.004)
        assert late == [{"op": "ps.step", "rank": 1, "share": 1.0, "calls": 2,
                         "others_wait_s_per_step": pytest.approx(0.004)}]
    else:
        assert rows[0]["wait_s"] == 0.0 and rows[0]["exposed_comm_s"] == pytest.approx(0.012)
        assert late == []


def test_starved_compute_is_not_the_ranks_own_work(tmp_path):
    """Rank 1 computed 7 ms of wall time but got only 4 ms of CPU: it waited 3 ms for a core,
    so its own work equals rank 0's and nobody is a straggler."""
    two_ranks(tmp_path)
    lines = (tmp_path / "rank-1.jsonl").read_text().replace('"cpu_s": 0.007', '"cpu_s": 0.004')
    (tmp_path / "rank-1.jsonl").write_text(lines)
    rows = analysis.breakdown(analysis.load(chrome.merge(str(tmp_path))))
    assert rows[1]["starved_s"] == pytest.approx(0.006)
    assert analysis.stragglers(rows) == []


def test_a_large_trace_is_gzipped_and_still_read(tmp_path):
    two_ranks(tmp_path)
    path = chrome.merge(str(tmp_path), gzip_above=0)
    assert path.endswith("trace.json.gz")
    with gzip.open(path, "rt") as f:
        assert json.load(f)["traceEvents"]
    assert analysis.find_trace(str(tmp_path)) == path
    assert len(analysis.breakdown(analysis.load(str(tmp_path)))) == 2


def test_a_message_waits_for_its_sender(tmp_path):
    """A receive posted at 1 ms whose send starts at 5 ms waited 4 ms for rank 0."""
    msg = {"group": "world", "src": 0, "dst": 1, "tag": 3, "n": 0, "bytes": 8}
    write_rank(tmp_path, 0, [["isend", "comm", "comm world", 0.005, 0.0051, {**msg, "rank": 0, "posted": True}]])
    write_rank(tmp_path, 1, [["recv", "comm", "comm world", 0.001, 0.006, {**msg, "rank": 1}]])
    events = analysis.load(chrome.merge(str(tmp_path)))
    (wait,) = [e for e in events if e.get("cat") == "wait"]
    assert wait["pid"] == 1 and wait["dur"] == pytest.approx(4000) and wait["args"]["for_rank"] == 0
    assert sorted(e["ph"] for e in events if e.get("cat") == "flow") == ["f", "s"]


def test_no_files_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="--trace"):
        chrome.merge(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--trace"):
        analysis.load(str(tmp_path))


def test_spans_record_only_while_on(tmp_path):
    with recorder.span("before"):
        pass
    recorder.start(str(tmp_path), "rank", 0)
    try:
        with recorder.span("mine", answer=42):
            pass

        @recorder.span("decorated", "compute")
        def f():
            return 7
        assert f() == 7
    finally:
        recorder.stop()
    with recorder.span("after"):
        pass
    lines = (tmp_path / "rank-0.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["role"] == "rank"
    names = [json.loads(x)[0] for x in lines[1:-1]]
    assert names == ["mine", "decorated"]
    assert json.loads(lines[-1]) == {"end": True}   # stopped: the file is complete
    from paratrain.trace import chrome
    assert chrome.finished(str(tmp_path / "rank-0.jsonl"))
    assert json.loads(lines[1])[5] == {"answer": 42}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_pipeline_actions_span_counts_the_cpu_of_its_own_work(tmp_path, monkeypatch, schedule):
    """Each F, B and W span's ``cpu_s`` is the CPU its thread spent from the span's start to
    its end: with this thread's CPU clock replaced by the wall clock, the two agree. Under
    1F1B a B that runs its W at once is one span, and its CPU covers the whole of it (the
    trace's ``starved`` is its wall less its CPU)."""
    import time

    import torch

    import paratrain as pt
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()) for _ in range(6)],
                                torch.nn.Linear(256, 10))
    group = pt.init(backend="shm")
    try:
        stage = pt.pipeline.split(model, group=group, stages=1)
        pipe = pt.Pipeline(stage, group=group, microbatches=2, schedule=schedule,
                           loss_fn=torch.nn.functional.cross_entropy)
        monkeypatch.setattr(time, "thread_time", time.perf_counter)
        recorder.start(tmp_path, "rank", 0, count_cpu=True)
        try:
            pipe.step(torch.randn(256, 256), torch.randint(0, 10, (256,)))
        finally:
            recorder.stop()
    finally:
        pt.destroy()
    spans = [json.loads(line) for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()[1:-1]]
    actions = [(name, end - start, args["cpu_s"]) for name, category, _, start, end, args in spans
               if category == "compute"]
    assert sorted({name for name, _, _ in actions}) == (["B", "F", "W"] if schedule == "zb-h1" else ["B", "F"])
    for name, wall, cpu in actions:
        assert 0.95 * wall <= cpu <= wall, (name, wall, cpu)
