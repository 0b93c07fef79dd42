"""Worker: DataParallel against a single-process reference, through real processes.

Every rank also trains the reference itself: the same model (same seed), one
process, the whole global batch, the same optimizer. N workers with batch b
each must reach the reference's parameters (to 1e-5 relative) after several
steps. Modes:

  equiv    DataParallel (several small buckets) and DataParallelNaive vs the reference, SGD and Adam
  no_sync  k micro-batches under no_sync, then one synchronised: equals one batch of k x b x N
  unused   a branch only some ranks use in some steps: no hang, replicas stay equal
  join     ranks get different numbers of batches: no hang, replicas equal at the end
  mismatch rank 1 builds a different model: a clear error on every rank
  compress fp16 / bf16 bucket hooks: half the bytes, close to the reference
  linear_grads  linear layers' gradients computed straight into the buckets (linear_grads.py)
           equal autograd's path: a weight used twice and by F.linear, 3-d inputs, an
           in-place ReLU, a hooked weight, no_sync accumulation; no trace left on the modules
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt

STEPS = 5
BATCH = 8  # per worker


class Net(nn.Module):
    def __init__(self, hidden=32, extra=False):
        super().__init__()
        self.a = nn.Linear(10, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.side = nn.Linear(hidden, hidden)  # used only when asked (unused-parameter case)
        self.c = nn.Linear(hidden, 3)
        if extra:
            self.d = nn.Linear(3, 3)

    def forward(self, x, use_side=False):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        if use_side:
            h = h + torch.tanh(self.side(h))
        return self.c(h)


def data(step, n):
    g = torch.Generator().manual_seed(1234 + step)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


def make_opt(name, params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=1e-2)


def fresh():
    torch.manual_seed(0)
    return Net()


def compare(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-12)
        if err > 1e-5:
            raise AssertionError(f"{what}: parameter {name} differs from the single-process run by {err:.2e} (relative)")


def train_reference(opt_name, steps, global_batch, use_side=lambda step: False):
    ref = fresh()
    opt = make_opt(opt_name, ref.parameters())
    for step in range(steps):
        x, y = data(step, global_batch)
        F.cross_entropy(ref(x, use_side(step)), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def equiv(g, algorithm):
    P, me = g.world_size, g.rank
    for opt_name in ("sgd", "adam"):
        ref = train_reference(opt_name, STEPS, BATCH * P)
        for kind in ("bucketed", "naive"):
            torch.manual_seed(100 + me)  # different init on each rank: the broadcast must fix it
            local = Net()
            if kind == "bucketed":
                model = pt.DataParallel(local, bucket_mb=0.002, algorithm=algorithm)  # 2 KB: several buckets
                if g.backend == "shm" and len(model.buckets) < 3:
                    raise AssertionError(f"expected several buckets, got {len(model.buckets)}")
            else:
                model = pt.DataParallelNaive(local, algorithm=algorithm)
            # the broadcast makes every rank start from rank 0's init; the reference starts from seed 0
            with torch.no_grad():
                for p, q in zip(local.parameters(), fresh().parameters()):
                    if me == 0:
                        p.copy_(q)
                model.sync_module_states()
            opt = make_opt(opt_name, model.parameters())
            for step in range(STEPS):
                x, y = data(step, BATCH * P)
                xs, ys = x[me * BATCH:(me + 1) * BATCH], y[me * BATCH:(me + 1) * BATCH]
                F.cross_entropy(model(xs), ys).backward()
                opt.step()
                opt.zero_grad()
            compare(local, ref, f"{kind} {opt_name} (algorithm {algorithm})")
            if model.stats.allreduces == 0 or model.stats.bytes == 0:
                raise AssertionError(f"{kind}: no communication was counted: {model.stats}")


def no_sync(g):
    P, me, k = g.world_size, g.rank, 3
    ref = fresh()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data(0, k * BATCH * P)
    F.cross_entropy(ref(x), y).backward()
    opt_ref.step()
    model = pt.DataParallel(fresh(), bucket_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.stats.allreduces
    for i in range(k):
        lo = (i * P + me) * BATCH
        xs, ys = x[lo:lo + BATCH], y[lo:lo + BATCH]
        if i < k - 1:
            with model.no_sync():
                (F.cross_entropy(model(xs), ys) / k).backward()
            if model.stats.allreduces != before:
                raise AssertionError("no_sync() communicated")
        else:
            (F.cross_entropy(model(xs), ys) / k).backward()
    opt.step()
    compare(model.module, ref, "no_sync accumulation")


def unused(g):
    me = g.rank
    for cls in (pt.DataParallel, pt.DataParallelNaive):
        model = cls(fresh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x, y = data(step, BATCH)
            use_side = (step + me) % 2 == 0 and step != 3  # step 3: nobody uses it
            F.cross_entropy(model(x, use_side), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        check_replicas_equal(g, model.module, f"{cls.__name__} with unused parameters")


def join(g):
    P, me = g.world_size, g.rank
    model = pt.DataParallel(fresh(), bucket_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(3 + 2 * me):  # rank r has 3 + 2r batches
            x, y = data(step * P + me, BATCH)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    check_replicas_equal(g, model.module, "after join with uneven inputs")
    if P > 1:
        # the longest-running rank's model won: it took 3 + 2(P-1) steps; check it moved
        moved = sum((p - q).abs().sum() for p, q in zip(model.module.parameters(), fresh().parameters()))
        if not moved > 0:
            raise AssertionError("the model did not train")


def mismatch(g):
    try:
        torch.manual_seed(0)
        pt.DataParallel(Net(extra=g.rank == 1))
    except ValueError as e:
        if "different model" not in str(e):
            raise
        print(f"mismatch reported: {str(e).splitlines()[0]}")
        return
    raise AssertionError("a different model on rank 1 went unnoticed")


def compress(g):
    """fp16/bf16 hooks: half the bytes of float32, close to (not equal to) the reference."""
    P, me = g.world_size, g.rank
    ref = train_reference("sgd", STEPS, BATCH * P)
    plain = pt.DataParallel(fresh())
    for name in ("fp16", "bf16"):
        model = pt.DataParallel(fresh(), compression=name)
        opt = make_opt("sgd", model.parameters())
        for step in range(STEPS):
            x, y = data(step, BATCH * P)
            F.cross_entropy(model(x[me * BATCH:(me + 1) * BATCH]), y[me * BATCH:(me + 1) * BATCH]).backward()
            opt.step()
            opt.zero_grad()
        for p, q in zip(model.module.parameters(), ref.parameters()):
            err = (p - q).abs().max() / q.abs().max()
            if not err < 2e-2:
                raise AssertionError(f"{name} compression: parameters off by {err:.2e} relative")
        check_replicas_equal(g, model.module, f"{name} compression")
        nbytes = sum(b.flat.numel() for b in model.buckets) * 2 * STEPS
        if model.stats.bytes != nbytes:
            raise AssertionError(f"{name}: counted {model.stats.bytes} bytes, expected {nbytes} (2 per element)")
    del plain


class Twice(nn.Module):
    """What the direct path must get right: a weight used twice in one forward, and once
    more by F.linear called directly (autograd's path), a weight shared with an embedding
    (whose gradient autograd accumulates), a 3-d input, an in-place ReLU on a linear's
    output, and a weight with a hook of its own (left to autograd)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(6, 16)
        self.emb = nn.Embedding(16, 6)
        self.emb.weight = self.a.weight   # (16, 6): a row per id, and the linear's weight
        self.tied = nn.Linear(16, 16)
        self.hooked = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.hook_calls = 0

        def count(grad):
            self.hook_calls += 1
            return grad
        self.hooked.weight.register_hook(count)

    def forward(self, x):   # x: batch x 4 x 6
        ids = (x[..., 0].abs() * 5).long().clamp(max=15)
        h = self.relu(self.a(x + self.emb(ids)))
        h = torch.tanh(self.tied(h))
        h = torch.tanh(self.tied(h)) + self.hooked(h) + 0.1 * F.linear(h, self.tied.weight)   # autograd's path too
        return self.out(h.mean(1))


def linear_grads(g):
    from paratrain.parallel import linear_grads as lg
    lg.LINEAR_GRADS_MIN_NUMEL = 1   # the test's layers are small: every one takes the path
    me = g.rank
    grads = {}
    for direct in (True, False):
        model = pt.DataParallel(Twice(), bucket_mb=0.001, linear_grads_in_buckets=direct)
        x = torch.randn(BATCH, 4, 6, generator=torch.Generator().manual_seed(77 + me))
        y = torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(78 + me))
        # saved tensors that come back as other tensor objects (offloading hooks do this)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
            out = model(x)
        if (type(out.grad_fn).__name__ == "LinearWithOwnGradsBackward") != direct:
            raise AssertionError(f"direct={direct}: the output came from {out.grad_fn}")
        F.cross_entropy(out, y).backward()
        with model.no_sync():   # a second micro-batch accumulated locally, then a synchronised third
            F.cross_entropy(model(x * 0.5), y).backward()
        F.cross_entropy(model(x * 2.0), y).backward()
        if model.module.hook_calls != 3:
            raise AssertionError(f"direct={direct}: the hooked weight's hook ran {model.module.hook_calls} times")
        for b in model.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad.data_ptr() != view.data_ptr():
                    raise AssertionError(f"direct={direct}: a gradient is not its bucket's view")
        grads[direct] = [p.grad.clone() for p in model.module.parameters()]
        if any("forward" in m.__dict__ for m in model.module.modules()):
            raise AssertionError(f"direct={direct}: a module kept the forward set during DataParallel's")
    for (name, _), a, b in zip(Twice().named_parameters(), grads[True], grads[False]):
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        if err > 1e-6:
            raise AssertionError(f"{name}: the gradient computed into the bucket differs from autograd's by {err:.2e}")
    try:
        pt.DataParallel(Twice(), overlap=True, linear_grads_in_buckets=True)
    except ValueError as e:
        assert "needs overlap off" in str(e), e
    else:
        raise AssertionError("linear_grads_in_buckets with overlap was accepted")


def check_replicas_equal(g, module, what):
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    every = torch.zeros(g.world_size * flat.numel())
    g.all_gather(every, flat.contiguous())
    every = every.view(g.world_size, -1)
    for r in range(1, g.world_size):
        if not torch.equal(every[r], every[0]):
            raise AssertionError(f"{what}: rank {r}'s parameters differ from rank 0's")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["equiv", "no_sync", "unused", "join", "mismatch", "compress",
                                         "linear_grads"])
    ap.add_argument("--algorithm", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = pt.init()
    if args.mode == "equiv":
        equiv(g, args.algorithm)
    else:
        globals()[args.mode](g)
    print(f"data-parallel {args.mode} passed on {g.backend}")


if __name__ == "__main__":
    sys.exit(main())
