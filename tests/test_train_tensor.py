"""`paratrain train --tp N`: the gpt model cut across N workers inside each
data-parallel replica, end to end through the CLI."""
import pytest
import torch

from test_train import front_end, ok, run_dirs, side_by_side


def _model(folder):
    (run,) = run_dirs(folder)
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def _same(a, b):
    assert set(a) == set(b)
    for k in a:   # gathered: one process's names and shapes
        assert a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.timeout(300)
def test_tp2_with_sequence_parallelism_reaches_one_process_and_resumes_anywhere(tmp_path):
    # SGD with momentum: Adam would turn float32 rounding in near-zero gradients into whole-step
    # differences; the momentum is what a resume without the optimizer's state would lose
    common = ["--model", "gpt", "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "4", "--eval-every", "2"]
    for res in side_by_side((tmp_path / "one", *common, "--steps", "4", "--workers", "1"),
                            (tmp_path / "cut", *common, "--steps", "4", "--workers", "2", "--tp", "2",
                             "--sequence-parallel")):
        ok(res)
    _same(_model(tmp_path / "one"), _model(tmp_path / "cut"))
    # the TP = 2 checkpoint, optimizer state included, resumes in one process exactly as one
    # process's own checkpoint does, and at TP = 2 with 2 replicas
    one, cut = (run_dirs(tmp_path / name)[0] / "checkpoint.pt" for name in ("one", "cut"))
    results = side_by_side((tmp_path / "one-on", *common, "--steps", "6", "--workers", "1", "--resume", str(one)),
                           (tmp_path / "cut-on", *common, "--steps", "6", "--workers", "1", "--resume", str(cut)),
                           (tmp_path / "wide", *common, "--steps", "6", "--dp", "2", "--tp", "2", "--resume", str(one)))
    for res in results:
        ok(res)
    assert "starts afresh" not in results[1].stdout
    _same(_model(tmp_path / "one-on"), _model(tmp_path / "cut-on"))
    assert "on 4 workers" in results[2].stdout


def _stages(folder):
    (run,) = run_dirs(folder)
    whole = {}
    for path in sorted(run.glob("checkpoint*.pt")):   # one file per stage, each gathered over --tp
        whole.update(torch.load(path, weights_only=True)["model"])
    return whole, run / "checkpoint.pt"


@pytest.mark.timeout(300)
def test_pipeline_of_tensor_parallel_stages_reaches_one_process_and_resumes(tmp_path):
    """--strategy pipeline --stages 2 --tp 2 on 4 workers: each stage cut inside its
    layers across 2 workers; its per-stage checkpoints, gathered, are one process's
    parameters, and a resume continues as one process's own resume does."""
    common = ["--model", "gpt", "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "4", "--eval-every", "2"]
    cut = ["--pp", "2", "--tp", "2", "--microbatches", "2"]   # 4 workers: 1 replica x 2 stages x 2
    alone, res = side_by_side((tmp_path / "one", *common, "--steps", "4", "--workers", "1"),
                              (tmp_path / "cut", *common, "--steps", "4", *cut))
    ok(alone)
    ok(res)
    assert "tensor-parallel size" in res.stdout
    whole, first = _stages(tmp_path / "cut")
    _same(_model(tmp_path / "one"), whole)
    one = run_dirs(tmp_path / "one")[0] / "checkpoint.pt"
    for res in side_by_side((tmp_path / "one-on", *common, "--steps", "6", "--workers", "1", "--resume", str(one)),
                            (tmp_path / "cut-on", *common, "--steps", "6", *cut, "--resume", str(first))):
        ok(res)
    _same(_model(tmp_path / "one-on"), _stages(tmp_path / "cut-on")[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--tp", "2", "--model", "digits"], "--tp cuts a transformer (gpt, hf-gpt2, hf-bert, hf-llama"),
    (["--tp", "3", "--model", "gpt", "--workers", "2"], "--workers 2 is not a multiple of --tp 3"),
    (["--tp", "3", "--model", "gpt"], "--tp 3: VocabParallelEmbedding: num_embeddings 256 cannot be cut into 3"),
    (["--dp", "2", "--tp", "2", "--model", "gpt", "--workers", "2"], "--dp x --pp x --tp = 2 x 1 x 2 = 4"),
    (["--pp", "2", "--stages", "3", "--model", "gpt"], "--pp 2 and --stages 3 disagree"),
    (["--pp", "2", "--strategy", "ps"], "it is not for --strategy ps"),
    (["--tp", "2", "--model", "gpt", "--strategy", "ps"], "--tp is for --strategy allreduce"),
    (["--model", "gpt", "--sequence-parallel"], "give --tp 2 or more"),
    (["--model", "gpt", "--strategy", "pipeline", "--tp", "2", "-n", "2"],
     "--workers 2 is not a multiple of --stages x --tp = 4"),
    (["--model", "gpt", "--strategy", "pipeline", "--workers", "4", "--tp", "2", "--sequence-parallel"],
     "--sequence-parallel is for --strategy allreduce"),
])
def test_bad_tp_options_are_refused_before_anything_starts(tmp_path, args, message):
    res = front_end(tmp_path, *args)
    assert res.returncode != 0 and message in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]
