"""Watching the processes of one job: all succeed, or all stop.

A distributed job is only as alive as its least alive rank: once one worker
fails, the others will soon block in a collective waiting for it (until their
timeout). So the first failure stops the whole job at once: SIGTERM to every
worker's process group, SIGKILL after a grace period, then one report on
stderr naming the rank that failed, how, and its last lines. The same stop
runs when the launcher itself gets Ctrl-C (SIGINT) or SIGTERM; a second Ctrl-C
skips the grace period. This is torchrun's policy without restarts.

Two exceptions, each asked for on the command line (the Policy below):
- A parameter server that dies while the workers still run is started again
  from its checkpoint, a few times (servers.Restarts decides and does it): its
  state is on disk and the workers reconnect to the same address.
- With --worker-failure continue, a worker that dies is left behind: the
  servers are told it has left, so SSP's slowest clock stops counting it, and
  the others go on. That suits asynchronous parameter-server training (ASP,
  SSP), where no worker waits for another; in a synchronous job the others
  would block in their next collective until their timeout.
"""
import contextlib
import dataclasses
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


def describe_exit(rc, hint=True):
    if rc >= 0:
        return f"exited with code {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    oom = " (the kernel's out-of-memory killer sends SIGKILL)" if hint and -rc == signal.SIGKILL else ""
    return f"was killed by {name}{oom}"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)   # a closed terminal or ssh: HUP


class LauncherSignals:
    """Turns SIGINT/SIGTERM (and SIGHUP, SIGQUIT, as torchrun) to the launcher
    into flags the watch loop reads, so the job is stopped the same way whatever
    ended the launcher (only SIGKILL cannot be: the workers then end by their
    PDEATHSIG, but not children they started).

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
            for s in STOP_SIGNALS:
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
            say(f"paratrain: {w.label} (pid {w.pid}) survived SIGKILL for {REAP_TIMEOUT:g}s; leaving it")


@dataclasses.dataclass
class Policy:
    """What the job does when one of its processes ends early; local.py and
    serve.py fill it in from their options. The default is the plain policy:
    any failure stops everything."""
    command: str = "paratrain run"   # how the launcher names itself in its messages
    worker_failure: str = "stop"     # or "continue": a failed worker is left behind
    restarts: object = None          # servers.Restarts: a dead server's replacement, or None
    worker_lost: object = None       # called with a worker left behind; may return a thread to wait for
    lost_note: str = "--worker-failure continue"   # why the job goes on without a lost worker
    replace_worker: object = None    # called with a lost worker; returns its started replacement, or None
    worker_finished: object = None   # called once with each worker that exits 0


def _count(workers, servers):
    parts = [f"{len(p)} {name}{'s' if len(p) != 1 else ''}" for p, name in ((workers, "worker"), (servers, "server"))
             if p]
    return " and ".join(parts) or "nothing"


def _report(command, failed, others, headline=None):
    note = f" {failed.note}" if failed.note else ""
    where = f"local rank {failed.local_rank}, " if failed.label == f"rank {failed.rank}" else ""
    lines = [headline or f"{command}: {failed.label} ({where}pid {failed.pid}) "
                         f"{describe_exit(failed.proc.returncode)}{note}; stopped the rest of the job."]
    if others:
        lines.append("also failed on their own: " + ", ".join(
            f"{w.label} ({describe_exit(w.proc.returncode)})" for w in others))
    if failed.tail:
        lines.append(f"last lines of {failed.label}:")
        lines += [f"  [{failed.label}] {line}" for line in failed.tail]
    else:
        lines.append(f"{failed.label} printed nothing.")
    say("\n".join(lines))


def _worker_failures(workers, codes, lost, policy):
    """The first worker whose failure stops the job (the lowest rank among those
    found in the same look), or None. Under --worker-failure continue none does:
    each newly failed worker is announced, handed to policy.worker_lost (which
    tells the servers) and kept in ``lost`` with what that returned; where the
    policy replaces lost workers (elastic), the replacement joins ``workers``."""
    for w, rc in zip(workers, codes):
        if rc == 0 and policy.worker_finished is not None and not w.signalled:
            policy.worker_finished(w)
        if rc in (None, 0) or w in lost:
            continue
        if policy.worker_failure != "continue":
            return w
        say(f"{policy.command}: {w.label} {describe_exit(rc, hint=False)}; "
            f"the job goes on without it ({policy.lost_note})")
        lost[w] = policy.worker_lost(w) if policy.worker_lost is not None else None
        new = policy.replace_worker(w) if policy.replace_worker is not None else None
        if new is not None:
            workers.append(new)   # watched from now on, as the others
    return None


def _keep_servers(servers, policy):
    """Replace, in ``servers`` itself, each server that ended by its restart; the
    first one that is not restarted is returned: its end stops the job."""
    for i, s in enumerate(servers):
        if s.poll() is None:
            continue
        new = policy.restarts.replace(s) if policy.restarts is not None else None
        if new is None:
            return s
        servers[i] = new
    return None


def _outcome(command, workers, lost):
    """The exit code once every worker has ended without stopping the job: 0 when
    at least one succeeded (the lost ones are listed), else the first lost one's."""
    if not lost:
        return 0
    names = ", ".join(f"{w.label} ({describe_exit(w.proc.returncode, hint=False)})" for w in lost)
    if len(lost) < len(workers):
        say(f"{command}: {len(workers) - len(lost)} of {len(workers)} workers finished; lost {names}.")
        return 0
    _report(command, lost[0], [], headline=f"{command}: no worker finished: {names}.")
    rc = lost[0].proc.returncode
    return rc if rc > 0 else 1


