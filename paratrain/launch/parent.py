"""Tie a child process to its parent's life.

A worker must not outlive its launcher (kill -9, OOM): left behind, it holds
a port, shared memory or a GPU. ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the
kernel to kill the child when its parent ends.
"""
import ctypes
import os
import signal
import sys

from . import binding

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once in the launcher: the child should do as little as possible
# between fork and exec.
_PRCTL = _load_prctl()


def set_parent_death_signal(parent_pid):
    """SIGKILL this process when its parent ends; exit now if parent_pid already
    has (the parent died before prctl ran: the getppid check closes that race)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, ctypes.c_ulong(int(signal.SIGKILL)), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    if os.getppid() != parent_pid:
        os._exit(1)


def tie_to_parent(parent_pid, cpus=None):
    """The preexec_fn: runs in the child between fork and exec.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so
    workers must be started from a thread that lives as long as the launcher
    (main() starts them from its own thread and waits there).

    cpus (binding.py) pins the child here, before exec, so every thread the
    worker later starts (torch's, OpenMP's) inherits the mask."""
    def preexec():
        set_parent_death_signal(parent_pid)
        binding.pin(cpus)
    return preexec
