"""Worker: the gradient compressors' invariants, on real collectives.

For each compressor, 6 steps of random buckets on each rank:
- error feedback loses nothing: what this rank sent, summed over the steps,
  plus its residual equals the sum of its gradients;
- what comes back is the average of every rank's sent vector (gathered
  densely here to check);
- top-k with ratio 1 (everything sent) is the plain average.
Then DataParallel with each compressor on a small model: the gradients it
leaves are that average of the ranks' compressed gradients.
"""
import sys

import torch

import paratrain as pt
from paratrain.parallel.compression import OneBit, PowerSGD, TopK

TOL = 1e-5


def close(a, b, what):
    err = float((a - b).abs().max())
    assert err <= TOL * max(1.0, float(b.abs().max())), f"{what}: off by {err:.3e}"


SHAPES = [(20, 40), (40,), (6, 8, 4), (8,)]   # 800 + 40 + 192 + 8 = 1040: two matrices, two vectors


def invariants(g, make, name):
    hook = make()
    n = 1040
    hook.prepare(g, [torch.zeros(n)], shapes=[SHAPES])
    total = torch.zeros(n)
    sent_total = torch.zeros(n)
    for step in range(6):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + g.rank))
        total += grad
        flat = grad.clone()
        hook(g, 0, flat)
        sent = hook.sent[0]
        mine = torch.zeros(n).index_put_((sent[0],), sent[1]) if isinstance(sent, tuple) else sent
        sent_total += mine
        everyone = torch.empty(g.world_size * n)
        g.all_gather(everyone, mine)
        close(flat, everyone.view(g.world_size, n).mean(0), f"{name} step {step}: the average of what was sent")
        close(sent_total + hook.residual[0], total, f"{name} step {step}: sent + residual = the gradients")
        assert hook.wire_bytes(flat) < n * 4 / 4, (name, hook.wire_bytes(flat))   # under a quarter of fp32


def topk_one_is_plain(g):
    hook = TopK(1.0)
    grad = torch.randn(300, generator=torch.Generator().manual_seed(g.rank))
    flat = grad.clone()
    hook(g, 0, flat)
    everyone = torch.empty(g.world_size * 300)
    g.all_gather(everyone, grad)
    close(flat, everyone.view(g.world_size, 300).mean(0), "topk:1 equals the plain average")
    close(hook.residual[0], torch.zeros(300), "topk:1 leaves no residual")


def powersgd_full_rank_is_plain(g):
    """At full rank the power iteration spans every column: the plain average, no residual."""
    hook = PowerSGD(rank=40, min_ratio=0.0)
    flat0 = torch.zeros(1040)
    hook.prepare(g, [flat0], shapes=[SHAPES])
    assert len(hook.plans[0][0]) == 2, hook.plans   # both matrices compressed, even at full rank
    for step in range(2):
        grad = torch.randn(1040, generator=torch.Generator().manual_seed(50 + 10 * step + g.rank), dtype=torch.float64)
        flat = grad.clone()
        hook(g, 0, flat)
        everyone = torch.empty(g.world_size * 1040, dtype=torch.float64)
        g.all_gather(everyone, grad)
        close(flat, everyone.view(g.world_size, 1040).mean(0), f"powersgd at full rank, step {step}")
        close(hook.residual[0], torch.zeros(1040, dtype=torch.float64), "powersgd at full rank: no residual")


def powersgd_skips_small_tensors(g):
    hook = PowerSGD(rank=4)
    hook.prepare(g, [torch.zeros(1040)], shapes=[SHAPES])
    flat = torch.zeros(1040)
    hook.prepare(g, [flat], shapes=[SHAPES])
    mats, rest = hook.plans[0]
    assert hook.wire_bytes(flat) == ((20 + 40) * 4 + 40 + 192 + 8) * 4
    assert [(m, n) for _, m, n, _ in mats] == [(20, 40)], mats       # 6 x 32 at rank 4 saves under 2x
    assert sum(n for _, n in rest) == 40 + 192 + 8, rest


def state_carries_over(g, make, name):
    """A compressor restored from ``checkpoint.gather`` after 3 steps goes on exactly as the one
    that never stopped; restored at another world size, every rank holds the ranks' mean residual."""
    from paratrain.parallel.compression import checkpoint
    a, b, c = make(), make(), make()
    for hook in (a, b, c):
        hook.prepare(g, [torch.zeros(1040)], shapes=[SHAPES])

    def grad(step):
        return torch.randn(1040, generator=torch.Generator().manual_seed(70 + 10 * step + g.rank))

    for step in range(3):
        a(g, 0, grad(step))
    saved = checkpoint.gather(g, a)
    assert saved["world_size"] == g.world_size and len(saved["ranks"]) == g.world_size
    assert checkpoint.restore(b, saved, g.rank, g.world_size) is None
    for step in range(3, 6):
        fa, fb = grad(step), grad(step)
        a(g, 0, fa)
        b(g, 0, fb)
        assert torch.equal(fa, fb), f"{name}: the restored compressor differs at step {step}"
    note = checkpoint.restore(c, saved, g.rank, g.world_size + 1)
    assert "mean" in note, note
    everyone = torch.stack([r["residual/0"] for r in saved["ranks"]])
    close(c.residual[0], everyone.mean(0), f"{name}: at another world size, the ranks' mean residual")
    try:
        checkpoint.restore(OneBit() if not isinstance(a, OneBit) else TopK(0.1), saved, g.rank, g.world_size)
    except ValueError as e:
        assert "resume with the --compression it was written with" in str(e), e
    else:
        raise AssertionError(f"{name}: another compressor's state was taken")
    other = make()
    other.prepare(g, [torch.zeros(1000)], shapes=[[(25, 40)]])
    try:
        checkpoint.restore(other, saved, g.rank, g.world_size)
    except ValueError as e:
        assert "bucket 0 has 1040 entries, this run's bucket 1000" in str(e), e
    else:
        raise AssertionError(f"{name}: a residual of another bucket size was taken")


