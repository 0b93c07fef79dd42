"""A worker's peak memory for the summary: how far its resident set grew above where it began.

Workers are forked from a process that has torch (and the task's libraries)
loaded, so each starts with hundreds of MB resident that are the same for
every strategy. What tells strategies apart is what training added: the
model, its gradients, the optimizer's state, activations and communication
buffers. So a worker reads its resident set before it builds the task, and
at the end reports its peak (getrusage's maxrss) less that.
"""
import os
import resource

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def resident_mb():
    """This process's resident set now, in MiB (/proc/self/statm's second field)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_MB
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_memory_mb(before):
    """MiB this process's resident set peaked at above ``before`` (Linux reports maxrss in KiB)."""
    return max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before)
