"""This process's TCP connections, found in /proc and shut down from outside their owner.

Two waits inside C++ cannot be interrupted otherwise: TCPStore's client
connecting to a program that never answers (rendezvous.py), and Gloo waiting
on a peer that hangs without closing anything (abandon.py). Shutting down our
own end of the connection (not closing it: its owner still holds the
descriptor) makes the blocked read return, and the owner raise.
"""
import os
import socket


def socket_fds():
    """This process's open sockets (Linux's /proc; empty elsewhere)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    out = set()
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.add(int(fd))
        except OSError:   # the listing's own descriptor, closed by now
            pass
    return out


def shut_down(fds, match):
    """Shut down those of ``fds`` that are connected TCP sockets for which
    ``match(own port, peer port)`` is true; returns how many. A socket still
    connecting has no peer: left alone."""
    shut = 0
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:   # a duplicate: shutdown reaches the socket itself
                if s.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                own, peer = s.getsockname()[1], s.getpeername()[1]
                if match(own, peer):
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
        except OSError:
            pass
    return shut
