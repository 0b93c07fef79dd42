"""`paratrain train` end to end: the CLI a user runs, with real worker processes.

Short runs of the digits task (the default). What is checked: the run
directory holds per-step metrics, a summary with the numbers the table shows,
a PNG and a checkpoint; a run stopped at step k and resumed reaches exactly
the parameters of an uninterrupted run (across an epoch boundary); bad input
gets a clear error before any worker starts.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import python_m

ROOT = Path(__file__).resolve().parent.parent


def train(tmp_path, *args, timeout=150):
    env = dict(os.environ, PARATRAIN_TIMEOUT="60")
    return python_m(["paratrain", "train", "--runs", str(tmp_path / "runs"), *map(str, args)], env, timeout=timeout)


def side_by_side(*jobs):
    """``train(*job)`` for each job, two at a time; the results in the jobs' order. A job of
    2 workers leaves part of the 2 cores idle (starting up, waiting on a peer or a server),
    which the other job fills."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: train(*job), jobs))


def front_end(tmp_path, *args):
    """paratrain train's front-end called in this process, for options it refuses before
    anything starts: the same exit code and messages as ``train``, without a new Python."""
    import contextlib
    import io

    from paratrain.train import job
    argv = ["--runs", str(tmp_path / "runs"), *map(str, args)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = job.main(argv)
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def run_dirs(tmp_path):
    return sorted((tmp_path / "runs").iterdir())


def ok(res):
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


@pytest.mark.timeout(180)
def test_default_task_trains_and_writes_its_run_directory(tmp_path):
    res = train(tmp_path, "--steps", "40", "--eval-every", "20")
    ok(res)
    (run,) = run_dirs(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(r["loss"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learned something in 40 steps
    assert "accuracy" in rows[19] and "accuracy" in rows[39]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == 40 and summary["model"] == "digits"
    assert summary["accuracy"] > 0.3  # chance is 0.1
    assert summary["samples_per_s"] > 0 and summary["bytes_communicated"] > 0
    assert summary["bytes_communicated"] == 40 * sum(p.numel() * 4 for p in _digits_params())
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoint.pt").exists()
    out = res.stdout
    assert "samples/s" in out and str(run) in out  # the summary table, printed by the front-end


def _digits_params():
    from paratrain.train.tasks import build_task
    return list(build_task("digits").model.parameters())


@pytest.mark.timeout(120)
def test_a_fresh_worker_reports_the_peak_heap_of_a_forked_one(tmp_path):
    """paratrain train starts a fork server of its own first (launch/warm.py: it imports torch,
    torch._dynamo and matplotlib while the front-end checks the options) and forks its
    workers from it; PARATRAIN_WARM_START=0 starts them fresh. The summary says which, and
    the server's folder is gone after the run. peak_memory_mb counts the heap a worker
    allocates above where it began: a fresh worker, which imports torch._dynamo only at
    the optimizer's first step (23 MiB of heap), reports the peak of a forked one for the
    same run: 7-8 MiB for digits."""
    import concurrent.futures
    import shutil
    import tempfile
    args = ["--workers", "1", "--steps", "3", "--eval-every", "3"]   # digits
    env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_FORKSERVER"}   # the front-end's own choice

    def run(kind, warm):   # (the front-end itself forked from the suite's server, its worker not)
        temporary = Path(tempfile.mkdtemp(prefix="pt-", dir="/tmp"))   # (pytest's own: too deep for a socket)
        try:
            res = python_m(["paratrain", "train", "--runs", str(tmp_path / kind / "runs"), *args],
                           dict(env, PARATRAIN_TIMEOUT="60", PARATRAIN_WARM_START=warm, TMPDIR=str(temporary)),
                           timeout=100)
            ok(res)
            assert "start fresh" not in res.stdout + res.stderr, res.stdout + res.stderr
            assert not list(temporary.glob("paratrain-fork-*")), kind   # the server and its socket are gone
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        return json.loads((run_dirs(tmp_path / kind)[0] / "summary.json").read_text())
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        summaries = dict(zip(("fresh", "forked"), pool.map(run, ("fresh", "forked"), ("0", "1"))))
    assert summaries["fresh"]["started"] == "a fresh interpreter"
    assert summaries["forked"]["started"] == "a fork of a process with torch imported"
    peaks = [summaries[kind]["peak_memory_mb"] for kind in ("fresh", "forked")]
    assert peaks[0] == pytest.approx(peaks[1], abs=2), peaks   # MiB


@pytest.mark.timeout(240)
def test_resume_reaches_the_same_parameters_as_an_uninterrupted_run(tmp_path):
    # batch 64 x 2 workers: the digits training split is about 11 steps an epoch, so 8 + 8 crosses one
    common = ["--batch-size", "64", "--eval-every", "100"]
    for res in side_by_side((tmp_path / "16", *common, "--steps", "16"), (tmp_path / "8", *common, "--steps", "8")):
        ok(res)
    (whole,), (first,) = run_dirs(tmp_path / "16"), run_dirs(tmp_path / "8")
    ok(train(tmp_path, *common, "--steps", "16", "--resume", str(first / "checkpoint.pt")))
    (resumed,) = run_dirs(tmp_path)
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert a["step"] == b["step"] == 16
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    c = torch.load(first / "checkpoint.pt", weights_only=True)
    assert any(not torch.equal(a["model"][k], c["model"][k]) for k in a["model"])  # it did train on


@pytest.mark.timeout(120)
def test_gloo_backend_runs_the_same_job(tmp_path):
    ok(train(tmp_path, "--steps", "5", "--backend", "torch"))
    summary = json.loads((run_dirs(tmp_path)[0] / "summary.json").read_text())
    assert summary["backend"] == "torch" and summary["steps"] == 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--model", "resnet"], "invalid choice: 'resnet'"),
    (["--steps", "0"], "must be at least 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--strategy", "ps", "--consistency", "ssp"], "--consistency ssp needs --staleness"),
    (["--strategy", "ps", "--resume", "x.pt"], "not available yet"),
    (["--resume", "nowhere/checkpoint.pt"], "nowhere/checkpoint.pt"),
    (["--straggler", "2:3"], "no rank 2 among 2 workers"),
    (["--jitter", "0.5:0.5"], "FACTOR must be a finite number >= 1"),
])
def test_bad_input_is_refused_before_anything_starts(tmp_path, args, message):
    res = front_end(tmp_path, *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert not (tmp_path / "runs").exists() or not run_dirs(tmp_path)  # nothing was started


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    ok(train(tmp_path, "--steps", "2"))
    ckpt = run_dirs(tmp_path)[0] / "checkpoint.pt"
    res = front_end(tmp_path, "--model", "mlp", "--resume", str(ckpt))
    assert res.returncode == 2
    assert "digits" in res.stderr and "mlp" in res.stderr


@pytest.mark.timeout(240)
def test_parameter_server_bsp_reaches_the_weights_of_allreduce(tmp_path):
    """The same job (model, data order, SGD with momentum) with the optimizer on 2
    parameter servers under BSP, and with DataParallel: the same weights, up to the
    roundings of the servers' numpy optimizer."""
    common = ["--steps", "12", "--optimizer", "sgd", "--eval-every", "100"]
    for res in side_by_side((tmp_path / "allreduce", *common),
                            (tmp_path / "ps", *common, "--strategy", "ps", "--servers", "2", "--consistency", "bsp")):
        ok(res)
    (allreduce,), (ps,) = run_dirs(tmp_path / "allreduce"), run_dirs(tmp_path / "ps")
    summary = json.loads((ps / "summary.json").read_text())
    assert summary["strategy"] == "ps" and summary["backend"] == "zeromq, 2 servers, bsp"
    a = torch.load(allreduce / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(ps / "checkpoint.pt", weights_only=True)["model"]
    for k in a:
        err = (a[k] - b[k]).abs().max() / a[k].abs().max()
        assert err < 1e-4, (k, float(err))