def warmup(g):
    hook = TopK(0.01, warmup_steps=4)
    assert hook.density(0) == 0.25 and abs(hook.density(2) - 0.05) < 1e-12 and hook.density(4) == 0.01
    assert TopK(0.5, warmup_steps=4).density(0) == 0.5   # never below the ratio


def everyones_mean(g, t):
    everyone = torch.empty(g.world_size * t.numel(), dtype=t.dtype)
    g.all_gather(everyone, t.contiguous())
    return everyone.view(g.world_size, -1).mean(0)


def topk_sends_small_tensors_whole(g):
    """SHAPES' two vectors (48 entries) fit the budget of 5% of 1040 (52): both are sent on
    every step, and the k are the largest of the other 992 entries, 50 of them."""
    hook = TopK(0.05)
    hook.prepare(g, [torch.zeros(1040)], shapes=[SHAPES])
    vectors = torch.cat([torch.arange(800, 840), torch.arange(1032, 1040)])
    assert torch.equal(hook.whole[0], vectors), hook.whole
    others = torch.ones(1040, dtype=torch.bool)
    others[vectors] = False
    residual = torch.zeros(1040)
    for step in range(4):
        grad = torch.randn(1040, generator=torch.Generator().manual_seed(90 + 10 * step + g.rank))
        acc = residual + grad
        hook(g, 0, grad.clone())
        chosen = hook.sent[0][0]
        assert torch.equal(chosen[:48], vectors), f"step {step}: the vectors were not all sent"
        expected = others.nonzero().squeeze(1)[acc[others].abs().topk(50).indices]
        assert sorted(chosen[48:].tolist()) == sorted(expected.tolist()), f"step {step}: not the 50 largest"
        residual = acc.clone()
        residual[chosen] = 0.0
        close(hook.residual[0], residual, f"step {step}: the residual")
    off = TopK(0.05, small_whole=False)
    off.prepare(g, [torch.zeros(1040)], shapes=[SHAPES])
    assert not off.whole, off.whole
    # a bucket of small tensors only goes whole: the plain average, nothing left over
    hook = TopK(0.05)
    hook.prepare(g, [torch.zeros(1040), torch.zeros(4)], shapes=[SHAPES, [(4,)]])
    assert torch.equal(hook.whole[1], torch.arange(4)), hook.whole
    grad = torch.randn(4, generator=torch.Generator().manual_seed(130 + g.rank))
    flat = grad.clone()
    hook(g, 1, flat)
    close(flat, everyones_mean(g, grad), "a bucket of small tensors: the plain average")
    close(hook.residual[1], torch.zeros(4), "a bucket of small tensors: no residual")


def topk_momentum_masking_waits_for_the_warmup(g):
    """TopK(1.0) sends everything. During the warm-up its momentum correction is SGD's momentum
    (u = 0.9 u + g, the ranks' mean u returned); after it, DGC's masking clears u wherever an
    entry was sent, so with everything sent each step returns the plain mean gradient. Step 3 is
    the first after the warm-up: it still returns u, then clears it."""
    hook = TopK(1.0, momentum=0.9, warmup_steps=3, small_whole=False)
    u = torch.zeros(200, dtype=torch.float64)
    for step in range(6):
        grad = torch.randn(200, generator=torch.Generator().manual_seed(110 + step + 10 * g.rank), dtype=torch.float64)
        flat = grad.clone()
        hook(g, 0, flat)
        u = 0.9 * u + grad if step <= 3 else grad
        close(flat, everyones_mean(g, u), f"step {step}: {'momentum' if step <= 3 else 'masked'}")


def main():
    g = pt.init()
    invariants(g, lambda: TopK(0.05), "topk:0.05")
    invariants(g, OneBit, "onebit")
    invariants(g, lambda: PowerSGD(rank=2, keep_sent=True), "powersgd:2")
    powersgd_full_rank_is_plain(g)
    powersgd_skips_small_tensors(g)
    topk_one_is_plain(g)
    warmup(g)
    topk_sends_small_tensors_whole(g)
    topk_momentum_masking_waits_for_the_warmup(g)
    state_carries_over(g, lambda: TopK(0.05, momentum=0.9), "topk:0.05 with momentum")
    state_carries_over(g, OneBit, "onebit")
    state_carries_over(g, lambda: PowerSGD(rank=2), "powersgd:2")
    print(f"compression passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
