"""`paratrain train --tp N`: the gpt model cut across N workers inside each
data-parallel replica, end to end through the CLI."""
import pytest
import torch

from test_train import ok, run_dirs, train


@pytest.mark.timeout(300)
def test_tp2_reaches_the_parameters_of_one_process_and_its_checkpoint_loads_anywhere(tmp_path):
    # SGD: Adam would turn float32 rounding in near-zero gradients into whole-step differences
    common = ["--model", "gpt", "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "4", "--steps", "4", "--eval-every", "2"]
    ok(train(tmp_path, *common, "--workers", "1"))
    res = train(tmp_path, *common, "--workers", "2", "--tp", "2")
    ok(res)
    single, cut = run_dirs(tmp_path)
    a = torch.load(single / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(cut / "checkpoint.pt", weights_only=True)["model"]
    assert set(a) == set(b)
    for k in a:   # gathered: one process's names and shapes
        assert a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k
    # the TP = 2 checkpoint resumes in one process and at TP = 2 with 2 replicas
    res = train(tmp_path, *common[:-4], "--steps", "6", "--workers", "1", "--resume", str(cut / "checkpoint.pt"))
    ok(res)
    assert "the optimizer starts afresh" in res.stdout
    ok(train(tmp_path, *common[:-4], "--steps", "6", "--workers", "4", "--tp", "2", "--resume",
             str(cut / "checkpoint.pt")))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,message", [
    (["--tp", "2", "--model", "digits"], "--tp cuts the gpt model"),
    (["--tp", "3", "--model", "gpt"], "--workers 2 is not a multiple of --tp 3"),
    (["--tp", "2", "--model", "gpt", "--strategy", "ps"], "--tp is for --strategy allreduce"),
])
def test_bad_tp_options_are_refused_before_anything_starts(tmp_path, args, message):
    res = train(tmp_path, *args)
    assert res.returncode != 0 and message in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]
