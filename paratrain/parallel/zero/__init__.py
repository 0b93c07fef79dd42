"""ZeRO: data parallelism with the optimizer state, gradients and parameters sharded.

    engine = pt.ZeRO(model, torch.optim.Adam, stage=1 | 2 | 3, group=g, lr=1e-3)   # engine.py
    engine(x); loss.backward(); engine.step(); engine.zero_grad()

units.py chooses stage 3's units (the model's blocks, or ``units=``), layout.py
cuts the parameters into units and shards, gather.py gathers and frees a stage-3
unit around its forward and backward, engine.py runs the stages.
"""
from .engine import STAGES, ZeRO

__all__ = ["STAGES", "ZeRO"]
