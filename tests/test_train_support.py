"""paratrain train's support files: metrics log, plot, summary table, checkpoints,
progress lines and their display, and the launcher's on_line hook.

All fast and in this process, except the few launcher tests, which start one
tiny worker each.
"""
import io
import json
import math
import os
import sys
import textwrap

import numpy as np
import pytest
import torch
from rich.console import Console

from paratrain.launch.local import main as launch
from paratrain.launch.worker import emit
from paratrain.train.checkpoint import FORMAT, load_checkpoint, save_checkpoint
from paratrain.train.metrics import (MetricsLog, format_bytes, jsonable, plot_loss, read_metrics,
                                     render_summary)
from paratrain.train.progress import PROGRESS_MARK, ProgressDisplay, ProgressReporter, parse_progress


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def console(terminal=False):
    return Console(file=io.StringIO(), width=120, force_terminal=terminal)


# -- metrics.jsonl ------------------------------------------------------------

def test_metrics_round_trip_converts_scalars(tmp_path):
    run = tmp_path / "runs" / "a"
    with MetricsLog(run) as log:
        log.log(step=1, time=0.5, loss=torch.tensor(2.5), lr=np.float32(0.125), n=np.int64(7), note="warm")
        log.log(step=2, time=1.0, loss=float("nan"), accuracy=torch.tensor([0.75]))
    path = run / "metrics.jsonl"
    rows = read_metrics(path)
    assert rows == [{"step": 1, "time": 0.5, "loss": 2.5, "lr": 0.125, "n": 7, "note": "warm"},
                    {"step": 2, "time": 1.0, "loss": None, "accuracy": 0.75}]
    for line in path.read_text().splitlines():  # strict JSON: no NaN token
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


def test_metrics_refuse_non_scalars():
    with pytest.raises(TypeError, match="weights"):
        jsonable(torch.zeros(3), "weights")
    with pytest.raises(TypeError, match="model"):
        jsonable(object(), "model")


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    with MetricsLog(tmp_path) as log:
        for s in range(3):
            log.log(step=s, loss=1.0 / (s + 1))
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # the run died mid-write
    with pytest.warns(UserWarning, match="last line"):
        rows = read_metrics(path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Appending again (a resumed log) starts on a clean line.
    with MetricsLog(tmp_path) as log:
        log.log(step=3, loss=0.25)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]


def test_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


# -- plot ---------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("eval_key", ["accuracy", "eval_loss", None])
def test_plot_writes_a_png(tmp_path, eval_key):
    with MetricsLog(tmp_path) as log:
        for s in range(1, 61):
            row = {"step": s, "time": 0.05 * s, "loss": 2.0 * math.exp(-s / 20)}
            if eval_key and s % 20 == 0:
                row[eval_key] = 0.5 + s / 200
            log.log(**row)
    png = tmp_path / "loss.png"
    assert plot_loss(tmp_path / "metrics.jsonl", png, "mlp: allreduce, 2 workers") == png
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # an 800x450 figure with lines and text, not an empty image


def test_plot_of_an_empty_log(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    png = plot_loss(tmp_path / "metrics.jsonl", tmp_path / "p.png", "empty")
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE) and png


# -- summary table ------------------------------------------------------------

