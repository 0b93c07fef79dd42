"""SSP on the gpt task with the servers' own arithmetic and a simulated clock.

    python benchmarks/ssp_simulation.py [--seeds 0,1,2,3] [--slowdown jitter|straggler]
                                        [--lookahead X] [--no-gap] [--fresh] [--dc L] ...

Table 3 of benchmarks/parameter_server.py measures SSP(3) against BSP with
real processes, where a run's loss moves by a few percent with the machine's
timing. This script takes the timing out: three simulated workers, each step
one unit of compute, slowed 3x with probability 0.3 (``--jitter 0.3:3``, from
a seeded generator) or always for worker 1 (``--straggler 1:3``), read their
weights when a step starts (blocking as SSP's clock rule says,
ps/consistency.py) and push when it ends; the pushes and reads go through
ps/shard.py's ``Shard`` with the server's Adam (ps/optimizers.py), exactly as
a server applies them, in the order the simulated clock gives. BSP is the
same shard gathering each clock's three pushes. The model, batches (16
samples per push, 3 x steps pushes in all) and evaluation are those of
``paratrain train --model gpt``.

So a change to the servers' arithmetic (prediction, gap damping) can be
judged over several seeds in minutes, without the machine's noise; the real
system's numbers stay table 3's. With the workers sharing 2 cores (the
default), the simulated SSP(3)'s lead over BSP under jitter comes near the
real one, so the simulation can stand in for it. The options try what the servers do not:
prediction without gap damping, another look-ahead, Adam's beta1 or the
learning rate per push, delay compensation (DC-ASGD) and, as the bound on
all of them, ``--fresh``: no staleness at all. The README has the table.
Writes benchmarks/results/ssp_simulation.json.
"""
import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import default_collate

from paratrain.ps.consistency import Clocks
from paratrain.ps.optimizers import make_optimizer
from paratrain.ps.shard import Shard
from paratrain.train.tasks import build_task

WORKERS = 3
BATCH = 16


def _flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def _load(model, flat):
    torch.nn.utils.vector_to_parameters(torch.from_numpy(flat), model.parameters())


def _grad(task, model, weights, ids):
    _load(model, weights)
    model.zero_grad(set_to_none=False)
    task.loss(model, default_collate([task.train_set[i] for i in ids])).backward()   # (as the trainer's DataLoader)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()


def step_factors(slowdown, seed, steps):
    """Each worker's compute time per step, in units: jitter 0.3:3 or straggler 1:3."""
    out = []
    for w in range(WORKERS):
        rng = random.Random(f"ssp-simulation/{seed}/{w}")
        if slowdown == "jitter":
            out.append([3.0 if rng.random() < 0.3 else 1.0 for _ in range(steps * WORKERS)])
        else:
            out.append([3.0 if w == 1 else 1.0] * (steps * WORKERS))
    return out


class CompensatedShard(Shard):
    """ps/shard.py's Shard with the experiments' variants: delay compensation
    (Zheng et al., "Asynchronous SGD with Delay Compensation", ICML 2017,
    DC-ASGD-a: g + lambda0 * g * g / sqrt(v) * (value - served), v Adam's second
    moment) and gap damping switched off."""

    dc = 0.0
    gap = True

    def gap_damped(self, grad, served):
        if self.dc:
            v = self.opt.state.get("exp_avg_sq")
            if v is not None and self.opt.steps:
                g = torch.from_numpy(np.asarray(grad, dtype=np.float32))
                h = torch.from_numpy(v).div(1 - self.opt.betas[1] ** self.opt.steps).sqrt_().add_(1e-8)
                diff = torch.from_numpy(self.value) - torch.from_numpy(served)
                grad = (g + self.dc * g * g / h * diff).numpy()
        return super().gap_damped(grad, served) if self.gap else grad


@dataclasses.dataclass
class Variant:
    """SSP's settings in a simulated run (the defaults are the servers')."""
    staleness: int = 3
    predict: bool = True         # weight prediction and gap damping (--predict-weights)
    lookahead: float = None      # None: the optimizer's momentum (Adam's beta1), as the servers
    gap: bool = True             # gap damping, with prediction
    lr_scale: float = 1.0 / WORKERS
    beta1: float = 0.9
    dc: float = 0.0              # delay compensation's lambda0
    fresh: bool = False          # gradients on the weights they are applied to: no staleness at all


