"""Pipeline parallelism: a model cut between layers into stages, micro-batches flowing through.

    stage = pt.pipeline.split(model, group=g, stages=2)          # split.py
    pipe = pt.Pipeline(stage, group=g, microbatches=8, schedule="1f1b", loss_fn=F.cross_entropy)
    loss = pipe.step(inputs, targets)                            # engine.py, schedules.py

split.py cuts: trace.py makes the model a graph, layers.py finds the layers
between which it may be cut, partition.py balances the cut, tied.py keeps the
weights several stages read in step. transport.py moves values between
neighbouring stages, schedules.py orders each rank's work, engine.py runs it.
"""
from .engine import Pipeline
from .schedules import SCHEDULES
from .split import Stage, choose_cut, split

__all__ = ["Pipeline", "SCHEDULES", "Stage", "choose_cut", "split"]
