"""Gradient compression (issue 27): top-k and 1-bit with error feedback, on real
collectives (tests/workers/compression.py), and through paratrain train."""
import pytest

from conftest import launch


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_compressors_lose_nothing_and_return_the_average_of_what_was_sent(n):
    res = launch(n, "compression.py")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert out.count("compression passed on rank") == n, out[-4000:]


def _summary(folder):
    import json

    from test_train import run_dirs
    (run,) = run_dirs(folder)
    return json.loads((run / "summary.json").read_text())


@pytest.mark.timeout(300)
def test_compressed_training_reaches_the_uncompressed_accuracy_on_digits(tmp_path):
    """paratrain train (digits, its defaults: 500 steps of SGD with momentum on 2 workers)
    with --compression topk:0.01, onebit and powersgd:4 ends within 1 accuracy point of
    the same run uncompressed, having sent a small share of its bytes."""
    from test_train import ok, train
    ok(train(tmp_path / "none", "--compression", "none"))
    plain = _summary(tmp_path / "none")
    # PowerSGD sends the digits CNN's many small tensors (biases, 3x3 kernels) whole: 9% of the bytes
    for spec, share in (("topk:0.01", 0.05), ("onebit", 0.05), ("powersgd:4", 0.10)):
        ok(train(tmp_path / spec.replace(":", "-"), "--compression", spec))
        got = _summary(tmp_path / spec.replace(":", "-"))
        assert got["accuracy"] >= plain["accuracy"] - 0.01, (spec, got["accuracy"], plain["accuracy"])
        assert got["bytes_communicated"] <= share * plain["bytes_communicated"], (spec, got["bytes_communicated"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec,message", [("topk:2", "in (0, 1]"), ("powersgd:x", "powersgd takes the rank"),
                                          ("zip", "unknown compression 'zip'")])
def test_bad_compression_is_refused_before_anything_starts(tmp_path, spec, message):
    from test_train import train
    res = train(tmp_path, "--compression", spec)
    assert res.returncode != 0 and message in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]


@pytest.mark.parametrize("shape", ["normal", "heavy", "sparse", "ramp", "constant"])
@pytest.mark.parametrize("n,k", [(1_000_003, 10_000), (400_000, 400), (250_000, 20_000)])
def test_sampled_top_k_chooses_exactly_the_k_largest(shape, n, k):
    """DGC's sampled threshold (topk.largest) picks the same magnitudes as a full torch.topk,
    whatever the gradient's distribution (ties: the same values, any of the tied indices)."""
    import torch

    from paratrain.parallel.compression.topk import largest, largest_naive
    gen = torch.Generator().manual_seed(n + k)
    x = {"normal": lambda: torch.randn(n, generator=gen),
         "heavy": lambda: torch.randn(n, generator=gen) ** 5,
         "sparse": lambda: torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.02),
         "ramp": lambda: torch.arange(n, dtype=torch.float32),
         "constant": lambda: torch.ones(n)}[shape]().abs()
    got = largest(x, k, gen)
    assert got.numel() == k and got.unique().numel() == k
    assert torch.equal(x[got].sort().values, x[largest_naive(x, k)].sort().values)