def supervise(workers, grace=GRACE, poll=POLL, servers=(), policy=None, signals=None):
    """Watch started workers until the job ends; return the launcher's exit code:
    0 when all succeed, the failed worker's code (1 if it died by a signal),
    or 128 + the signal number when the launcher was interrupted.

    ``servers`` (parameter servers) serve the workers: one ending before the
    workers are done is restarted if the policy allows, else a failure; once
    every worker has ended they are asked to stop (SIGTERM) and their own exit
    does not count. With servers and no workers (paratrain server) the job runs
    until the launcher is interrupted or a server cannot be restarted.
    ``policy`` (default: stop at the first failure) is described in Policy.
    ``signals``: LauncherSignals the caller entered before starting the workers,
    so a signal that came while they started is acted on, not fatal."""
    policy = policy or Policy()
    workers, servers = list(workers), list(servers)  # servers: replaced in place by their restarts
    failed, lost = None, {}  # lost: worker left behind -> the thread telling the servers, or None
    with contextlib.nullcontext(signals) if signals is not None else LauncherSignals() as signals:
        while signals.received is None:
            codes = [w.poll() for w in workers]
            failed = _worker_failures(workers, codes, lost, policy)
            if failed is not None or (workers and None not in codes):
                break  # a failure, or every worker has ended
            failed = _keep_servers(servers, policy)
            if failed is not None:
                break
            time.sleep(poll)  # a signal runs its handler, then the sleep resumes (PEP 475)
        everyone = workers + servers
        if failed is None and signals.received is None:
            for t in filter(None, lost.values()):
                t.join()  # bounded by the farewell's timeout; else it would fail against stopped servers
        # Every worker has ended here unless the job is being stopped; either way what
        # they left behind in their process groups goes too (their output pipes with it)
        stop(everyone, signals, grace)
    deadline = time.monotonic() + READER_JOIN
    for w in everyone:
        w.join_output(deadline)
    if signals.received is not None and failed is None:
        name = signal.Signals(signals.received).name
        say(f"{policy.command}: got {name}; stopped {_count(workers, servers)}.")
        return 128 + signals.received
    if failed is not None:
        others = [w for w in everyone if w is not failed and not w.signalled and w.proc.returncode != 0]
        _report(policy.command, failed, others)
        rc = failed.proc.returncode
        return rc if rc > 0 else 1
    return _outcome(policy.command, workers, list(lost))
