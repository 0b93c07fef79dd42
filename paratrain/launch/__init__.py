"""Starting and watching worker processes.

    paratrain run -n 4 script.py args...      (or python -m paratrain.run ...)

local.py turns the command line into one environment per worker, worker.py
starts a worker and carries its output, watch.py stops the whole job when one
worker fails or the launcher is interrupted.
"""
from .local import free_port, main

__all__ = ["main", "free_port"]