class Cores:
    """When the simulated workers' steps end. Each step is one unit of CPU work,
    then (when slowed by a factor f) a sleep of (f - 1) times the step's measured
    compute time, as train/slowdown.py does, then the push. With ``cores`` set,
    the computing workers share that many cores equally (3 workers on this
    2-core machine compute at 2/3 speed, at full speed while one sleeps);
    without, each has its own."""

    def __init__(self, cores=None):
        self.cores = cores
        self.now = 0.0
        self.computing = {}   # worker -> [work left, started at, factor]
        self.sleeping = {}    # worker -> wakes (and pushes) at

    def begin(self, worker, factor):
        self.computing[worker] = [1.0, self.now, factor]

    def next_push(self):
        """(time, worker) of the next push, or None when no step is running."""
        while self.computing or self.sleeping:
            rate = 1.0 if self.cores is None else min(1.0, self.cores / max(1, len(self.computing)))
            first = min(self.computing, key=lambda w: self.computing[w][0], default=None)
            done_at = self.now + self.computing[first][0] / rate if first is not None else float("inf")
            woken = min(self.sleeping, key=self.sleeping.get, default=None)
            if woken is not None and self.sleeping[woken] <= done_at:
                wake = self.sleeping.pop(woken)
                self._work(rate, wake - self.now)
                self.now = wake
                return self.now, woken
            self._work(rate, done_at - self.now)
            self.now = done_at
            _, started, factor = self.computing.pop(first)
            if factor <= 1:
                return self.now, first
            self.sleeping[first] = self.now + (factor - 1) * (self.now - started)
        return None

    def _work(self, rate, seconds):
        for state in self.computing.values():
            state[0] -= rate * seconds


def run(task, mode, steps, seed, slowdown, cores=None, variant=Variant()):
    """(eval loss, simulated time, each push's gap) of one run: mode 'bsp' or 'ssp'
    (with ``variant``'s settings)."""
    model = task.model
    initial = _flat(model)
    ssp = mode == "ssp"
    adam = make_optimizer("adam", lr=task.defaults["lr"], betas=(variant.beta1 if ssp else 0.9, 0.999))
    shard = CompensatedShard("all", 0, initial.size, initial.copy(), adam)
    shard.dc, shard.gap = variant.dc, variant.gap
    if ssp and variant.predict:
        shard.enable_prediction(WORKERS)
        if variant.lookahead is not None:
            shard.lookahead = variant.lookahead
    clocks = Clocks(WORKERS, mode, variant.staleness if ssp else None)
    factors = step_factors(slowdown, seed, steps)
    batches = torch.Generator().manual_seed(seed)
    total = steps * WORKERS
    taken = 0
    cores = Cores(cores)
    served, ids_of, step_of = {}, {}, [0] * WORKERS
    waiting = set()       # workers blocked by the clock rule

    pushes, pushes_at_read, gaps = 0, {}, []   # SSP: other workers' pushes between a read and its push

    def start(w):
        nonlocal taken
        if taken >= total:
            clocks.finish(w)
            return
        if not clocks.may_read(w):
            waiting.add(w)
            return
        pushes_at_read[w] = pushes
        served[w] = shard.read_into(w, np.empty_like(shard.value)) if ssp else shard.value.copy()
        ids_of[w] = torch.randint(len(task.train_set), (BATCH,), generator=batches).tolist()
        taken += 1
        cores.begin(w, factors[w][step_of[w]])
        step_of[w] += 1

    for w in range(WORKERS):
        start(w)
    while (push := cores.next_push()) is not None:
        now, w = push
        g = _grad(task, model, shard.value if variant.fresh else served[w], ids_of[w])
        if not ssp:
            shard.gather(w, g)
            if len(shard.pushed) == len(clocks.active()):
                shard.apply_round()
        else:
            gaps.append(pushes - pushes_at_read[w])
            shard.apply_now(w, g, variant.lr_scale)
            pushes += 1
        clocks.advance(w)
        start(w)
        for v in sorted(waiting):   # (BSP: the round's last push has just been applied)
            waiting.discard(v)
            start(v)
    _load(model, shard.value)
    loss = task.evaluate(model)["eval_loss"]
    _load(model, initial)
    return loss, now, gaps


