"""Every script in examples/, run as its docstring says (`paratrain run -n 2`, with
one parameter server for train_ps.py), once each, checked against what does not
depend on paratrain:

- pipeline, tensor and ZeRO are exact: the losses the example prints equal those of
  one process training the example's own model (its make_model and make_data) with
  plain torch on the whole batch, here in the test;
- data parallel (train_custom.py) finds the regression's true weights;
- the parameter server (asynchronous under SSP) and compressed gradients (lossy)
  learn: the loss on all the data falls under half of where it started, and the
  compressor sends a fraction of plain averaging's bytes.

The examples' jobs all start at once (a module fixture, which waits for them all)
and each test checks its own: most of a job's time is two workers importing torch,
which leaves cores idle between its phases that the other jobs use.
"""
import importlib.util
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT

EXAMPLES = ROOT / "examples"
JOB_TIMEOUT = 150   # seconds for the jobs, all six sharing the machine; together they take about 30 on 2 quiet cores
STEPS, LR = 30, 3e-3

JOBS = {  # script: (what `paratrain run -n 2` is given before the script, the script's arguments)
    "train_custom.py": ([], ["--epochs", 3]),
    "train_pipeline.py": ([], ["--steps", STEPS, "--batch-size", 64, "--microbatches", 4, "--lr", LR]),
    "train_tensor.py": ([], ["--tp", 2, "--steps", STEPS, "--batch-size", 32, "--lr", LR]),
    "train_zero.py": ([], ["--stage", 3, "--steps", STEPS, "--batch-size", 64, "--lr", LR]),
    "train_ps.py": (["--servers", 1], ["--consistency", "ssp", "--staleness", 2, "--steps", 60]),
    "train_compressed.py": ([], ["--compression", "powersgd", "--epochs", 2]),
}


def load(script):
    """The example as a module, for its make_model and make_data (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed(out, pattern):
    """The numbers rank 0 printed in lines matching ``pattern`` (its groups), as floats."""
    lines = re.finditer(r"^\[rank 0\] " + pattern + r"$", out, re.M)
    found = [tuple(float(g.replace(",", "")) for g in m.groups()) for m in lines]
    assert found, f"no line like {pattern!r} in:\n{out[-3000:]}"
    return found


def one_process(example, batch_size, loss_of):
    """{step: loss} of plain torch in one process: Adam on rows [step * batch_size, +
    batch_size) of the example's data; ``loss_of(model, batch)`` a batch's loss."""
    model, data = example.make_model(), example.make_data()
    n = len(data[0]) if isinstance(data, tuple) else len(data)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = {}
    for step in range(STEPS):
        i = step * batch_size % n
        batch = tuple(t[i:i + batch_size] for t in data) if isinstance(data, tuple) else data[i:i + batch_size]
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
    return losses


def classify(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def assert_losses_of_one_process(out, reference):
    got = {int(step): loss for step, loss in printed(out, r"step (\d+): loss ([\d.]+)")}
    assert {0, STEPS - 1} <= set(got), got
    for step, loss in got.items():
        assert loss == pytest.approx(reference[step], abs=2e-5), f"step {step}: {loss}, one process {reference[step]}"
    assert got[STEPS - 1] < 0.5 * got[0], f"the loss did not fall: {got}"


def check_custom(out):
    (err,), = printed(out, r"largest error against the true weights: ([\d.]+)")
    assert err < 0.01


def check_pipeline(out):
    assert_losses_of_one_process(out, one_process(load("train_pipeline.py"), 64, classify))


def check_tensor(out):
    example = load("train_tensor.py")
    reference = one_process(example, 32, lambda model, ids: example.lm_loss(model(ids[:, :-1]), ids))
    assert_losses_of_one_process(out, reference)


def check_zero(out):
    assert_losses_of_one_process(out, one_process(load("train_zero.py"), 64, classify))
    (held, whole), = printed(out, r"rank 0 holds ([\d,]+) bytes of parameters and Adam state; "
                                  r"one process holds ([\d,]+)")
    assert held < 0.6 * whole   # stage 3 on 2 workers: half, and Adam's step counters


def assert_loss_halved(out):
    (before,), = printed(out, r"loss on all the data before training: ([\d.]+)")
    (after,), = printed(out, r"loss on all the data after training: ([\d.]+)")
    assert after < 0.5 * before


def check_compressed(out):
    assert_loss_halved(out)
    (sent, whole), = printed(out, r"powersgd: ([\d,]+) bytes sent a step, plain averaging sends ([\d,]+)")
    assert sent < 0.25 * whole


CHECKS = {"train_custom.py": check_custom, "train_pipeline.py": check_pipeline, "train_tensor.py": check_tensor,
          "train_zero.py": check_zero, "train_ps.py": assert_loss_halved, "train_compressed.py": check_compressed}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """{script: [its exit code, its output]}, for the examples this session selected, all
    started at once, once for the whole suite."""
    selected = sorted({item.callspec.params["script"] for item in request.session.items
                       if item.module is request.module and hasattr(item, "callspec")})
    return run_all(selected, tmp_path_factory)


def run_all(scripts, tmp_path_factory):
    env = dict(os.environ, PARATRAIN_TIMEOUT="60")
    started = {}
    try:
        for script in scripts:
            launcher, args = JOBS[script]
            out = tmp_path_factory.mktemp("example") / "output.txt"
            with open(out, "w") as f:
                started[script] = subprocess.Popen(
                    [sys.executable, "-m", "paratrain", "run", "-n", "2", *map(str, launcher), str(EXAMPLES / script),
                     *map(str, args)], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True), out
        deadline = time.monotonic() + JOB_TIMEOUT
        for job, _ in started.values():
            job.wait(timeout=max(0.1, deadline - time.monotonic()))
        return {script: [job.returncode, out.read_text()] for script, (job, out) in started.items()}
    finally:
        for job, _ in started.values():
            if job.poll() is None:   # one timed out: the launcher stops its workers on SIGTERM
                job.terminate()
                try:
                    job.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()


def test_every_example_is_run():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(JOBS) == sorted(CHECKS)


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("script", sorted(JOBS))
def test_example(jobs, script):
    returncode, output = jobs[script]
    assert returncode == 0, output[-4000:]
    CHECKS[script](output)
