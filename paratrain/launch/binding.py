"""Which CPUs each local worker may run on: ``paratrain run --bind-to``.

``none`` (the default, as torchrun) leaves placement to the kernel's scheduler.
``core`` pins local rank i to its own block of ``threads`` CPUs, taken in order
from the CPUs the launcher itself may use, the way ``mpirun --bind-to core``
does (Open MPI's default for two ranks or fewer). Why pin: a worker that the
scheduler moves to another core leaves its caches behind, and two workers that
it briefly stacks on one core wait for each other at the next collective
(``paratrain bench collectives --bind-to core`` compares it with unpinned runs).

When there are more workers x threads than CPUs the blocks wrap around, so
workers share CPUs evenly instead of the launcher refusing (mpirun refuses
unless told --oversubscribe); ``oversubscribed`` says so and the launcher
prints a note.
"""
import os

MODES = ("none", "core")


def interpreter_env(threads):
    """What a launched process's interpreter and OpenMP/MKL read as they start: its
    compute threads (N workers each with a full-width pool on fewer cores thrash),
    and unbuffered output, so it reaches the launcher as it is printed. One place,
    because a fork server must have started with exactly these to serve a worker."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def available_cpus():
    """The CPUs this process may run on, in order (its affinity mask, which a
    container, taskset or a batch scheduler may have narrowed)."""
    return sorted(os.sched_getaffinity(0))


def cpu_sets(mode, nproc, threads, cpus):
    """One entry per local rank: the set of CPUs it is pinned to, or None to leave it free.

    Rank i gets cpus[i*threads .. i*threads + threads - 1], indices taken
    modulo len(cpus)."""
    if mode not in MODES:
        raise ValueError(f"unknown binding {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return [None] * nproc
    if not cpus:
        raise ValueError("no CPUs to bind to")
    n = len(cpus)
    return [{cpus[(i * threads + k) % n] for k in range(min(threads, n))} for i in range(nproc)]


def oversubscribed(nproc, threads, cpus):
    """True when the workers' threads outnumber the CPUs, so bound workers share CPUs."""
    return nproc * threads > len(cpus)


def pin(cpus):
    """Pin the calling process (a child between fork and exec) to cpus; None: leave it free."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def describe(sets):
    """'rank 0: CPU 0, rank 1: CPU 1' for the launcher's note (local ranks)."""
    return ", ".join(f"local rank {i}: CPU {','.join(map(str, sorted(s)))}" for i, s in enumerate(sets))