def _bsp(task, steps, seed, slowdown, cores):
    """BSP's (loss, time), remembered in the temporary folder between runs: it does
    not depend on any of SSP's settings, and an experiment runs many of those."""
    path = os.path.join(tempfile.gettempdir(), f"ssp_simulation_bsp_{steps}_{seed}_{slowdown}_{cores}cores.json")
    if os.path.exists(path):
        with open(path) as f:
            return tuple(json.load(f))
    result = run(task, "bsp", steps, seed, slowdown, cores=cores)[:2]
    with open(path, "w") as f:
        json.dump(result, f)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="clocks of 3 x 16 samples (table 3's --gpt-steps)")
    p.add_argument("--seeds", default="0,1,2,3", help="batch orders and jitter draws, one run each")
    p.add_argument("--slowdown", choices=("jitter", "straggler"), default="jitter")
    p.add_argument("--staleness", type=int, default=3)
    p.add_argument("--no-predict", action="store_true", help="SSP without prediction and gap damping")
    p.add_argument("--lr-scale", type=float, default=1.0 / WORKERS, help="each push's learning rate x this")
    p.add_argument("--beta1", type=float, default=0.9, help="SSP's Adam beta1")
    p.add_argument("--cores", type=float, default=2.0, help="cores the workers share (default 2, as this "
                   "machine; 0: one each)")
    p.add_argument("--fresh", action="store_true",
                   help="each gradient on the weights it is applied to (no staleness: what SSP would lose without it)")
    p.add_argument("--dc", type=float, default=0.0, help="delay compensation's lambda0 (DC-ASGD-a)")
    p.add_argument("--lookahead", type=float, default=None,
                   help="predict tau + this many updates ahead (default: Adam's beta1, as the servers)")
    p.add_argument("--no-gap", action="store_true", help="prediction without gap damping")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    console = Console()
    rows = []
    cores = args.cores or None
    variant = Variant(args.staleness, not args.no_predict, args.lookahead, not args.no_gap, args.lr_scale,
                      args.beta1, args.dc, args.fresh)
    for seed in map(int, args.seeds.split(",")):
        task = build_task("gpt", seed=0)
        t0 = time.perf_counter()
        bsp, bsp_time = _bsp(task, args.steps, seed, args.slowdown, cores)
        ssp, ssp_time, gaps = run(task, "ssp", args.steps, seed, args.slowdown, cores, variant)
        rows.append({"seed": seed, "bsp_loss": bsp, "ssp_loss": ssp, "bsp_time": bsp_time, "ssp_time": ssp_time,
                     "gap_mean": float(np.mean(gaps)), "gap_histogram": np.bincount(gaps).tolist(),
                     "seconds": time.perf_counter() - t0})
        console.print(f"\\[sim] seed {seed}: BSP {bsp:.3f} ({bsp_time:.0f} units), SSP({args.staleness}) {ssp:.3f} "
                      f"({ssp_time:.0f} units, mean gap {np.mean(gaps):.2f} pushes): "
                      f"{100 * (ssp / bsp - 1):+.1f}% ({rows[-1]['seconds']:.0f} s)")
    table = Table(title=f"SSP({args.staleness}) vs BSP, gpt, {args.slowdown}, simulated clock")
    for col in ("seed", "BSP loss", "SSP loss", "vs BSP", "SSP speed-up"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["seed"]), f"{r['bsp_loss']:.3f}", f"{r['ssp_loss']:.3f}",
                      f"{100 * (r['ssp_loss'] / r['bsp_loss'] - 1):+.1f}%", f"{r['bsp_time'] / r['ssp_time']:.2f}x")
    console.print(table)
    mean = np.mean([100 * (r["ssp_loss"] / r["bsp_loss"] - 1) for r in rows])
    console.print(f"mean: {mean:+.2f}%")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ssp_simulation.json")
    with open(path, "w") as f:
        json.dump({"steps": args.steps, "slowdown": args.slowdown, "cores": cores,
                   "variant": dataclasses.asdict(variant), "mean_loss_vs_bsp_percent": mean, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
