"""Gradient compression: top-k and 1-bit with error feedback, on real
collectives (tests/workers/compression.py), and through paratrain train."""
import concurrent.futures

import pytest

from conftest import launch, passed_on_every_rank


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_compressors_lose_nothing_and_return_the_average_of_what_was_sent(n):
    res = launch(n, "compression.py")
    passed_on_every_rank(res, "compression", n)


def _summary(folder):
    import json

    from test_train import run_dirs
    (run,) = run_dirs(folder)
    return json.loads((run / "summary.json").read_text())


def _bytes_per_step(folder):
    """Each step's bytes in metrics.jsonl (rank 0's, what went on the wire)."""
    import json

    from test_train import run_dirs
    (run,) = run_dirs(folder)
    return [json.loads(line).get("bytes", 0) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_compressed_training_reaches_the_uncompressed_accuracy_on_digits(tmp_path):
    """paratrain train (digits, its defaults: 500 steps of SGD with momentum on 2 workers)
    with --compression topk:0.01, onebit and powersgd:4 ends within 1 accuracy point of
    the same run uncompressed, having sent a small share of its bytes."""
    from test_train import ok, train
    specs = ("none", "topk:0.01", "onebit", "powersgd:4")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:   # two jobs at a time
        for res in pool.map(lambda spec: train(tmp_path / spec.replace(":", "-"), "--compression", spec), specs):
            ok(res)
    plain = _summary(tmp_path / "none")
    # PowerSGD sends the digits CNN's many small tensors (biases, 3x3 kernels) whole: 9% of the bytes
    for spec, share in (("topk:0.01", 0.05), ("onebit", 0.05), ("powersgd:4", 0.10)):
        got = _summary(tmp_path / spec.replace(":", "-"))
        assert got["accuracy"] >= plain["accuracy"] - 0.01, (spec, got["accuracy"], plain["accuracy"])
        assert got["bytes_communicated"] <= share * plain["bytes_communicated"], (spec, got["bytes_communicated"])
        # digits trains with SGD: top-k takes its momentum (DGC's momentum correction), the others leave it
        assert got["compression"].startswith(spec) and ("momentum correction" in got["compression"]) == (
            spec.startswith("topk")), got["compression"]
        steps = _bytes_per_step(tmp_path / spec.replace(":", "-"))   # every step counted, adding up to the total
        assert len(steps) == 500 and all(b > 0 for b in steps) and sum(steps) == got["bytes_communicated"], spec


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec,message", [("topk:2", "in (0, 1]"), ("powersgd:x", "powersgd takes the rank"),
                                          ("zip", "unknown compression 'zip'")])
def test_bad_compression_is_refused_before_anything_starts(tmp_path, spec, message):
    from test_train import front_end
    res = front_end(tmp_path, "--compression", spec)
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


def _push_round_trip(spec, sizes, steps=3):
    """What a worker's pushes of pieces of ``sizes`` entries to one server decode to there,
    against what its compressor sent."""
    import numpy as np
    import torch

    from paratrain.ps import push_codecs
    codec, n = push_codecs.PushCodec(spec), sum(sizes)
    codec.prepare([sizes])
    for step in range(steps):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(step)).numpy()
        packed, code, meta, payload = codec.encode(0, grad.copy())
        raw = memoryview(np.ascontiguousarray(payload)).cast("B")
        got = push_codecs.decode(meta, raw, sizes) if packed else push_codecs.widen(code, raw, n)
        yield codec, grad, got, raw.nbytes


@pytest.mark.parametrize("spec", ["topk:0.01", "onebit"])
def test_a_compressed_push_decodes_to_what_the_worker_sent(spec):
    """The server reads back exactly the worker's own contribution (topk: its (index, value)
    pairs, the smallest pieces whole; onebit: scale x sign, blocks counted in each piece),
    and the worker keeps the rest: sent + residual = the sum. A server's pieces go as one."""
    import torch
    sizes = (10_007, 64, 3, 1_000)
    n = sum(sizes)
    total, sent = torch.zeros(n), torch.zeros(n)
    for step, (codec, grad, got, nbytes) in enumerate(_push_round_trip(spec, sizes)):
        total += torch.from_numpy(grad)
        mine = codec.compressor.sent[0]
        mine = torch.zeros(n).index_put_((mine[0],), mine[1]) if isinstance(mine, tuple) else mine
        assert torch.equal(torch.from_numpy(got), mine), (spec, step)
        sent += mine
        assert torch.allclose(sent + codec.compressor.residual[0], total, atol=1e-5), (spec, step)
        assert nbytes <= 0.06 * 4 * n, (spec, nbytes)


