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
from paratrain.parallel.compression import OneBit, TopK

TOL = 1e-5


def close(a, b, what):
    err = float((a - b).abs().max())
    assert err <= TOL * max(1.0, float(b.abs().max())), f"{what}: off by {err:.3e}"


def invariants(g, make, name):
    hook = make()
    n = 1000
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
        assert hook.wire_bytes(flat) < n * 4 / 5, (name, hook.wire_bytes(flat))


def topk_one_is_plain(g):
    hook = TopK(1.0)
    grad = torch.randn(300, generator=torch.Generator().manual_seed(g.rank))
    flat = grad.clone()
    hook(g, 0, flat)
    everyone = torch.empty(g.world_size * 300)
    g.all_gather(everyone, grad)
    close(flat, everyone.view(g.world_size, 300).mean(0), "topk:1 equals the plain average")
    close(hook.residual[0], torch.zeros(300), "topk:1 leaves no residual")


def warmup(g):
    hook = TopK(0.01, warmup_steps=4)
    assert hook.density(0) == 1.0 and abs(hook.density(2) - 0.1) < 1e-12 and hook.density(4) == 0.01


def main():
    g = pt.init()
    invariants(g, lambda: TopK(0.05), "topk:0.05")
    invariants(g, OneBit, "onebit")
    topk_one_is_plain(g)
    warmup(g)
    print(f"compression passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
