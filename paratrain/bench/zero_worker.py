"""One worker of the ZeRO benchmark: every engine in this process, round by round.

Each engine is a full training step (forward, backward, Adam) of the same GPT
(same initial weights; this rank's own half of the batch), as pipeline_worker
builds it:

- ``pt/dp``: pt.DataParallel and Adam in every worker (the baseline);
- ``pt/zero1``, ``pt/zero2``, ``pt/zero3``: pt.ZeRO at that stage;
- ``torch/ddp``: DistributedDataParallel over Gloo and Adam;
- ``torch/zero1``: DDP with torch's ZeroRedundancyOptimizer (ZeRO stage 1);
- ``torch/fsdp2``: ``fully_shard`` on every block, then on the model (ZeRO stage 3).

Besides the times (rounds.py), rank 0 records each engine's bytes held after
a backward (parameters, gradients, optimizer state: the storages allocated,
each once; a DTensor counts its local shard) and its first loss.
"""
import json
import os
import sys

import torch

from . import rounds
from .dp_worker import init_gloo, release_ddp
from .pipeline_worker import build_gpt, lm_loss


def held(params, grads, state):
    seen = set()

    def count(tensors):
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            s = t.untyped_storage()
            if s.nbytes() and (s.data_ptr(), s.nbytes()) not in seen:
                seen.add((s.data_ptr(), s.nbytes()))
                total += s.nbytes()
        return total
    return {"parameters": count(params), "gradients": count(grads), "optimizer": count(state)}


def state_tensors(opt):
    return [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]


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
        return held(params, [q.grad for q in params], state_tensors(self.opt))


class Ours(Engine):
    def __init__(self, name, cfg, group, stage):
        import paratrain as pt
        self.engine = pt.ZeRO(build_gpt(cfg), torch.optim.Adam, stage=stage, group=group, lr=1e-4)
        super().__init__(name, self.engine, self.engine, group.barrier)

    def memory(self):
        return self.engine.memory()


class TorchZeroOne(Engine):
    def memory(self):
        params = list(self.model.parameters())
        return held(params, [q.grad for q in params], state_tensors(self.opt.optim))


def make_engines(cfg, group, port):
    import paratrain as pt
    engines = []
    for name in cfg["engines"]:
        if name == "pt/dp":
            model = pt.DataParallel(build_gpt(cfg), group=group)
            engines.append(Engine(name, model, torch.optim.Adam(model.parameters(), lr=1e-4), group.barrier))
        elif name.startswith("pt/zero"):
            engines.append(Ours(name, cfg, group, int(name[-1])))
        elif name.startswith("torch/"):
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            init_gloo(group, port, cfg["timeout"])
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
    import paratrain as pt
    cfg = json.loads(open(cfg_path).read())
    torch.set_num_threads(1)
    group = pt.init(backend="shm")
    engines = make_engines(cfg, group, int(os.environ["MASTER_PORT"]))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (cfg["batch"], cfg["context"]), generator=gen)
    y = torch.randint(0, 256, (cfg["batch"], cfg["context"]), generator=gen)
    per = cfg["batch"] // group.world_size
    x, y = x[group.rank * per:(group.rank + 1) * per], y[group.rank * per:(group.rank + 1) * per]
    times = rounds.interleaved(engines, cfg, group, x, y)
    if group.rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump({"times": times, "first_loss": {e.name: e.first_loss for e in engines},
                       "bytes": {e.name: e.bytes for e in engines}}, f)
    group.barrier()
    pt.destroy()
    release_ddp(engines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