@pytest.mark.parametrize("n, text", [(0, "0 B"), (999, "999 B"), (1536, "1.54 KB"), (12_300_000, "12.3 MB"),
                                     (456_000_000, "456 MB"), (2.5e9, "2.50 GB"), (3e15, "3000 TB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_summary_table_shows_the_values():
    summary = {
        "model": "digits", "strategy": "allreduce", "workers": 2, "steps": 600, "resumed_from": None,
        "final_loss": 0.123456, "accuracy": 0.975, "samples_per_s": 12345.6, "time_total_s": 12.34,
        "time_training_s": 10.0, "time_compute_s": 8.0, "time_comm_wait_s": 2.0,
        "bytes_communicated": 1_500_000, "run_dir": "runs/20250101-000000-digits",
        "plot": "runs/20250101-000000-digits/loss.png", "custom_key": "kept as is",
    }
    con = console()
    render_summary(summary, console=con)
    out = con.file.getvalue()
    for needle in ["digits", "allreduce", "600", "final loss", "0.1235", "97.50%", "12,346 samples/s",
                   "12.3 s", "communication (exposed wait)", "2.00 s (20% of training)", "8.00 s (80% of training)",
                   "1.50 MB", "runs/20250101-000000-digits/loss.png", "custom_key", "kept as is"]:
        assert needle in out, needle
    assert "resumed" not in out  # None: left out
    assert "eval loss" not in out  # missing: left out


def test_summary_table_shows_the_workers_and_the_staleness():
    summary = {"model": "digits", "strategy": "ps", "samples_per_s": 1000.0, "batches_total": 30,
               "staleness_histogram": {"0": 90, "1": 10}, "lost_workers": [{"rank": 2, "batches_at_last_heartbeat": 4}],
               "per_worker": [
                   {"rank": 0, "batches": 20, "share": 2 / 3, "compute_s": 1.0, "slowdown_s": 0.0, "comm_wait_s": 0.5,
                    "loop_s": 2.0, "last_loss": 0.5},
                   {"rank": 1, "batches": 10, "share": 1 / 3, "compute_s": 0.5, "slowdown_s": 1.0,
                    "comm_wait_s": 0.25, "loop_s": 2.0, "last_loss": None}]}
    con = console()
    render_summary(summary, console=con)
    out = con.file.getvalue()
    for needle in ["0: 90 (90%), 1: 10 (10%)", "2: 4", "per worker", "66.7%", "33.3%", "0.5000", "1.00 s"]:
        assert needle in out, needle
    assert "'rank'" not in out  # per_worker is its own table, not a dict dumped into a cell


def test_a_long_staleness_histogram_is_summed_up():
    from paratrain.train.metrics import _histogram
    h = {str(lag): 10 for lag in range(10)}  # 100 reads, lags 0..9 evenly
    assert _histogram(h) == "100 reads: 10% at lag 0, median 4, 90th percentile 8, max 9"


def test_time_to_target():
    from paratrain.train.metrics import time_to_target
    rows = [{"step": i + 1, "time": 0.5 * (i + 1), "loss": 3.0 - 0.1 * i} for i in range(30)]
    rows[11]["eval_loss"] = 2.0   # at time 6.0
    rows[15]["eval_loss"] = 1.5   # at time 8.0
    out = time_to_target(rows, 1.6, window=4)
    # the mean of 4 losses ending at step k is 3.15 - 0.1 * (k - 1), <= 1.6 first at k = 17 (time 8.5)
    assert out == {"target_loss": 1.6, "time_to_target_s": 8.5, "time_to_target_eval_s": 8.0}
    assert time_to_target(rows, 0.01) == {"target_loss": 0.01, "time_to_target_s": None,
                                          "time_to_target_eval_s": None}


def test_job_numbers_from_the_workers_reports():
    from paratrain.train.summary import job_numbers
    reports = {r: {"rank": r, "batches": b, "compute_s": 1.0, "slowdown_s": 0.0, "slowed_steps": 0,
                   "comm_wait_s": 0.1, "loop_s": t, "last_loss": loss}
               for r, b, t, loss in [(0, 30, 2.0, 0.5), (1, 10, 2.5, float("nan")), (2, 20, 2.4, 0.7)]}
    out = job_numbers(reports, [], batch_size=8, mean_loss=True)
    assert out["batches_total"] == 60 and out["time_wall_training_s"] == 2.5
    assert out["samples_per_s"] == 60 * 8 / 2.5
    assert [w["share"] for w in out["per_worker"]] == [0.5, 10 / 60, 20 / 60]
    assert out["final_loss"] == pytest.approx(0.6)  # a NaN last loss is left out of the mean
    assert out["lost_workers"] is None


# -- slow workers and the batch pool ---------------------------------------------

def test_slowdown_specs_are_parsed_and_checked():
    import argparse
    from paratrain.train.slowdown import jitter_spec, straggler_spec
    assert straggler_spec("1:3") == (1, 3.0) and jitter_spec("0.3:2.5") == (0.3, 2.5)
    for bad, message in [("1", "RANK:FACTOR"), ("a:3", "RANK:FACTOR"), ("-1:3", ">= 0"), ("1:0.5", ">= 1"),
                         ("1:inf", "finite")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            straggler_spec(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="probability"):
        jitter_spec("1.5:2")


def test_slowdown_sleeps_factor_minus_one_times_the_compute():
    from paratrain.train.slowdown import Slowdown
    slept = []
    both = Slowdown(1, seed=0, straggler=(1, 3.0), jitter=(1.0, 2.0), sleep=slept.append)
    both.after_compute(0.01)
    assert slept == [pytest.approx((3 * 2 - 1) * 0.01)]  # a straggler that also hiccups: the factors multiply
    other = Slowdown(0, seed=0, straggler=(1, 3.0), sleep=slept.append)
    assert not other.active and other.after_compute(0.01) == 0.0 and len(slept) == 1
    assert other.steps == 1 and other.compute_s == 0.01 and other.slowed_steps == 0


def test_jitter_decisions_depend_on_seed_and_rank_only():
    from paratrain.train.slowdown import Slowdown

    def decisions(seed, rank, n=2000):
        s = Slowdown(rank, seed=seed, jitter=(0.3, 2.0), sleep=lambda t: None)
        return [s.factor() > 1 for _ in range(n)]
    a = decisions(0, 1)
    assert a == decisions(0, 1)                       # reproducible
    assert a != decisions(1, 1) and a != decisions(0, 2)  # seed and rank both matter
    assert 0.25 < sum(a) / len(a) < 0.35              # with probability P


def test_shared_pool_hands_out_exactly_the_total():
    import threading
    from torch.distributed import HashStore
    from paratrain.train.coordination import Lockstep, SharedPool
    store, total = HashStore(), 1000
    pools = [SharedPool(store, total) for _ in range(4)]

    def drain(pool):
        while pool.take():
            pass
    threads = [threading.Thread(target=drain, args=(p,)) for p in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(p.taken for p in pools) == total
    lock = Lockstep(5, start=2)
    assert [lock.take() for _ in range(4)] == [True, True, True, False]


def test_store_board_gives_up_on_a_silent_worker(monkeypatch):
    from torch.distributed import HashStore
    from paratrain.train import coordination
    from paratrain.train.coordination import StoreBoard
    monkeypatch.setattr(coordination, "STALL_MIN", 0.3)
    store = HashStore()
    StoreBoard(store, 1, 3, timeout=30).gather({"rank": 1, "batches": 5})
    StoreBoard(store, 2, 3, timeout=30).beat(7, 1.0)   # alive once, then never reports
    reports, lost = StoreBoard(store, 0, 3, timeout=30).gather({"rank": 0, "batches": 9})
    assert sorted(reports) == [0, 1] and reports[1]["batches"] == 5
    assert lost == [{"rank": 2, "batches_at_last_heartbeat": 7}]


# -- checkpoints --------------------------------------------------------------

CONFIG = {"name": "mlp", "model": "MLP", "sizes": [4, 8, 3]}


def trained_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"config": dict(CONFIG), "step": 7, "model": model.state_dict(), "optimizer": opt.state_dict()}


def test_checkpoint_round_trip(tmp_path):
    state = trained_state()
    path = tmp_path / "run" / "checkpoint.pt"
    save_checkpoint(path, state)
    assert "format" not in state  # the caller's dict is left alone
    assert os.listdir(path.parent) == ["checkpoint.pt"]  # no temporary file left
    loaded = load_checkpoint(path, expect_config=dict(CONFIG))
    assert loaded["format"] == FORMAT and loaded["step"] == 7
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for i, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(loaded["optimizer"]["state"][i][k], v)
    assert load_checkpoint(path.parent, expect_config=CONFIG)["step"] == 7  # a run dir works too


def test_checkpoint_write_that_fails_leaves_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"config": CONFIG, "step": 1})

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"config": CONFIG, "step": 2})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
    assert load_checkpoint(path, CONFIG)["step"] == 1


