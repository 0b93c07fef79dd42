"""paratrain: distributed training for PyTorch.

    import paratrain as pt
    pt.init()
    g = pt.world()
    g.all_reduce(t, op="sum")
"""
from .comm import (CommError, CommTimeout, FrameError, MismatchError, PeerError, ProcessGroup, Work, destroy,
                   init, is_initialized, new_group, world)

__version__ = "0.1.0"
__all__ = ["init", "world", "new_group", "destroy", "is_initialized", "ProcessGroup", "Work",
           "CommError", "CommTimeout", "PeerError", "MismatchError", "FrameError"]
