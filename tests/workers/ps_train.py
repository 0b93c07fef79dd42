"""Worker: the parameter server against independent references, through real processes
started by `paratrain run --servers S -n W`.

  single  BSP with one worker equals plain single-process training step for step (same optimizer)
  bsp     BSP with W workers (batch b each) equals one process with batch W*b (the averaged gradient)
  ssp     SSP(s=1), one worker slowed: the server's log never shows a read more than s clocks ahead
  asp     ASP with worker 1 paused at the start: worker 0 finishes all its steps before worker 1 takes one
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt

BATCH = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 64)   # 704 elements: small, placed whole
        self.b = nn.Linear(64, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def fresh():
    torch.manual_seed(0)
    return Net()


def data(step, n):
    g = torch.Generator().manual_seed(1234 + step)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


OPTS = {"sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), dict(lr=0.1, momentum=0.9)),
        "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-5), dict(lr=1e-2, eps=1e-5))}


# The servers run their own numpy optimizers (ps/optimizers.py), which round differently
# from torch's fused kernels (one rounding per step: p + (-lr) * g is an FMA in torch);
# Adam divides by sqrt(v), which magnifies such roundings where gradients are near zero: an
# element whose gradient is float32 noise (summed in another order over W workers' pushes than
# in one process's batch) would take a step of up to lr either way. eps = 1e-5 keeps such
# elements' steps in proportion to their gradients, as on any processor's kernels.
TOL = {"sgd": 1e-5, "adam": 1e-4}


def close(a, b, what, tol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        err = (p.detach() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-12)
        if err > tol:
            raise AssertionError(f"{what}: {name} differs from the reference by {err:.2e} (relative)")


def steps(ps, model, n, me, workers, on_step=None):
    """n steps; with PS_TRAIN_STEP=1 through ps.step() (push, clock and pull in one request)."""
    combined = os.environ.get("PS_TRAIN_STEP") == "1"
    if combined:
        ps.pull(model)
    for step in range(n):
        if not combined:
            ps.pull(model)
        if on_step:
            on_step(step)
        x, y = data(step, BATCH * workers)
        model.zero_grad()
        F.cross_entropy(model(x[me * BATCH:(me + 1) * BATCH]), y[me * BATCH:(me + 1) * BATCH]).backward()
        if combined:
            ps.step(model)
        else:
            ps.push(model)
            ps.clock()
    ps.pull(model)


def single(ps, me, workers, opt_name):
    make, hyper = OPTS[opt_name]
    model, ref = fresh(), fresh()
    opt = make(ref.parameters())
    ps.register(model, optimizer=opt_name, consistency="bsp", **hyper)
    for step in range(6):
        ps.pull(model)
        close(model, ref, f"{opt_name}, before step {step}", TOL[opt_name])
        x, y = data(step, BATCH)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        ps.push(model)
        ps.clock()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    ps.pull(model)
    close(model, ref, f"{opt_name}, after 6 steps", TOL[opt_name])


def bsp(ps, me, workers, opt_name):
    make, hyper = OPTS[opt_name]
    model, ref = fresh(), fresh()
    if me != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the servers start from worker 0's values, whatever the others hold
    if os.environ.get("PS_TRAIN_SSP0") == "1":   # SSP with staleness 0 must behave like BSP, to the bit
        ps.register(model, optimizer=opt_name, consistency="ssp", staleness=0, **hyper)
    else:
        ps.register(model, optimizer=opt_name, consistency="bsp", **hyper)
    steps(ps, model, 5, me, workers)
    opt = make(ref.parameters())
    for step in range(5):
        x, y = data(step, BATCH * workers)
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    close(model, ref, f"BSP with {workers} workers, {opt_name}", TOL[opt_name])


def ssp(ps, me, workers, s=1):
    model = fresh()
    ps.register(model, optimizer="sgd", consistency="ssp", staleness=s, lr=0.05)
    steps(ps, model, 8, me, workers, on_step=lambda step: time.sleep(0.05) if me == workers - 1 else None)
    if me == 0:
        stats = ps.stats()
        hist = {int(k): v for k, v in stats["histogram"].items()}
        if not hist or max(hist) > s:
            raise AssertionError(f"SSP(s={s}) served reads {max(hist)} clocks ahead of the slowest: {hist}")
        print(f"staleness histogram {hist}")


def asp(ps, me, workers, ssp_inf=False):
    """ssp_inf: the same as SSP with staleness infinity, which must behave like ASP."""
    model = fresh()
    if ssp_inf:
        ps.register(model, optimizer="sgd", consistency="ssp", staleness=math.inf, lr=0.05)
    else:
        ps.register(model, optimizer="sgd", consistency="asp", lr=0.05)
    if me == 1:
        time.sleep(4.0)  # paused: in ASP nobody waits for it
    steps(ps, model, 10, me, workers)
    if me == 0:
        log = [tuple(e) for e in ps.stats()["log"]]
        done = log.index((0, 10))
        early = [e for e in log[:done] if e[0] == 1]
        if early:
            raise AssertionError(f"worker 1 advanced before worker 0 finished: {early}")
        print("worker 0 finished 10 steps while worker 1 was paused")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["single", "bsp", "ssp", "asp"])
    ap.add_argument("--optimizer", default="sgd", choices=sorted(OPTS))
    ap.add_argument("--ssp-inf", action="store_true", help="asp: register as SSP with staleness math.inf")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ps = pt.ps.connect()
    me, workers = ps.worker, ps.workers
    if args.mode in ("single", "bsp"):
        globals()[args.mode](ps, me, workers, args.optimizer)
    elif args.mode == "asp":
        asp(ps, me, workers, args.ssp_inf)
    else:
        globals()[args.mode](ps, me, workers)
    print(f"transport {'shm' if all(r is not None for r in ps.regions) else 'tcp'}")
    print(f"doorbell requests {sum(ps.stats(s)['doorbell_requests'] for s in range(len(ps.socks)))}")
    print(f"fused rounds {sum(ps.stats(s)['fused_rounds'] for s in range(len(ps.socks)))}")
    ps.close()
    print(f"ps {args.mode} passed")


if __name__ == "__main__":
    sys.exit(main())