def test_checkpoint_refuses_what_it_could_not_load_safely(tmp_path):
    with pytest.raises(TypeError, match=r"state\['extra'\] is a ndarray"):
        save_checkpoint(tmp_path / "c.pt", {"config": CONFIG, "extra": np.zeros(2)})
    with pytest.raises(ValueError, match="'config'"):
        save_checkpoint(tmp_path / "c.pt", {"step": 1})
    assert not os.listdir(tmp_path)


def test_checkpoint_of_another_model(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"config": CONFIG, "step": 1})
    other = {"name": "digits", "model": "DigitsCNN", "input": [1, 8, 8], "classes": 10}
    with pytest.raises(ValueError) as e:
        load_checkpoint(path, expect_config=other)
    msg = str(e.value)
    assert str(path) in msg and "saved by model mlp" in msg and "builds digits" in msg
    assert "sizes=[4, 8, 3]" in msg and "'DigitsCNN'" in msg and "--model mlp" in msg
    changed = dict(CONFIG, sizes=[4, 16, 3])
    with pytest.raises(ValueError, match=r"builds mlp \(sizes=\[4, 16, 3\]\): the model's architecture changed"):
        load_checkpoint(path, expect_config=changed)


def test_checkpoint_missing(tmp_path):
    path = tmp_path / "runs" / "nope" / "checkpoint.pt"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nope.*runs/<id>/checkpoint\.pt"):
        load_checkpoint(path, CONFIG)


