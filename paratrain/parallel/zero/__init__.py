"""ZeRO: data parallelism with the optimizer state, gradients and parameters sharded (issue 27).

    engine = pt.ZeRO(model, torch.optim.Adam, stage=1 | 2 | 3, group=g, lr=1e-3)   # engine.py
    engine(x); loss.backward(); engine.step(); engine.zero_grad()

layout.py cuts the parameters into units and shards; engine.py runs the stages.
"""
from .engine import STAGES, ZeRO

__all__ = ["STAGES", "ZeRO"]
