"""One worker of the data-parallel benchmark: every engine in this process, round by round.

Each engine is a full training step of the same model (same initial weights,
same batch on this rank, SGD) under a different way of averaging gradients:

- ``single``: no averaging, one process (only run with one worker: the
  baseline scaling efficiency is measured against);
- ``paratrain``: pt.DataParallel with the shm engine's default algorithm
  (buckets in shared memory, all-reduced in place);
- ``paratrain/ring``, ``paratrain/naive``: the same DataParallel forced onto the
  ring algorithm, or the master-based scheme (every gradient to rank 0, summed
  there, sent back); ``paratrain+overlap``: reducing buckets during backward on
  a communication thread even where DataParallel would not choose to;
  ``paratrain+copy``: linear layers' gradients left to autograd and copied
  into the buckets (``linear_grads_in_buckets=False``), the copy linear_grads.py avoids;
- ``ddp``: PyTorch's DistributedDataParallel over Gloo (its defaults: 25 MB
  buckets, overlap with backward);
- ``compute-only``: every worker trains its own model at the same time with no
  averaging at all: what sharing the machine's cores and memory bandwidth
  costs a step, apart from any communication;
- ``allreduce-only``: the all-reduce of one step's gradient bytes on a shared
  buffer, nothing else: what the collective costs when no rank is late.

Every engine ends its step as most training loops do, ``opt.step()`` then
``opt.zero_grad()`` (gradients to None, torch's default).

Each step is timed by phase (forward, backward, gradient averaging, optimizer)
so the output says where a step's time goes; for DataParallel the averaging
is the time its CommStats count (the all-reduces backward waited for).

Rounds are interleaved: each round times ``steps`` steps of every engine, in an
order that rotates by one each round, after that engine's own barrier; a
round's time is the slowest rank's. Rank 0 writes all rounds' times to JSON.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

from . import rounds
from .gloo_group import init_gloo, release_ddp


def build_model(sizes):
    from ..train.models import MLP
    torch.manual_seed(0)
    return MLP(sizes)


PHASES = ("forward", "backward", "averaging", "optimizer")


class Engine:
    """One training step of a model, timed by phase (seconds summed in self.phases)."""

    def __init__(self, name, model, barrier):
        self.name, self.model, self.barrier = name, model, barrier
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.stats = getattr(model, "stats", None)   # DataParallel's CommStats
        self.phases = dict.fromkeys(PHASES, 0.0)

    def step(self, x, y):
        waited = self.stats.wait_seconds if self.stats is not None else 0.0
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t3 = time.perf_counter()
        averaging = (self.stats.wait_seconds - waited) if self.stats is not None else 0.0
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1 - averaging, averaging, t3 - t2)):
            self.phases[phase] += dt


class AllReduceOnly(Engine):
    """The collective alone: a step's gradient bytes all-reduced in a shared buffer."""

    def __init__(self, numel, group):
        self.name, self.barrier, self.group = "allreduce-only", group.barrier, group
        self.flat = group.empty_shared(numel, torch.float32)
        self.flat.fill_(1.0)
        self.phases = dict.fromkeys(PHASES, 0.0)

    def step(self, x, y):
        t0 = time.perf_counter()
        self.group.all_reduce(self.flat, op="avg")
        self.phases["averaging"] += time.perf_counter() - t0


def make_engines(names, sizes, group, timeout):
    import paratrain as pt
    engines = []
    for name in names:
        if name == "single":
            engines.append(Engine(name, build_model(sizes), lambda: None))
        elif name == "compute-only":
            engines.append(Engine(name, build_model(sizes), group.barrier))
        elif name == "allreduce-only":
            engines.append(AllReduceOnly(sum(p.numel() for p in build_model(sizes).parameters()), group))
        elif name.startswith("paratrain"):
            base, _, extra = name.partition("+")
            algo = base.split("/", 1)[1] if "/" in base else None
            model = pt.DataParallel(build_model(sizes), group=group, algorithm=algo,
                                    overlap=True if extra == "overlap" else None,
                                    linear_grads_in_buckets=False if extra in ("overlap", "copy") else None)
            engines.append(Engine(name, model, group.barrier))
        elif name == "ddp":
            import torch.distributed as dist
            init_gloo(group, timeout)
            model = torch.nn.parallel.DistributedDataParallel(build_model(sizes))
            engines.append(Engine(name, model, dist.barrier))
        else:
            raise ValueError(f"unknown engine {name!r}")
    return engines


def main(cfg_path):
    import paratrain as pt
    cfg = json.loads(open(cfg_path).read())
    torch.set_num_threads(1)
    group = pt.init(backend="shm")
    engines = make_engines(cfg["engines"], cfg["sizes"], group, cfg["timeout"])
    gen = torch.Generator().manual_seed(1 + group.rank)
    x = torch.randn(cfg["batch"], cfg["sizes"][0], generator=gen)
    y = torch.randint(0, cfg["sizes"][-1], (cfg["batch"],), generator=gen)
    phases = {e.name: {p: [] for p in PHASES} for e in engines}

    def reset(e):
        e.phases = dict.fromkeys(PHASES, 0.0)

    def record(e):
        for p in PHASES:
            phases[e.name][p].append(e.phases[p] / cfg["steps"])

    times = rounds.interleaved(engines, cfg, group, x, y, before=reset, after=record)   # phases: rank 0's
    if group.rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump({"times": times, "phases": phases}, f)
    group.barrier()
    pt.destroy()
    release_ddp(engines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
