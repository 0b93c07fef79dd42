"""One worker of the compression benchmark: every engine in this process, round by round.

Started by ``paratrain run`` as one of 2 pretend hosts (``--link RATE --nnodes
2 -n 1``, or ``PARATRAIN_PRETEND_HOSTS=2`` for no limit), so the group is the
hierarchical one and every byte between the ranks crosses the (limited)
loopback through Gloo, as between machines.

Each engine trains its own copy of the ``mlp-large`` task's model (21M
parameters; the same initial weights) with what ``paratrain train`` uses: SGD
with momentum 0.9, lr 0.01, 32 samples a rank. Step i of every engine reads
the same batch, so after the rounds every engine has taken the same steps on
the same data, and their accuracies on the task's test set compare what the
compression cost. The config's ``seed`` picks the initial weights and the
batches (0 unless given):

- ``pt/none``, ``pt/fp16``, ``pt/topk:0.01``, ``pt/powersgd:4``, ``pt/onebit``:
  pt.DataParallel with ``compression=`` that word (none: fp32 all-reduce);
  top-k as ``paratrain train`` runs it with SGD, with DGC's momentum
  correction (the momentum in the compressor, the optimizer without);
  ``pt/topk-ef:0.01``: error feedback alone, the momentum in the optimizer;
- ``torch/ddp``, ``torch/ddp+fp16``: DistributedDataParallel over the same Gloo
  world, plain and with torch's ``fp16_compress_hook``;
- ``torch/ddp+powersgd``: DDP with torch's ``powerSGD_hook`` (rank 4); the
  front-end runs it on its own, as it may abort the process (compression.py).
"""
import json
import sys

import torch
import torch.nn.functional as F

from . import rounds
from .gloo_group import init_gloo, release_ddp

TASK = "mlp-large"


class TrainingEngine:
    """One engine: a model, SGD with momentum, and the batches of the task, step by step."""

    def __init__(self, name, model, barrier, data, group, batch, wire_bytes, momentum=0.9, seed=0):
        self.name, self.model, self.barrier, self.seed = name, model, barrier, seed
        self.x_all, self.y_all = data
        self.rank, self.world_size, self.batch = group.rank, group.world_size, batch
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
        self.steps, self.wire_bytes, self.losses = 0, wire_bytes, []

    def step(self, x=None, y=None):
        """The next step: this rank's share of the step's batch, drawn alike for every engine."""
        gen = torch.Generator().manual_seed(1000 + 7919 * self.seed + self.steps)
        index = torch.randint(len(self.y_all), (self.batch * self.world_size,), generator=gen)
        mine = index[self.rank * self.batch:(self.rank + 1) * self.batch]
        loss = F.cross_entropy(self.model(self.x_all[mine]), self.y_all[mine])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1
        self.losses.append(loss.item())

    def sent_per_step(self):
        """Bytes this rank put on the wire per step (DataParallel counts them; DDP: its buckets' dtype)."""
        return self.wire_bytes() / max(1, self.steps)


def build(name, task, cfg, group):
    """The engine called name, training its own copy of the task's model (the same initial weights)."""
    import copy

    import paratrain as pt
    data, mine = task.train_set.tensors, copy.deepcopy(task.model)
    numel = sum(p.numel() for p in mine.parameters())
    kind, _, arg = name.partition("/")
    if kind == "pt":
        from ..parallel.compression import with_sgd_momentum
        if arg.startswith("topk-ef:"):   # error feedback alone, the momentum in the optimizer, after top-k
            momentum, compression = 0.9, "topk:" + arg[8:]
        else:   # as paratrain train does with SGD (top-k: DGC's momentum correction)
            compression, momentum = with_sgd_momentum(None if arg == "none" else arg, 0.9)
        if cfg.get("steady") and getattr(compression, "warmup_steps", 0):
            # the timed rounds are a few steps: time top-k past its density warm-up (the first
            # steps, sent denser), whose bytes the accuracy run counts
            compression.warmup_steps = 0
        model = pt.DataParallel(mine, group=group, compression=compression)
        engine = TrainingEngine(name, model, group.barrier, data, group, cfg["batch"], lambda: model.stats.bytes,
                                momentum, cfg.get("seed", 0))
    else:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        init_gloo(group, cfg["timeout"])
        model = torch.nn.parallel.DistributedDataParallel(mine)
        width = 4
        if arg == "ddp+fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            width = 2
        elif arg == "ddp+powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            width = None   # not counted: the probe only says whether it runs
        elif arg != "ddp":
            raise ValueError(f"unknown engine {name!r}")
        engine = TrainingEngine(name, model, dist.barrier, data, group, cfg["batch"],
                                lambda: (width or 0) * numel * engine.steps, seed=cfg.get("seed", 0))
    return engine


def main(cfg_path):
    import paratrain as pt

    from ..train.tasks import build_task
    cfg = json.loads(open(cfg_path).read())
    torch.set_num_threads(1)
    group = pt.init()
    task = build_task(TASK, seed=cfg.get("seed", 0))
    numel = sum(p.numel() for p in task.model.parameters())
    engines = [build(name, task, cfg, group) for name in cfg["engines"]]
    times = rounds.interleaved(engines, cfg, group, None, None)
    report = {}
    for e in engines:
        scores = task.evaluate(e.model.module)   # (evaluate runs in eval mode, without gradients)
        report[e.name] = dict(accuracy=scores["accuracy"], eval_loss=scores["eval_loss"], steps=e.steps,
                              first_loss=e.losses[0], last_loss=e.losses[-1], bytes_per_step=e.sent_per_step(),
                              parameters=numel)
    if group.rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(dict(times=times, engines=report, world_size=group.world_size, backend=group.backend), f)
    group.barrier()
    pt.destroy()
    release_ddp(engines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