@pytest.mark.parametrize("spec,tol", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_a_half_precision_push_is_the_gradient_rounded(spec, tol):
    for _, grad, got, nbytes in _push_round_trip(spec, (990, 10)):
        assert nbytes == 2000
        assert abs(got - grad).max() <= tol * abs(grad).max()


@pytest.mark.parametrize("meta,payload,message", [
    ({"codec": "zip"}, b"", "unknown push codec 'zip'"),
    ({"codec": "topk", "k": 3}, bytes(23), "needs 0 < k <= 100 and 8k payload bytes"),
    ({"codec": "topk", "k": 200}, bytes(1600), "needs 0 < k <= 100"),
    ({"codec": "topk", "k": 1}, (100).to_bytes(4, "little") + bytes(4), "offsets outside its 100 entries"),
    ({"codec": "topk", "k": 1}, (-1).to_bytes(4, "little", signed=True) + bytes(4), "offsets outside"),
    ({"codec": "onebit", "block": 32}, bytes(13), "needs 21 bytes, got 13"),
    ({"codec": "onebit", "block": "32"}, bytes(21), "positive int block"),
])
def test_a_bad_compressed_push_is_refused_saying_why(meta, payload, message):
    from paratrain.comm.errors import FrameError
    from paratrain.ps import push_codecs
    with pytest.raises(FrameError, match=message.replace("(", r"\(")):
        push_codecs.decode(meta, memoryview(payload), (60, 40))


def test_powersgd_is_refused_for_parameter_server_pushes():
    from paratrain.ps import push_codecs
    with pytest.raises(ValueError, match="all-reduce among workers"):
        push_codecs.PushCodec("powersgd:4")


@pytest.mark.timeout(300)
def test_compressed_pushes_train_digits_to_the_uncompressed_accuracy(tmp_path):
    """paratrain train --strategy ps (digits, BSP, 2 workers, 1 server) with its pushes as
    top-k 1%, 1-bit and fp16 ends within 1 accuracy point of plain pushes, the compressed
    ones pushing a small share of the bytes. Accuracy is the mean over three seeds for the
    lossy codecs: one seed's test accuracy moves by a point either way from the processor's
    rounding alone (359 test digits, 0.28 points each), for plain pushes too."""
    from test_train import ok, train

    def run(spec, seed):
        folder = tmp_path / f"{spec.replace(':', '-')}-{seed}"
        ok(train(folder, "--strategy", "ps", "--compression", spec, "--seed", str(seed)))
        return _summary(folder)
    seeds = {"none": (0, 1, 2), "topk:0.01": (0, 1, 2), "onebit": (0, 1, 2), "fp16": (0,)}
    # two jobs at a time: a BSP step waits on its server's round trips, which leaves a core idle
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {spec: [pool.submit(run, spec, seed) for seed in chosen] for spec, chosen in seeds.items()}
        runs = {spec: [f.result() for f in chosen] for spec, chosen in futures.items()}

    def accuracy(spec, chosen):
        return sum(r["accuracy"] for r, seed in zip(runs[spec], seeds[spec]) if seed in chosen) / len(chosen)
    plain_bytes = runs["none"][0]["bytes_pushed"]
    # top-k: 1% of the entries chosen and the smallest pieces (at most another 1%) whole, each
    # as an offset and a value, 8 bytes where plain pushes send 4
    for spec, share in (("topk:0.01", 0.04), ("onebit", 0.05), ("fp16", 0.51)):
        got, plain = accuracy(spec, seeds[spec]), accuracy("none", seeds[spec])
        assert got >= plain - 0.01, (spec, got, plain)
        assert runs[spec][0]["bytes_pushed"] <= share * plain_bytes, (spec, runs[spec][0]["bytes_pushed"], plain_bytes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["topk:0.01", "powersgd:2"])
def test_a_compressed_run_resumes_exactly_with_every_workers_residuals(tmp_path, spec):
    """Stopped at step 8 and resumed to 16, a run with error feedback (and top-k's
    momentum) reaches the bits of the run that never stopped: the checkpoint carries
    every worker's residuals, which differ between workers."""
    import torch

    from test_train import ok, run_dirs, train
    common = ["--batch-size", "64", "--eval-every", "100", "--compression", spec]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:   # the two runs side by side
        for res in pool.map(lambda steps: train(tmp_path / steps, *common, "--steps", steps), ("16", "8")):
            ok(res)
    (whole,), (first,) = run_dirs(tmp_path / "16"), run_dirs(tmp_path / "8")
    saved = torch.load(first / "checkpoint.pt", weights_only=True)["compression"]
    mine, theirs = saved["ranks"]
    residuals = [k for k in mine if k.startswith("residual/")]
    assert residuals and any(not torch.equal(mine[k], theirs[k]) for k in residuals)   # per worker
    res = train(tmp_path, *common, "--steps", "16", "--resume", str(first / "checkpoint.pt"))
    ok(res)
    notes = [line for line in res.stdout.splitlines() if line.startswith("[train]") and "compressor" in line]
    assert not notes, notes   # carried over as it was
    (resumed,) = run_dirs(tmp_path)
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint.pt", weights_only=True)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
