"""Lose a worker on purpose: ``paratrain train --fail RANK:STEP``.

Rank RANK kills itself with SIGKILL as it begins step STEP (having done
STEP - 1 steps), as a machine that loses power would: no exception, no
message to its peers, no flush of anything it holds. What follows is the
job's own policy for a lost worker: a synchronous job stops, naming it;
the parameter server under ASP/SSP goes on without it. For demonstrations
and tests; repeat the flag to lose several.
"""
import argparse
import os
import signal
import sys


def fail_spec(text):
    """'RANK:STEP' -> (rank, step); argparse type of --fail."""
    try:
        rank, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fail expects RANK:STEP, e.g. 2:100; got {text!r}") from None
    if rank < 0 or step < 1:
        raise argparse.ArgumentTypeError(f"--fail: RANK must be >= 0 and STEP >= 1, got {text!r}")
    return rank, step


def die_if_due(failures, rank, step):
    """SIGKILL this process if (rank, step) is one of ``failures`` (step counts from 1)."""
    if (rank, step) in failures:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)
