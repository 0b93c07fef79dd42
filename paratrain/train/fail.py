"""Lose a worker on purpose: ``paratrain train --fail RANK:STEP[:WHEN]``.

Rank RANK kills itself with SIGKILL as it begins step STEP (having done
STEP - 1 steps), as a machine that loses power would: no exception, no
message to its peers, no flush of anything it holds. What follows is the
job's own policy for a lost worker: a synchronous job stops, naming it;
the parameter server under ASP/SSP goes on without it; an elastic job
(--min-workers) goes on without it. For demonstrations and tests; repeat
the flag to lose several.

In an elastic job RANK is the worker's first rank (its worker id: ranks move
when the world changes, and a step done again must not kill a second
worker), and WHEN may say where else to die: ``commit`` in the commit after
step STEP (the others are then agreeing on it), ``reform`` in the first
re-form of the world that goes back to a commit at step STEP or later (the
others are then re-forming: a failure in the middle of a recovery), or
``hang``: as it begins step STEP it stops (SIGSTOP) instead of dying, as a
process stuck without closing anything would.
"""
import argparse
import os
import signal
import sys

WHEN = ("step", "commit", "reform", "hang")


def fail_spec(text):
    """'RANK:STEP[:WHEN]' -> (rank, step, when); argparse type of --fail."""
    parts = text.split(":")
    when = parts.pop() if len(parts) == 3 else "step"
    try:
        rank, step = (int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fail expects RANK:STEP, e.g. 2:100; got {text!r}") from None
    if rank < 0 or step < 1:
        raise argparse.ArgumentTypeError(f"--fail: RANK must be >= 0 and STEP >= 1, got {text!r}")
    if when not in WHEN:
        raise argparse.ArgumentTypeError(f"--fail {text}: WHEN is one of {', '.join(WHEN)}, got {when!r}")
    return rank, step, when


def die_if_due(failures, rank, step, when="step"):
    """SIGKILL this process if one of ``failures`` is due for ``rank`` at ``step`` (counted
    from 1; for a re-form, the step of the commit it goes back to) and ``when``."""
    for r, s, w in failures:
        hang = w == "hang" and when == "step"
        if r == rank and (w == when or hang) and (step >= s if when == "reform" else step == s):
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.kill(os.getpid(), signal.SIGSTOP if hang else signal.SIGKILL)
