"""Starting and watching worker processes.

    paratrain run -n 4 script.py args...      (or python -m paratrain.run ...)

local.py turns the command line into one environment per worker, worker.py
starts a worker and carries its output, watch.py stops the whole job when one
worker fails or the launcher is interrupted, bootstrap.py runs the worker's
script and ends the process without the interpreter's teardown. parent.py
ties a worker to its launcher's life; forkserver.py starts workers as forks
of a process that has already imported torch.

``main`` and ``free_port`` are imported on first use, so a worker starting
through ``python -m paratrain.launch.bootstrap`` does not import the launcher.
"""
__all__ = ["main", "free_port"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'paratrain.launch' has no attribute {name!r}")
    from . import local
    return getattr(local, name)
