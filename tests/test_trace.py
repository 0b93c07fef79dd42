"""`paratrain train --trace` under every strategy, `paratrain run --trace` on a user's script,
and `paratrain trace` naming a straggler: each trace must be valid Chrome JSON whose figures
agree with what the ranks did. (The allreduce run also writes TensorBoard's scalars.)"""
import json
import os
import sys

import pytest

from conftest import ROOT, python_m
from test_train import front_end, ok, run_dirs, side_by_side, train

from paratrain.trace import analysis

STRATEGIES = {
    "allreduce": ("--model", "digits", "--tensorboard", "--eval-every", "6", "--steps", "12"),
    "pipeline": ("--model", "mlp", "--pp", "2", "--steps", "8"),
    "tensor": ("--model", "gpt", "--tp", "2", "--batch-size", "8", "--steps", "4"),
    "zero": ("--model", "mlp", "--strategy", "zero", "--stage", "3", "--steps", "8"),
    "ps": ("--model", "mlp", "--strategy", "ps", "--consistency", "ssp", "--staleness", "1", "--steps", "8"),
    "compressed": ("--model", "mlp", "--compression", "topk:0.05", "--steps", "8"),
}


def check_chrome(events):
    """What a viewer needs: complete events with ts, dur, pid, tid; flows paired; names for
    every process and thread that has events."""
    complete = [e for e in events if e["ph"] == "X"]
    assert complete
    for e in complete:
        assert {"ts", "dur", "pid", "tid", "name", "cat"} <= set(e) and e["dur"] >= 0, e
    assert not [e for e in events if e["ph"] in ("B", "E")]   # only complete events: nothing to balance
    flows = {}
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            flows.setdefault(e["id"], []).append(e["ph"])
    for phases in flows.values():
        assert phases[0] == "s" and phases[-1] == "f" and set(phases[1:-1]) <= {"t"}, phases
    named = {(e["pid"], e.get("tid")) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= named


def same_sequence_on_every_rank(events):
    """Every group's collectives, in sequence-id order, are the same calls on every member."""
    calls = {}
    for e in events:
        a = e.get("args") or {}
        if e["ph"] == "X" and e["cat"] == "comm" and "seq" in a:
            calls.setdefault(a["group"], {}).setdefault(e["pid"], []).append((a["seq"], e["name"], a["bytes"]))
    assert calls
    for group, per_rank in calls.items():
        lists = [sorted(v) for v in per_rank.values()]
        assert all(x == lists[0] for x in lists), group
        assert len(per_rank) == len(next(e["args"]["ranks"] for e in events if e.get("args", {}).get("group") == group))
    return calls


def check_tensorboard(run):
    """`--tensorboard`'s event files hold the run's numbers: read back with TensorBoard's own
    reader and compared with metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def scalars(folder):
        acc = EventAccumulator(str(run / "tb" / folder))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    job = scalars("job")
    assert [s for s, _ in job["loss"]] == [r["step"] for r in rows]
    assert [v for _, v in job["loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [v for _, v in job["comm/wait_s"]] == pytest.approx([r["comm_wait_seconds"] for r in rows], rel=1e-5)
    evals = [(r["step"], r["accuracy"]) for r in rows if "accuracy" in r]
    assert [s for s, _ in job["eval/accuracy"]] == [s for s, _ in evals] == [6, 12]
    assert [v for _, v in job["eval/accuracy"]] == pytest.approx([v for _, v in evals], rel=1e-6)
    assert all(v > 0 for _, v in job["samples_per_s"])
    for rank in (0, 1):
        times = scalars(f"rank-{rank}")["step_time_s"]
        assert [s for s, _ in times] == list(range(1, 13)) and all(v > 0 for _, v in times)
    assert [v for _, v in scalars("rank-0")["step_time_s"]] == \
        pytest.approx([r["step_seconds"] for r in rows], abs=1e-4)


@pytest.mark.timeout(420)
def test_every_strategy_traces_a_valid_timeline_whose_breakdown_adds_up(tmp_path):
    results = side_by_side(*[(tmp_path / name, *args, "--trace") for name, args in STRATEGIES.items()])
    for name, res in zip(STRATEGIES, results):
        ok(res)
        (run,) = run_dirs(tmp_path / name)
        assert (run / "trace.png").stat().st_size > 0 and "straggler" in res.stdout, name
        events = analysis.load(str(run))
        check_chrome(events)
        rows = analysis.breakdown(events)
        assert [r["rank"] for r in rows] == [0, 1], name
        for r in rows:
            parts = r["compute_s"] + r["data_s"] + r["exposed_comm_s"] + r["wait_s"] + r["idle_s"]
            assert parts == pytest.approx(r["step_s"], rel=0.05), (name, r)
            assert r["compute_s"] > 0, (name, r)
        steps = int(STRATEGIES[name][-1])   # --steps comes last; under SSP a faster worker takes more of the batches
        counted = [r["steps"] for r in rows]
        assert (sum(counted) == 2 * steps) if name == "ps" else counted == [steps, steps], (name, counted)
        names = {e["name"] for e in events if e["ph"] == "X"}
        assert {"step", "data", "optimizer.step" if name != "ps" else "ps.pull"} <= names, (name, names)
        if name == "ps":   # the servers step the optimizer
            assert {"ps.step", "push"} & names or {"ps.push", "ps.pull"} <= names, names
            assert any(e["pid"] >= 1000 for e in events if e["ph"] == "X"), "the server traces too"
            stale = analysis.staleness(events)   # every pull of every step, within SSP's bound
            assert [w["worker"] for w in stale] == [0, 1] and all(w["reads"] >= 8 for w in stale), stale
            assert all(0 <= w["max_lag"] <= 1 for w in stale), stale
            continue
        calls = same_sequence_on_every_rank(events)
        if name == "pipeline":
            assert {"F", "B"} <= names and all("bubble" in r for r in rows)
            sends = [e for e in events if e["ph"] == "X" and e["name"] in ("isend", "send")]
            assert sends and any(e.get("cat") == "wait" for e in events)   # receives split at their sender's start
        else:
            assert {"forward", "backward"} <= names, (name, names)
        purposes = {e["args"].get("for") for e in events if e.get("cat") == "comm" and "seq" in e.get("args", {})}
        if name == "tensor":   # each layer's collectives, forward and backward, under its name
            # mlp.0 is column-parallel (its all-reduce is in backward), mlp.2 row-parallel (forward)
            assert {"blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0"} <= purposes, purposes
        if name == "zero":   # each unit's gathers and reduce-scatters, and its frees
            frees = {e["args"]["unit"] for e in events if e.get("cat") == "memory"}
            assert frees and frees <= purposes, (frees, purposes)
        if name == "compressed":
            assert {"topk encode", "topk decode"} <= names and "bucket 0" in purposes, (names, purposes)
        if name == "allreduce":
            assert any(op == "all_reduce" for calls_of in calls["world"].values() for _, op, _ in calls_of)
            check_tensorboard(run)   # (the same run: one launch fewer)


def test_a_users_script_is_traced_with_its_own_spans(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(
        "import torch, paratrain as pt\n"
        "pt.init()\n"
        "model = pt.DataParallel(torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    with pt.trace.span('my step', 'step'):\n"
        "        with pt.trace.span('my data', 'data', track='data'):\n"
        "            x = torch.randn(4, 8)\n"
        "        model(x).sum().backward()\n"
        "        opt.step(); opt.zero_grad()\n"
        "pt.destroy()\n")
    trace_dir = tmp_path / "tr"
    env = dict(os.environ, PARATRAIN_TIMEOUT="60")
    res = python_m(["paratrain", "run", "-n", "2", "--trace", str(trace_dir), str(script)], env)
    ok(res)
    assert "trace.json" in res.stderr
    events = analysis.load(str(trace_dir))
    check_chrome(events)
    assert {"my step", "my data", "forward", "backward", "optimizer.step", "all_reduce"} <= \
        {e["name"] for e in events if e["ph"] == "X"}
    rows = analysis.breakdown(events)
    assert [r["steps"] for r in rows] == [3, 3]
    header = json.loads((trace_dir / "rank-1.jsonl").read_text().splitlines()[0])
    assert abs(header["offset_s"]) <= header["uncertainty_s"] + 50e-6   # one host: one clock
    out = python_m(["paratrain", "trace", str(trace_dir), "--json", "--no-plot"], env)
    ok(out)
    figures = json.loads(out.stdout)
    assert {"rank", "compute_s", "exposed_comm_s", "wait_s", "idle_s", "overlap"} <= set(figures["ranks"][0])
    assert figures["stragglers"] == [] or {"rank", "factor"} <= set(figures["stragglers"][0])


@pytest.mark.alone   # the straggler's factor is measured: another test's job on the cores moves it
@pytest.mark.timeout(300)
def test_paratrain_trace_names_the_straggler_and_only_it(tmp_path):
    slow = train(tmp_path / "slow", "--model", "gpt", "--workers", "3", "--steps", "20", "--straggler", "1:1.3",
                 "--trace")
    ok(slow)
    even = train(tmp_path / "even", "--model", "gpt", "--workers", "3", "--steps", "20", "--trace")
    ok(even)
    env = dict(os.environ)
    for where, expect in (("slow", [1]), ("even", [])):
        (run,) = run_dirs(tmp_path / where)
        res = python_m(["paratrain", "trace", str(run), "--json", "--no-plot"], env)
        ok(res)
        found = json.loads(res.stdout)["stragglers"]
        assert [s["rank"] for s in found] == expect, (where, res.stdout)
        if expect:   # 1.3 asked; 3 workers share 2 cores, and the others' time starved of a core is
            # taken out of their own work but the straggler's sleep is not: up to 1.45 seen on a busy host
            assert 1.2 <= found[0]["factor"] <= 1.5, found
    assert "straggler: rank 1" in slow.stdout


def test_without_tensorboard_the_flag_says_how_to_get_it(tmp_path, monkeypatch):
    from paratrain.train import tensorboard
    monkeypatch.setattr(tensorboard, "installed", lambda: False)
    res = front_end(tmp_path, "--tensorboard")
    assert res.returncode == 2 and "pip install -e '.[tensorboard]'" in res.stderr


def test_paratrain_trace_says_what_is_missing(tmp_path):
    from paratrain.trace.command import main
    assert main([str(tmp_path)]) == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}"]))
