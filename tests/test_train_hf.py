"""`paratrain train --model hf-*`: Hugging Face models through the main job, end to end.

GPT-2 as it ships (input and output embeddings tied) under ZeRO-3, tensor
parallelism and a pipeline reaches the same parameters as one process on the
same batches. The strategies' own tests check every family to 1e-10 in
float64 (test_hf_zero.py, test_hf_tensor.py, test_hf_pipeline.py); this one
checks that the job wires them up: the model, its plan, its cut, its
checkpoint.
"""
import pytest
import torch

from test_train import ok, run_dirs, side_by_side

COMMON = ["--model", "hf-gpt2", "--optimizer", "sgd", "--lr", "0.1", "--steps", "3", "--eval-every", "3"]


def _whole(folder):
    """The model's parameters, from every checkpoint file of the run (a pipeline writes one per stage)."""
    (run,) = run_dirs(folder)
    whole = {}
    for path in sorted(run.glob("checkpoint*.pt")):
        whole.update(torch.load(path, weights_only=True)["model"])
    return whole


def _same(a, b, what):
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))[:6]}"
    for k in a:
        assert a[k].shape == b[k].shape, f"{what}: {k}"
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), f"{what}: {k} off by {(a[k] - b[k]).abs().max():.2e}"


@pytest.mark.timeout(400)
def test_tied_gpt2_under_zero3_tensor_and_pipeline_equals_one_process(tmp_path):
    runs = {
        # one worker with batch 4 reads the same 4 windows a step as 2 workers with batch 2 each
        "one": ["--workers", "1", "--batch-size", "4"],
        "zero3": ["--strategy", "zero", "--stage", "3", "--workers", "2", "--batch-size", "2"],
        "tp2": ["--tp", "2", "--workers", "2", "--batch-size", "4"],                   # one replica, cut in 2
        "pp2": ["--pp", "2", "--microbatches", "2", "--batch-size", "4"],              # one replica, 2 stages
    }
    for res in side_by_side(*((tmp_path / name, *COMMON, *args) for name, args in runs.items())):
        ok(res)
    one = _whole(tmp_path / "one")
    assert torch.equal(one["hf.lm_head.weight"], one["hf.transformer.wte.weight"])   # still tied
    for name in ("zero3", "tp2", "pp2"):
        _same(_whole(tmp_path / name), one, name)
