"""One worker of the ZeRO benchmark: every engine in this process, round by round.

Each engine is a full training step (forward, backward, Adam) of the same GPT
(same initial weights; this rank's own half of the batch), as pipeline_worker
builds it:

- ``pt/dp``: pt.DataParallel and Adam in every worker (the baseline);
- ``pt/zero1``, ``pt/zero2``, ``pt/zero3``: pt.ZeRO at that stage;
  ``pt/zero3-noprefetch``: stage 3 gathering each layer only when it is reached;
- ``torch/ddp``: DistributedDataParallel over Gloo and Adam;
- ``torch/zero1``: DDP with torch's ZeroRedundancyOptimizer (ZeRO stage 1);
- ``torch/fsdp2``: ``fully_shard`` on every block, then on the model (ZeRO stage 3).

Besides the times (rounds.py), rank 0 records each engine's bytes held after
a backward (parameters, gradients, optimizer state: the storages allocated,
each once; a DTensor counts its local shard) and its first loss.
"""
import sys

import torch

from ..parallel.zero.memory import held_bytes, optimizer_tensors
from . import rounds
from .gloo_group import init_gloo
from .pipeline_worker import build_gpt, lm_loss


class Engine:
    def __init__(self, name, model, opt, barrier):
        self.name, self.model, self.opt, self.barrier = name, model, opt, barrier
        self.first_loss, self.bytes = None, None

    def step(self, x, y):
        loss = lm_loss(self.model(x), y)
        loss.backward()
        if self.bytes is None and self.first_loss is not None:   # the second step: the optimizer's state exists
            self.bytes = self.memory()
        self.opt.step()
        self.opt.zero_grad()
        if self.first_loss is None:
            self.first_loss = loss.item()

    def memory(self):
        params = list(self.model.parameters())
        return held_bytes(params, [q.grad for q in params], optimizer_tensors(self.opt))


class Ours(Engine):
    def __init__(self, name, cfg, group, stage, prefetch=True):
        import paratrain as pt
        self.engine = pt.ZeRO(build_gpt(cfg), torch.optim.Adam, stage=stage, group=group, lr=1e-4,
                              prefetch=prefetch)
        super().__init__(name, self.engine, self.engine, group.barrier)

    def memory(self):
        return self.engine.memory()


class TorchZeroOne(Engine):
    def memory(self):
        params = list(self.model.parameters())
        return held_bytes(params, [q.grad for q in params], optimizer_tensors(self.opt.optim))


def make_engines(cfg, group):
    import paratrain as pt
    engines = []
    for name in cfg["engines"]:
        if name == "pt/dp":
            model = pt.DataParallel(build_gpt(cfg), group=group)
            engines.append(Engine(name, model, torch.optim.Adam(model.parameters(), lr=1e-4), group.barrier))
        elif name.startswith("pt/zero"):
            engines.append(Ours(name, cfg, group, int(name[len("pt/zero")]), not name.endswith("-noprefetch")))
        elif name.startswith("torch/"):
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            init_gloo(group, cfg["timeout"])
            if name == "torch/ddp":
                model = DDP(build_gpt(cfg))
                engines.append(Engine(name, model, torch.optim.Adam(model.parameters(), lr=1e-4), dist.barrier))
            elif name == "torch/zero1":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                model = DDP(build_gpt(cfg))
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
                engines.append(TorchZeroOne(name, model, opt, dist.barrier))
            elif name == "torch/fsdp2":
                from torch.distributed.fsdp import fully_shard
                model = build_gpt(cfg)
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                engines.append(Engine(name, model, torch.optim.Adam(model.parameters(), lr=1e-4), dist.barrier))
            else:
                raise ValueError(f"unknown engine {name!r}")
        else:
            raise ValueError(f"unknown engine {name!r}")
    return engines


def main(cfg_path):
    def report(engines, cfg, x, y):
        return {"first_loss": {e.name: e.first_loss for e in engines}, "bytes": {e.name: e.bytes for e in engines}}
    rounds.serve_gpt(cfg_path, make_engines, report, split_batch=True)

if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
