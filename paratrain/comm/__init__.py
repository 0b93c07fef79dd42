"""The communication layer: one ProcessGroup API over every backend."""
from .errors import CommError, CommTimeout, FrameError, MismatchError, PeerError
from .group import ProcessGroup
from .work import Work
from .world import destroy, init, is_initialized, new_group, world

__all__ = ["init", "world", "new_group", "destroy", "is_initialized", "ProcessGroup", "Work",
           "CommError", "CommTimeout", "PeerError", "MismatchError", "FrameError"]
