"""Is a peer process still alive? How a rank tells "my peer died" from "my peer is slow".

Every rank publishes its host and pid at ``pt.init`` (world.py); a rank whose
wait failed checks the peers on its own host in /proc. Peers on other hosts
cannot be checked this way: an error then names every rank it may be.
"""
import time


def alive(pid):
    """True unless the process is gone or a zombie (a dead child its parent has not reaped).
    Pid 0: the rank has not published its pid yet (it is still finishing set-up)."""
    if pid <= 0:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def dead_local_peers(procs, me, peers, settle=1.0):
    """Global ranks among ``peers`` that ran on this rank's host and have exited.

    procs: [(host, pid)] by global rank, or None when unknown. A killed process
    closes its sockets before it becomes a zombie, so a connection reset can
    arrive a moment before /proc shows the death: look again for up to ``settle``
    seconds before answering that nobody died."""
    if not procs:
        return []
    host = procs[me][0]
    local = [r for r in peers if procs[r][0] == host]
    end = time.monotonic() + (settle if local else 0)
    while True:
        dead = [r for r in local if not alive(procs[r][1])]
        if dead or time.monotonic() >= end:
            return dead
        time.sleep(0.05)
