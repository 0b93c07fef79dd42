"""`paratrain train --strategy zero --stage N`: pt.ZeRO end to end through the CLI,
against --strategy allreduce on the same job."""
import json

import pytest
import torch

from test_train import _digits_params, front_end, ok, run_dirs, side_by_side


def _run(folder):
    (run,) = run_dirs(folder)
    return run, torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.timeout(300)
def test_zero_stages_train_as_allreduce_and_resume_across_stages_and_strategies(tmp_path):
    common = ["--model", "digits", "--optimizer", "adam", "--lr", "0.01", "--eval-every", "2"]
    for res in side_by_side((tmp_path / "dp", *common, "--steps", "4"),
                            (tmp_path / "z3", *common, "--steps", "4", "--strategy", "zero", "--stage", "3")):
        ok(res)
    dp_run, dp = _run(tmp_path / "dp")
    z3_run, z3 = _run(tmp_path / "z3")
    _same(dp, z3)
    summary = json.loads((z3_run / "summary.json").read_text())
    held, formula = sum(summary["zero_bytes_per_worker"].values()), summary["zero_bytes_formula"]
    assert abs(held - formula) <= 0.10 * formula, (summary["zero_bytes_per_worker"], formula)
    # the ZeRO checkpoint (whole model, whole Adam state) resumes at stage 1 on 3 workers
    # exactly as allreduce's own checkpoint resumes allreduce on 3 workers
    dp_on, res = side_by_side(
        (tmp_path / "dp-on", *common, "--steps", "6", "--workers", "3", "--resume", str(dp_run / "checkpoint.pt")),
        (tmp_path / "z-on", *common, "--steps", "6", "--workers", "3", "--strategy", "zero", "--stage", "1",
         "--resume", str(z3_run / "checkpoint.pt"), "--straggler", "1:3"))
    ok(dp_on)
    ok(res)
    assert "starts afresh" not in res.stdout
    z1_run, z1 = _run(tmp_path / "z-on")
    _same(_run(tmp_path / "dp-on")[1], z1)
    # rank 1 computes 3x slower (it sleeps, which changes no number): the others wait for it in
    # stage 1's reduce-scatters, inside the engine's step, and report that as waiting
    workers = {w["rank"]: w for w in json.loads((z1_run / "summary.json").read_text())["per_worker"]}
    assert workers[1]["slowdown_s"] > 0 and workers[0]["slowdown_s"] == 0
    assert workers[0]["comm_wait_s"] > 0.5 * workers[1]["slowdown_s"], workers
    # the bytes each rank handed to collectives: stage 1 reduce-scatters and gathers n a step (2
    # steps here, n padded to a multiple of 3 a unit); stage 3 gathers twice more (and to evaluate)
    n = sum(p.numel() * 4 for p in _digits_params())
    stage1 = json.loads((z1_run / "summary.json").read_text())["bytes_communicated"]
    assert 2 * 2 * n <= stage1 <= 2 * 2 * n * 1.01, (stage1, n)
    assert summary["bytes_communicated"] >= 4 * 3 * n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--stage", "2"], "--stage is for --strategy zero"),
    (["--strategy", "zero", "--stage", "4"], "invalid choice: 4"),
    (["--strategy", "zero", "--compression", "bf16"], "--compression is for --strategy allreduce"),
    (["--strategy", "zero", "--tp", "2", "--model", "gpt"], "--tp is for --strategy allreduce or pipeline"),
])
def test_bad_zero_options_are_refused_before_anything_starts(tmp_path, args, message):
    res = front_end(tmp_path, *args)
    assert res.returncode != 0 and message in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]


@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_exactly_and_only_where_it_was_written(tmp_path):
    """--checkpoint-format sharded: each worker writes its own chunks (worker 0 checkpoint.pt,
    worker 1 checkpoint.rank1.pt); resuming from them continues exactly as the run that never stopped;
    another --workers or --stage is refused saying what to do."""
    common = ["--model", "digits", "--optimizer", "adam", "--lr", "0.01", "--eval-every", "2",
              "--strategy", "zero", "--stage", "2"]
    for res in side_by_side((tmp_path / "straight", *common, "--steps", "6"),
                            (tmp_path / "first", *common, "--steps", "4", "--checkpoint-format", "sharded")):
        ok(res)
    (first,) = run_dirs(tmp_path / "first")
    assert sorted(p.name for p in first.glob("checkpoint*.pt")) == ["checkpoint.pt", "checkpoint.rank1.pt"]
    shard = torch.load(first / "checkpoint.rank1.pt", weights_only=True)["model"]
    assert shard["zero_sharded"]["rank"] == 1 and shard["optimizer"]["state"], shard["zero_sharded"]
    res, wider, stage1 = side_by_side(
        (tmp_path / "then", *common, "--steps", "6", "--resume", str(first)),
        (tmp_path / "wider", *common, "--steps", "6", "--workers", "3", "--resume", str(first)),
        (tmp_path / "stage1", *common[:-1], "1", "--steps", "6", "--resume", str(first)))
    ok(res)
    assert "starts afresh" not in res.stdout
    _same(_run(tmp_path / "straight")[1], _run(tmp_path / "then")[1])
    out = wider.stdout + wider.stderr
    assert wider.returncode != 0 and "--checkpoint-format full" in out and "workers" in out, out[-2000:]
    assert stage1.returncode != 0 and "saved with stage 2, this run has 1" in stage1.stdout + stage1.stderr, \
        stage1.stderr[-2000:]