class Boom:
    """Unpickling this would create a file: weights_only loading must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("kind", ["garbage", "truncated", "plain_torch", "code", "other_format"])
def test_checkpoint_corrupt_or_foreign(tmp_path, kind):
    path = tmp_path / "checkpoint.pt"
    marker = tmp_path / "code-ran"
    if kind == "garbage":
        path.write_bytes(os.urandom(300))
    elif kind == "truncated":
        save_checkpoint(path, trained_state())
        path.write_bytes(path.read_bytes()[:500])
    elif kind == "plain_torch":
        torch.save({"model": {"w": torch.ones(2)}}, path)
    elif kind == "code":
        torch.save({"format": FORMAT, "config": CONFIG, "x": Boom(str(marker))}, path)
    else:
        torch.save({"format": "paratrain-checkpoint-99", "config": CONFIG}, path)
    with pytest.raises(ValueError, match="not a paratrain checkpoint|paratrain-checkpoint-99") as e:
        load_checkpoint(path, CONFIG)
    assert str(path) in str(e.value)
    assert not marker.exists()


# -- progress: the worker side ------------------------------------------------

def test_reporter_throttles_and_always_sends_the_last_step():
    clock, out = FakeClock(), io.StringIO()
    rep = ProgressReporter(10, enabled=True, min_interval=0.5, clock=clock, file=out)
    for step in range(1, 11):
        rep.update(step, loss=torch.tensor(1.0 / step), samples_per_s=100.0 * step)
        clock.t += 0.2  # 0.2 s per step: one line every third step
    lines = out.getvalue().rstrip("\n").split("\n")  # not splitlines(): it breaks at the mark's \x1e
    assert all(line.startswith(PROGRESS_MARK) for line in lines)
    msgs = [json.loads(line[len(PROGRESS_MARK):]) for line in lines]
    assert [m["step"] for m in msgs] == [1, 4, 7, 10]
    assert msgs[-1] == {"step": 10, "total": 10, "loss": pytest.approx(0.1), "samples_per_s": 1000.0}
    assert parse_progress(lines[0])["step"] == 1


def test_disabled_reporter_is_silent(capsys):
    rep = ProgressReporter(3, enabled=False)
    for s in range(1, 4):
        rep.update(s, loss=1.0)
    assert capsys.readouterr().out == ""


def test_reporter_prints_to_stdout_by_default(capsys):
    ProgressReporter(1, enabled=True).update(1, loss=float("nan"))
    line = capsys.readouterr().out
    assert line.startswith(PROGRESS_MARK) and line.endswith("\n")
    assert math.isnan(parse_progress(line.rstrip("\n"))["loss"])


# -- progress: the launcher side ----------------------------------------------

def mark(step, total=600, **fields):
    return PROGRESS_MARK + json.dumps({"step": step, "total": total, **fields})


def test_plain_display_prints_a_status_now_and_then():
    clock, con = FakeClock(), console()
    with ProgressDisplay("mlp x2", console=con, interval=5.0, clock=clock) as d:
        assert not d.live
        assert d.on_line(None, "stdout", "an ordinary line") is False
        for step in range(1, 601):
            clock.t += 0.125  # 75 s in all: a status line every 5 s, not 600 lines
            assert d.on_line(None, "stdout", mark(step, loss=1.0 / step, samples_per_s=1234.0)) is True
    lines = con.file.getvalue().splitlines()
    assert len(lines) == 16  # steps 1, 41, 81, ..., 561, and the last
    assert lines[0] == "mlp x2: step 1/600 (0%) loss 1 1,234 samples/s elapsed 0:00 ETA ?"
    assert lines[3] == "mlp x2: step 121/600 (20%) loss 0.008264 1,234 samples/s elapsed 0:15 ETA 0:59"
    assert lines[-1] == "mlp x2: step 600/600 (100%) loss 0.001667 1,234 samples/s elapsed 1:15"


def test_plain_display_prints_the_last_state_when_the_job_stops_early():
    clock, con = FakeClock(), console()
    with ProgressDisplay("t", console=con, interval=5.0, clock=clock) as d:
        d.on_line(None, "stdout", mark(1, total=100))
        clock.t += 1
        d.on_line(None, "stdout", mark(2, total=100))
    lines = con.file.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["t: step 1/100", "t: step 2/100"]


@pytest.mark.parametrize("bad", [
    PROGRESS_MARK + "{not json",
    PROGRESS_MARK + "[1, 2]",
    PROGRESS_MARK + '{"total": 5}',
    PROGRESS_MARK + '{"step": "3", "total": 5}',
    PROGRESS_MARK + '{"step": 3, "total": 0}',
    PROGRESS_MARK + '{"step": true, "total": 5}',
    PROGRESS_MARK + '{"step": NaN, "total": 5}',
    PROGRESS_MARK,
])
@pytest.mark.parametrize("terminal", [False, True])
def test_malformed_progress_lines_pass_through(bad, terminal):
    con = console(terminal)
    with ProgressDisplay("t", console=con) as d:
        assert d.on_line(None, "stdout", bad) is False
        assert d.on_line(None, "stdout", mark(1, total=2, loss="oops", samples_per_s=None)) is True
    assert d.last["step"] == 1


def visible_lines(raw):
    """What a terminal would keep of each line: the text after the last carriage
    return, without escape sequences."""
    import re
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def test_live_bar_keeps_other_output_above_it():
    con = console(terminal=True)
    real_stdout = sys.stdout
    with ProgressDisplay("mlp x2", console=con) as d:
        assert d.live
        assert getattr(sys.stdout, "buffer", None) is None  # so emit() uses .write(), through rich
        d.on_line(None, "stdout", mark(5, total=10, loss=0.5, samples_per_s=99.0))
        emit("stdout", b"[rank 1] hello from a worker\n")
        print("[rank 0] printed [bold]not markup[/bold]")
        d.on_line(None, "stdout", mark(10, total=10, loss=0.25, samples_per_s=100.0))
    assert sys.stdout is real_stdout
    lines = visible_lines(con.file.getvalue())
    assert "[rank 1] hello from a worker" in lines  # a whole line of its own, not glued to the bar
    assert "[rank 0] printed [bold]not markup[/bold]" in lines
    final = [line for line in lines if "10/10" in line]
    assert final and "loss 0.25" in final[-1] and "100 samples/s" in final[-1]
    assert PROGRESS_MARK not in con.file.getvalue()


# -- the launcher's on_line hook ----------------------------------------------

WORKER = """
    import sys
    print("before")
    print({mark!r} + '{{"step": 3, "total": 3, "loss": 0.5}}')
    print("to err", file=sys.stderr)
    print("after")
