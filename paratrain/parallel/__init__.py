"""Parallel strategies: what to communicate, and when.

    model = pt.DataParallel(MyModel())      # data.py: gradients averaged during backward
"""
from .comm_hooks import AllReduceHook, CastHook
from .data import DataParallel, DataParallelNaive
from .sampler import DistributedSampler

__all__ = ["DataParallel", "DataParallelNaive", "DistributedSampler", "AllReduceHook", "CastHook"]
