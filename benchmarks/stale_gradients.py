"""What stale gradients cost Adam on the gpt task, with no system in the way.

    python benchmarks/stale_gradients.py [--steps 200] [--delays 0,1,3]

A single process trains ``paratrain train --model gpt``'s model with its
default optimizer (Adam, lr 1e-3) on 48 samples per step (3 workers x 16, as
table 3 of benchmarks/parameter_server.py), in two ways a parameter server
can apply stale gradients:

- *one update per clock, from weights d clocks old*: a round's average, as
  BSP applies it, but computed on the weights of d steps before (what SSP
  would do if it aggregated each clock's pushes: the fast workers' gradients
  are up to s clocks old). d = 0 is BSP, synchronous data parallelism.
- *each push on arrival* (ASP, and SSP as Ho et al.'s SSPTable applies it):
  every step is 3 pushes of 16 samples, each an Adam step with lr / 3,
  computed on the weights before the previous 2 pushes (round-robin workers);
  and the same with weight prediction (``--predict-weights``, ps/shard.py):
  the gradient computed on those weights moved twice along their last update,
  then also damped by its gap as the servers do (ps/shard.py, Barkai et al.,
  ICLR 2020): each element divided by max(1, |weights - served| / its mean
  update size). ``--seed`` picks another order of batches (runs differ by a
  few percent: compare rows of one seed).

It explains the design of ps/consistency.py: applying each push on arrival
keeps each gradient's staleness a fraction of a step, and costs far less loss
than one full step per clock from d-clock-old weights. Zheng et al. (ICML 2017,
DC-ASGD) and Mitliagkas et al. (2016, "Asynchrony begets momentum") discuss
why delay hurts momentum methods so much. Writes benchmarks/results/stale_gradients.json.
"""
import argparse
import collections
import copy
import json
import os
import sys
import time

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import default_collate

from paratrain.ps.shard import GAP_WARMUP, STEP_SIZE_DECAY
from paratrain.train.tasks import build_task

BATCH = 48


def train(task, steps, pushes, delay, lr_scale, beta1=0.9, predict=0.0, gap=False, seed=0):
    """Adam on ``pushes`` sub-batches per step, each applied with lr * lr_scale and
    computed on the weights ``delay`` updates old, moved ``predict`` times along the
    update that made them (ps/shard.py's weight prediction), with ``gap`` damped as
    the servers do after shard.GAP_WARMUP pushes. Returns the eval loss."""
    model = copy.deepcopy(task.model)
    stale = copy.deepcopy(task.model)
    opt = torch.optim.Adam(model.parameters(), lr=task.defaults["lr"] * lr_scale, betas=(beta1, 0.999))
    gen = torch.Generator().manual_seed(seed)
    history = collections.deque(maxlen=delay + 2)   # the weights after each of the last updates
    step_size = [torch.zeros_like(p) for p in model.parameters()]   # running mean of |update|
    for i in range(steps * pushes):
        history.append([p.detach().clone() for p in model.parameters()])
        read = history[max(0, len(history) - 1 - delay)]
        before = history[max(0, len(history) - 2 - delay)]
        with torch.no_grad():
            for q, w, b in zip(stale.parameters(), read, before):
                torch.add(w, w - b, alpha=predict, out=q)
        ids = torch.randint(len(task.train_set), (BATCH // pushes,), generator=gen).tolist()
        batch = default_collate([task.train_set[i] for i in ids])   # (as the trainer's DataLoader)
        stale.zero_grad()
        task.loss(stale, batch).backward()
        before_step = []
        with torch.no_grad():
            for p, q, size in zip(model.parameters(), stale.parameters(), step_size):
                p.grad = q.grad if not gap or i < GAP_WARMUP else \
                    q.grad / ((p - q).abs() / (size + 1e-12)).clamp(min=1.0)
                before_step.append(p.detach().clone())
        opt.step()
        with torch.no_grad():
            for p, b, size in zip(model.parameters(), before_step, step_size):
                size.mul_(STEP_SIZE_DECAY).add_((p - b).abs(), alpha=1 - STEP_SIZE_DECAY)
    return task.evaluate(model)["eval_loss"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps of 48 samples (table 3's --gpt-steps)")
    p.add_argument("--delays", default="0,1,3", help="clocks of staleness for one update per clock")
    p.add_argument("--beta1", type=float, default=0.9, help="Adam's beta1 for the on-arrival runs (the task's: 0.9)")
    p.add_argument("--seed", type=int, default=0, help="the order of the batches (the same in every row)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    task = build_task("gpt", seed=0)
    runs = [(f"one update per clock, {d} clock{'s' if d != 1 else ''} stale", 1, d, 1.0)
            for d in map(int, args.delays.split(","))]
    runs.append(("each push on arrival, 3 workers (lr / 3), fresh weights", 3, 0, 1.0 / 3))
    runs.append(("each push on arrival, 3 workers (lr / 3, 2 pushes stale)", 3, 2, 1.0 / 3))
    runs.append(("same, with weight prediction (tau = 2)", 3, 2, 1.0 / 3, 2.0))
    runs.append(("same, predicted and gap-damped (as the servers)", 3, 2, 1.0 / 3, 2.0, True))
    console = Console()
    results = []
    for name, pushes, delay, lr_scale, *predict in runs:
        t0 = time.perf_counter()
        loss = train(task, args.steps, pushes, delay, lr_scale, args.beta1 if pushes > 1 else 0.9, *predict,
                     seed=args.seed)
        results.append({"run": name, "pushes_per_step": pushes, "delay_updates": delay, "lr_scale": lr_scale,
                        "predict_tau": predict[0] if predict else 0.0, "gap_damped": predict[1:] == [True],
                        "beta1": args.beta1 if pushes > 1 else 0.9,
                        "eval_loss": loss, "seconds": time.perf_counter() - t0})
        console.print(f"[bench] {name}: eval loss {loss:.3f} ({results[-1]['seconds']:.0f} s)")
    base = results[0]["eval_loss"]
    table = Table(title=f"Adam on gpt, {args.steps} steps of {BATCH} samples: the cost of stale gradients")
    for col in ("how gradients are applied", "eval loss", "vs fresh"):
        table.add_column(col)
    for r in results:
        table.add_row(r["run"], f"{r['eval_loss']:.3f}", f"{100 * (r['eval_loss'] / base - 1):+.1f}%")
    console.print(table)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "stale_gradients.json")
    with open(path, "w") as f:
        json.dump({"steps": args.steps, "batch": BATCH, "seed": args.seed, "results": results}, f, indent=1)
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