"""


def worker_script(tmp_path):
    path = tmp_path / "w.py"
    path.write_text(textwrap.dedent(WORKER.format(mark=PROGRESS_MARK)))
    return str(path)


@pytest.mark.timeout(60)
def test_launcher_routes_marked_lines_to_on_line(tmp_path, capfd):
    seen = []

    def on_line(worker, stream, text):
        seen.append((worker.rank, stream, text))
        return text.startswith(PROGRESS_MARK)

    assert launch(["-n", "1", worker_script(tmp_path)], on_line=on_line) == 0
    cap = capfd.readouterr()
    assert cap.out.split("\n") == ["[rank 0] before", "[rank 0] after", ""]
    assert cap.err.split("\n") == ["[rank 0] to err", ""]
    marked = [s for s in seen if s[2].startswith(PROGRESS_MARK)]
    assert marked == [(0, "stdout", PROGRESS_MARK + '{"step": 3, "total": 3, "loss": 0.5}')]
    assert {s[2] for s in seen} == {"before", "after", "to err", marked[0][2]}


@pytest.mark.timeout(60)
def test_launcher_with_plain_display(tmp_path, capfd):
    with ProgressDisplay("job") as d:
        assert launch(["-n", "1", worker_script(tmp_path)], on_line=d.on_line) == 0
    raw = capfd.readouterr().out
    out = raw.split("\n")
    assert out[:1] == ["[rank 0] before"] and "[rank 0] after" in out
    assert any(line.startswith("job: step 3/3 (100%) loss 0.5") for line in out)
    assert "paratrain-progress" not in raw


@pytest.mark.timeout(60)
def test_a_failing_hook_does_not_stop_the_output(tmp_path, capfd):
    def on_line(worker, stream, text):
        raise RuntimeError("bug in the hook")

    assert launch(["-n", "1", worker_script(tmp_path)], on_line=on_line) == 0
    cap = capfd.readouterr()
    assert "[rank 0] before" in cap.out and "[rank 0] after" in cap.out
    assert "output hook failed on rank 0's output (RuntimeError: bug in the hook)" in cap.err


def test_the_workers_step_torchs_fused_optimizers_with_the_same_arithmetic():
    """make_optimizer gives torch's fused kernels: SGD's steps equal the default's bit for
    bit, Adam's to rounding, on gradients 99% zero as top-k leaves them; the servers get
    the hyper-parameters alone (their own optimizers take no torch kernel option)."""
    from paratrain.ps.optimizers import make_optimizer as server_optimizer
    from paratrain.train.optimizer import make_optimizer, optimizer_class

    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    for name, tolerance in (("sgd", 0.0), ("adam", 1e-6)):
        fused = [torch.nn.Parameter(t.clone()) for t in start]
        plain = [torch.nn.Parameter(t.clone()) for t in start]
        ours = make_optimizer(name, fused, lr=1e-2)
        cls, hyper = optimizer_class(name, 1e-2)
        reference = cls(plain, **hyper)
        assert all(group["fused"] for group in ours.param_groups)
        assert not any(group["fused"] for group in reference.param_groups)
        for _ in range(20):
            for p, q in zip(fused, plain):
                p.grad = torch.randn_like(p) * (torch.rand_like(p) < 0.01)
                q.grad = p.grad.clone()
            ours.step()
            reference.step()
        for p, q in zip(fused, plain):
            assert float((p - q).detach().abs().max()) <= tolerance, name
        assert any(float((p.detach() - t).abs().max()) > 0 for p, t in zip(fused, start))   # it stepped
        server_optimizer(name, **hyper)
