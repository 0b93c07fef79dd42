"""`paratrain train --strategy pipeline` end to end: the CLI with real workers.

A 2-stage pipeline reaches the parameters of one process training on the same
batches (the allreduce strategy with one worker); a run stopped and resumed
from its per-stage checkpoints reaches exactly those of an uninterrupted run;
the run directory holds the timeline PNG and the summary the pipeline fields.
"""
import json

import pytest
import torch

from test_train import front_end, ok, run_dirs, side_by_side, train


def _stages(run, stages=2):
    """The model's tensors from every stage's checkpoint file, merged."""
    merged, step = {}, None
    for k in range(stages):
        state = torch.load(run / ("checkpoint.pt" if k == 0 else f"checkpoint.stage{k}.pt"), weights_only=True)
        assert not set(state["model"]) & set(merged), "two stages saved the same tensor"
        merged.update(state["model"])
        step = state["step"] if step is None else step
        assert state["step"] == step
    return merged, step


@pytest.mark.timeout(300)
def test_two_stages_reach_the_parameters_of_one_process(tmp_path):
    common = ["--model", "digits", "--batch-size", "32", "--steps", "8", "--eval-every", "100"]
    for res in side_by_side((tmp_path / "one", *common, "--workers", "1"),
                            (tmp_path / "piped", *common, "--workers", "2", "--strategy", "pipeline", "--stages", "2",
                             "--microbatches", "4", "--schedule", "zb-h1")):
        ok(res)
    (single,), (piped,) = run_dirs(tmp_path / "one"), run_dirs(tmp_path / "piped")
    a = torch.load(single / "checkpoint.pt", weights_only=True)["model"]
    b, step = _stages(piped)
    assert step == 8 and set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.timeout(300)
def test_resume_from_stage_checkpoints_is_exact(tmp_path):
    common = ["--model", "gpt", "--strategy", "pipeline", "--stages", "2", "--microbatches", "2",
              "--batch-size", "4", "--eval-every", "100"]
    for res in side_by_side((tmp_path / "6", *common, "--steps", "6"), (tmp_path / "3", *common, "--steps", "3")):
        ok(res)
    (whole,), (first,) = run_dirs(tmp_path / "6"), run_dirs(tmp_path / "3")
    ok(train(tmp_path, *common, "--steps", "6", "--resume", str(first / "checkpoint.pt")))
    (resumed,) = run_dirs(tmp_path)
    a, _ = _stages(whole)
    b, step = _stages(resumed)
    assert step == 6
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c, _ = _stages(first)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.timeout(300)
def test_gpt_pipeline_writes_its_timeline_and_summary(tmp_path):
    res = train(tmp_path, "--model", "gpt", "--strategy", "pipeline", "--stages", "2", "--microbatches", "4",
                "--schedule", "1f1b", "--steps", "4", "--batch-size", "8", "--eval-every", "2")
    ok(res)
    (run,) = run_dirs(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "pipeline" and summary["pipeline_stages"] == 2
    assert summary["pipeline_bubble_formula"] == pytest.approx(1 / 5)
    assert 0 < summary["pipeline_bubble"] < 1
    assert sum(summary["pipeline_parameters_per_stage"]) == sum(
        q.numel() for q in __import__("paratrain.train.tasks", fromlist=["x"]).build_task("gpt").model.parameters())
    assert summary["eval_loss"] > 0
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stages = json.loads((run / "timeline.json").read_text())["stages"]
    assert [sorted((k, mb) for k, mb, *_ in s) for s in stages] == [
        sorted((k, mb) for k in "FB" for mb in range(4))] * 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval_loss" in rows[1] and "eval_loss" in rows[3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--strategy", "pipeline", "--stages", "2", "--workers", "3"], "not a multiple of --stages 2"),
    (["--strategy", "pipeline", "--model", "recsys"], "--strategy pipeline cuts the"),
    (["--stages", "2"], "--stages is for --strategy pipeline"),
    (["--strategy", "pipeline", "--virtual", "2"], "--virtual is for --schedule interleaved"),
])
def test_bad_pipeline_options_are_refused_before_anything_starts(tmp_path, args, message):
    res = front_end(tmp_path, *args)
    assert res.returncode != 0 and message in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]
