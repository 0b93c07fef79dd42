"""How long a waiting rank spins before it blocks: one policy for every backend.

A wait that spins answers a message that is about to arrive at once, where
going to sleep costs a wake-up through the kernel (shm's semaphores) or up to
a sleep slice (mpi's polling). But a spinning rank holds a core, and when the
host runs more ranks than it has cores, the core it holds is the one the
awaited peer needs: there a wait must block at once.

So: spin for SPIN_S while every rank on this host can have a core of its own,
not at all when they cannot. The cores counted are the host's (os.cpu_count()),
not this process's affinity: a rank bound to one core (``paratrain run
--bind-to core``, ``mpirun --bind-to core``) still has its peers on cores of
their own. A backend's environment variable (microseconds) overrides the policy.

And only on the main thread (``for_this_thread``): the spin is a Python loop
that holds the GIL, so on a background thread (an async_op lane,
DataParallel's communication thread) it keeps the training thread from
running its own Python for up to the interpreter's switch interval.
"""
import os
import threading

from .. import config

SPIN_S = 200e-6
_MAIN_THREAD = threading.main_thread()


def spin_seconds(ranks_here, env_var):
    """The spin budget of a rank whose host runs ``ranks_here`` ranks of the job;
    ``env_var``, if set, gives it in microseconds instead."""
    override = config.get(env_var)
    if override is not None:
        return override * 1e-6
    return 0.0 if ranks_here > (os.cpu_count() or 1) else SPIN_S


def for_this_thread(budget):
    """The budget on the main thread, 0 on any other (see the module docstring)."""
    return budget if threading.current_thread() is _MAIN_THREAD else 0.0
