"""Watching the workers of one job: all succeed, or all stop.

A distributed job is only as alive as its least alive rank: once one worker
fails, the others will soon block in a collective waiting for it (until their
timeout). So the first failure stops the whole job at once: SIGTERM to every
worker's process group, SIGKILL after a grace period, then one report on
stderr naming the rank that failed, how, and its last lines. The same stop
runs when the launcher itself gets Ctrl-C (SIGINT) or SIGTERM; a second Ctrl-C
skips the grace period. This is torchrun's policy without restarts.
"""
import signal
import subprocess
import sys
import threading
import time

from .worker import OUTPUT_LOCK

GRACE = 3.0  # seconds between SIGTERM and SIGKILL
POLL = 0.1   # seconds between looks at the workers
READER_JOIN = 2.0  # seconds to wait for the last output after the workers ended
REAP_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed worker to be gone


def say(msg):
    with OUTPUT_LOCK:
        print(msg, file=sys.stderr, flush=True)


def describe_exit(rc):
    if rc >= 0:
        return f"exited with code {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    hint = " (the kernel's out-of-memory killer sends SIGKILL)" if -rc == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


class LauncherSignals:
    """Turns SIGINT/SIGTERM to the launcher into flags the watch loop reads.

    Handlers can only be installed from the main thread; elsewhere (main() run
    from a thread) the launcher simply relies on the caller."""

    def __init__(self):
        self.received = None   # the first signal
        self.hurry = False     # a second one: skip the grace period
        self._old = {}

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = signum
        else:
            self.hurry = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def stop(workers, signals, grace=GRACE):
    """SIGTERM every live worker's group, SIGKILL whatever is left after grace."""
    for w in workers:
        if w.poll() is None:
            w.signalled = True
            w.kill_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(w.poll() is None for w in workers) and time.monotonic() < deadline and not signals.hurry:
        time.sleep(0.02)
    for w in workers:
        # Also reaches what an exited worker left behind in its group.
        w.kill_group(signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=REAP_TIMEOUT)
        except subprocess.TimeoutExpired:  # stuck in the kernel (uninterruptible I/O): do not hang with it
            say(f"paratrain run: rank {w.rank} (pid {w.pid}) survived SIGKILL for {REAP_TIMEOUT:g}s; leaving it")


def _report(failed, others):
    lines = [f"paratrain run: {failed.label} (local rank {failed.local_rank}, pid {failed.pid}) "
             f"{describe_exit(failed.proc.returncode)}; stopped the other workers."]
    if others:
        lines.append("also failed on their own: " + ", ".join(
            f"{w.label} ({describe_exit(w.proc.returncode)})" for w in others))
    if failed.tail:
        lines.append(f"last lines of {failed.label}:")
        lines += [f"  [{failed.label}] {line}" for line in failed.tail]
    else:
        lines.append(f"{failed.label} printed nothing.")
    say("\n".join(lines))


def supervise(workers, grace=GRACE, poll=POLL, servers=()):
    """Watch started workers until the job ends; return the launcher's exit code:
    0 when all succeed, the failed worker's code (1 if it died by a signal),
    or 128 + the signal number when the launcher was interrupted.

    ``servers`` (parameter servers) serve the workers: any of them ending
    before the workers are done is a failure; once every worker has succeeded
    they are asked to stop (SIGTERM) and their own exit does not count."""
    failed = None
    everyone = list(workers) + list(servers)
    with LauncherSignals() as signals:
        while signals.received is None:
            codes = [w.poll() for w in workers]
            gone = [s for s in servers if s.poll() is not None]
            bad = [w for w, rc in zip(workers, codes) if rc not in (None, 0)] + gone
            if bad:
                failed = bad[0]  # the lowest rank among those found in the same look
                break
            if all(rc == 0 for rc in codes):
                break
            time.sleep(poll)  # a signal runs its handler, then the sleep resumes (PEP 475)
        if failed is not None or signals.received is not None:
            stop(everyone, signals, grace)
        elif servers:
            stop(list(servers), signals, grace)
    workers = everyone
    deadline = time.monotonic() + READER_JOIN
    for w in workers:
        w.join_output(max(0.0, deadline - time.monotonic()))
    if signals.received is not None and failed is None:
        name = signal.Signals(signals.received).name
        say(f"paratrain run: got {name}; stopped {len(workers)} workers.")
        return 128 + signals.received
    if failed is not None:
        others = [w for w in workers if w is not failed and not w.signalled and w.proc.returncode != 0]
        _report(failed, others)
        rc = failed.proc.returncode
        return rc if rc > 0 else 1
    return 0
