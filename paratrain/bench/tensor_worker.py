"""One worker of the tensor-parallel benchmark: every engine in this process, round by round.

Each engine is a full training step (forward, backward, Adam) of the same GPT
(same initial weights, same batch on every rank) as pipeline_worker builds it:

- ``single``: one process, the whole model (only with one worker);
- ``pt/tp<n>``: the model cut across the n workers by
  ``pt.tensor.parallelize(model, plan=pt.tensor.GPT_PLAN)``: q, k, v and the
  MLP's first layer by columns, attention's output and the MLP's second layer
  by rows, the token embedding by vocabulary rows; collectives on the shm
  engine; ``pt-sp/tp<n>``: the same with ``sequence_parallel=True``;
- ``torch/tp<n>``: torch's own tensor parallelism on the same weights,
  ``parallelize_module`` with ``ColwiseParallel`` on q, k, v and the MLP's
  first layer and ``RowwiseParallel`` on attention's output and the MLP's
  second layer (DTensor over Gloo). torch's plan cuts a linear layer's output
  in one piece, so its model computes q, k and v by three layers
  (UnfusedAttention) where ours cuts the fused one part by part.

Besides the times (rounds.py), rank 0 records each engine's first loss (the
same numbers from the same weights and batch, whatever the engine: checked by
the report), parameter and Adam-state bytes on this rank, and for paratrain
the bytes its collectives moved in one step (pt.tensor.traffic).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.zero.memory import optimizer_tensors
from . import rounds
from .gloo_group import init_gloo
from .pipeline_worker import build_gpt, lm_loss


def tensor_bytes(tensors):
    """Bytes this rank holds (a DTensor counts its local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def optimizer_bytes(opt):
    return tensor_bytes(optimizer_tensors(opt))


def expected_bytes(model, plan, p):
    """Parameter bytes per rank if what ``plan`` cuts is divided by p and the rest is
    replicated (embeddings, norms, a row layer's bias), from the one-process model."""
    from ..parallel.tensor.plan import LAYER_STYLES, _pattern, _styles
    cut = set()
    for key, value in plan.items():
        kinds = [kind for kind, _ in _styles(value, key) if kind in LAYER_STYLES]
        for name, module in model.named_modules():
            if kinds and name and _pattern(key).match(name):
                cut.add(f"{name}.weight")
                if kinds[0] == "colwise" and getattr(module, "bias", None) is not None:
                    cut.add(f"{name}.bias")
    return sum(q.numel() * q.element_size() / (p if n in cut else 1) for n, q in model.named_parameters())


class Engine:
    def __init__(self, name, model, barrier, plan, p):
        self.name, self.model, self.barrier = name, model, barrier
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.plan, self.p = plan, p
        self.first_loss = None

    def step(self, x, y):
        loss = lm_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.first_loss is None:
            self.first_loss = loss.item()

    def sizes(self, cfg):
        return dict(parameter_bytes=tensor_bytes(self.model.parameters()), optimizer_bytes=optimizer_bytes(self.opt),
                    expected_parameter_bytes=expected_bytes(build_gpt(cfg), self.plan, self.p) if self.plan
                    else tensor_bytes(self.model.parameters()))


class Ours(Engine):
    def __init__(self, name, cfg, group, sequence_parallel=False):
        import paratrain as pt
        model = pt.tensor.parallelize(build_gpt(cfg), group=group, plan=pt.tensor.GPT_PLAN,
                                      sequence_parallel=sequence_parallel)
        super().__init__(name, model, group.barrier, pt.tensor.GPT_PLAN, group.world_size)

    def traffic(self, x, y):
        from ..parallel.tensor import traffic
        traffic.reset()
        self.step(x, y)
        return dict(calls=dict(traffic.calls), bytes=dict(traffic.bytes))


class UnfusedAttention(nn.Module):
    """The gpt model's attention with q, k and v as three layers (the same weights),
    so that torch's ColwiseParallel, which cuts one layer's output in one piece,
    gives each rank whole heads."""

    def __init__(self, attn):
        super().__init__()
        self.head_dim, width = attn.head_dim, attn.proj.in_features
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        for layer, w, b in zip((self.q, self.k, self.v), attn.qkv.weight.detach().chunk(3),
                               attn.qkv.bias.detach().chunk(3)):
            layer.weight.data.copy_(w)
            layer.bias.data.copy_(b)
        self.proj = attn.proj

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim   # this rank's heads
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))


TORCH_PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
              "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}   # what torch's plan cuts, in our names


class Torch(Engine):
    def __init__(self, name, cfg, group):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        model = build_gpt(cfg)
        plan = {}
        for i, block in enumerate(model.blocks):
            block.attn = UnfusedAttention(block.attn)
            plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
            plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.mlp.0": ColwiseParallel(),
                         f"blocks.{i}.mlp.2": RowwiseParallel()})
        parallelize_module(model, init_device_mesh("cpu", (group.world_size,)), plan)
        super().__init__(name, model, dist.barrier, TORCH_PLAN, group.world_size)


def make_engines(cfg, group):
    engines = []
    for name in cfg["engines"]:
        if name == "single":
            engines.append(Engine(name, build_gpt(cfg), lambda: None, None, 1))
        elif name.startswith(("pt/", "pt-sp/")):
            engines.append(Ours(name, cfg, group, sequence_parallel=name.startswith("pt-sp/")))
        elif name.startswith("torch/"):
            init_gloo(group, cfg["timeout"])
            engines.append(Torch(name, cfg, group))
        else:
            raise ValueError(f"unknown engine {name!r}")
    return engines


def main(cfg_path):
    def report(engines, cfg, x, y):
        traffic = {e.name: e.traffic(x, y) for e in engines if isinstance(e, Ours)}   # every rank: collective
        return {"first_loss": {e.name: e.first_loss for e in engines},
                "sizes": {e.name: e.sizes(cfg) for e in engines}, "traffic": traffic}
    rounds.serve_gpt(cfg_path, make_engines, report)

if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
