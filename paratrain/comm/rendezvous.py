"""Ranks find each other through torch.distributed's TCPStore.

Rank 0 serves a key-value store at MASTER_ADDR:MASTER_PORT; every rank
connects, announces itself, and waits for all the others, with a deadline.
We do not write a key-value store: TCPStore is proven, and torch's own
process groups can be built on the same one.

What can go wrong gets a message that says what to do: the port is taken,
rank 0 is unreachable or something else holds its port, some ranks never came
or left after coming (wait_keys), or ranks disagree on the world size or the
backend (agree).
"""
import threading
import time
from datetime import timedelta

from torch.distributed import HashStore, TCPStore

from .errors import CommError, first_line
from .liveness import dead_local_peers
from .sockets import shut_down, socket_fds


class RendezvousError(CommError):
    """Ranks could not find each other."""


def connect(addr, port, rank, world_size, timeout):
    if world_size == 1:
        return HashStore()
    try:
        if rank == 0:
            store = TCPStore(addr, port, world_size, is_master=True,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
        else:
            store = _client(addr, port, world_size, timeout)
    except RendezvousError:
        raise
    except Exception as e:  # torch raises DistNetworkError / RuntimeError / DistStoreError
        low = str(e).lower()
        if rank == 0 and ("address already in use" in low or "errno: 98" in low or "eaddrinuse" in low):
            raise RendezvousError(
                f"rank 0 cannot serve the rendezvous on {addr}:{port}: the port is in use (another job?). "
                "Set MASTER_PORT to a free port, or let `paratrain run` pick one.") from None
        if rank == 0:
            raise RendezvousError(f"rank 0 could not start the rendezvous on {addr}:{port}: {first_line(e)}") \
                from None
        raise RendezvousError(
            f"rank {rank} could not reach the rendezvous at {addr}:{port} within {timeout:g}s "
            f"({first_line(e)}). Is rank 0 running, and do all ranks "
            "have the same MASTER_ADDR and MASTER_PORT?") from None
    return store


def connect_client(addr, port, timeout):
    """A client of a store another process serves (an elastic job's launcher)."""
    try:
        return _client(addr, port, None, timeout)
    except RendezvousError:
        raise
    except Exception as e:  # torch raises DistNetworkError / RuntimeError / DistStoreError
        raise RendezvousError(f"could not reach the launcher's store at {addr}:{port} within {timeout:g}s "
                              f"({first_line(e)}); is `paratrain run` alive?") from None


def _client(addr, port, world_size, timeout):
    """Connect to rank 0's store, within the timeout even when something else holds
    the port: TCPStore's client, connected to a program that accepts the connection
    but never answers its handshake, waits forever whatever its timeout. So it
    connects on a helper thread (it releases the GIL), and past the deadline, if
    its socket is connected, we shut that socket down: the helper's read returns,
    TCPStore raises there, and we raise our own error here. This takes /proc to
    find the socket; elsewhere the wait is TCPStore's own."""
    box, before = {}, socket_fds()

    def make():
        try:
            box["store"] = TCPStore(addr, port, world_size, is_master=False,
                                    timeout=timedelta(seconds=timeout), wait_for_workers=False)
        except Exception as e:   # raised in the caller's thread below
            box["error"] = e
    helper = threading.Thread(target=make, daemon=True, name="paratrain-rendezvous-connect")
    helper.start()
    # TCPStore ends its own connect retries some time past its timeout (when nothing
    # listens) and raises; we stop waiting only for a connection made and
    # never answered. (A helper still inside TCPStore when the interpreter exits may
    # abort the process, so it is ended, not left behind.)
    answered_by = time.monotonic() + timeout + 1.0
    while helper.is_alive():
        helper.join(0.25)
        if helper.is_alive() and time.monotonic() > answered_by \
                and shut_down(socket_fds() - before, lambda own, peer: peer == port):   # it raises and ends
            helper.join(5.0)
            raise RendezvousError(
                f"the rendezvous at {addr}:{port} took the connection but did not answer within {timeout:g}s: "
                "something other than a paratrain rank 0 (or torch.distributed store) holds that port, or "
                "rank 0 is stuck. Check MASTER_ADDR and MASTER_PORT, or let `paratrain run` pick a free port.")
    if "error" in box:
        raise box["error"]
    return box["store"]


def wait_for_ranks(store, rank, world_size, timeout, prefix="rdzv"):
    """Every rank announces (rank, world size); wait until all world_size ranks did."""
    store.set(f"{prefix}/rank/{rank}", str(world_size))
    keys = [f"{prefix}/rank/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:
        raise _not_all_arrived(store, rank, world_size, keys, timeout) from None
    sizes = {r: int(store.get(k)) for r, k in enumerate(keys)}
    wrong = {r: s for r, s in sizes.items() if s != world_size}
    if wrong:
        raise RendezvousError(f"ranks disagree on the world size: this rank has {world_size}, ranks {wrong} "
                              "say otherwise. Start every rank with the same WORLD_SIZE (with `paratrain run "
                              "--nnodes`: the same -n on every node).")


def _lost(rank, what, hint=""):
    return RendezvousError(f"rank {rank} lost the rendezvous (rank 0's store) while waiting for the other ranks "
                           f"in {what}: rank 0 exited or crashed.{hint} Look at rank 0's output.")


def _not_all_arrived(store, rank, world_size, keys, timeout):
    """The error for a wait that ended before every rank announced itself: who is
    missing, if rank 0's store still answers; if it does not, that rank 0 left."""
    try:
        present = [r for r, k in enumerate(keys) if store.check([k])]
        sizes = {int(store.get(keys[r])) for r in present}
    except Exception:   # the store's server, on rank 0, is gone
        return _lost(rank, f"the rendezvous of a world of {world_size}",
                     " If rank 0 and the ranks it waited for had another WORLD_SIZE than this rank, they "
                     "went on without it: start every rank with the same WORLD_SIZE (with `paratrain run "
                     "--nnodes`: the same -n on every node).")
    missing = [r for r in range(world_size) if r not in present]
    hint = f" Ranks disagree on the world size: {sorted(sizes)}." if len(sizes) > 1 else ""
    return RendezvousError(
        f"only {len(present)} of {world_size} ranks arrived at the rendezvous within {timeout:g}s; "
        f"missing ranks {missing}.{hint} Check that every rank was started with the same WORLD_SIZE "
        "(with `paratrain run --nnodes`: the same -n on every node) and backend (a rank on backend='mpi' "
        "does not come here), and that none crashed on start-up.")


def wait_keys(store, keys, owners, rank, timeout, what, procs=None):
    """store.wait(keys), failing with an error that names the ranks that never got
    there (owners[i] is the global rank that sets keys[i]), and those of them that
    have exited, as far as this host can tell (procs: (host, pid) by rank)."""
    try:
        store.wait(keys, timedelta(seconds=timeout))
        return
    except Exception:
        pass
    try:
        missing = sorted({o for k, o in zip(keys, owners) if not store.check([k])})
    except Exception:
        raise _lost(rank, what) from None
    dead = dead_local_peers(procs, rank, missing, settle=0.0) if procs else []
    raise RendezvousError(
        f"rank {rank}: ranks {missing} did not reach {what} within {timeout:g}s"
        + (f" (ranks {dead} have exited)" if dead else "")
        + ": they came to the rendezvous, then died, exited or got stuck before this step; their own "
        "output says why (raise PARATRAIN_TIMEOUT if they are only slow)") from None


def exchange(store, name, rank, world_size, value, timeout, what, procs=None):
    """Every rank states ``value`` (a string) under ``name``; returns every rank's, by
    rank, once all are in (wait_keys's error, naming ``what``, if some never come)."""
    store.set(f"{name}/{rank}", value)
    keys = [f"{name}/{r}" for r in range(world_size)]
    wait_keys(store, keys, range(world_size), rank, timeout, what, procs)
    return [store.get(k).decode() for k in keys]


def agree(store, name, rank, world_size, value, timeout, what, procs=None):
    """Every rank states ``value`` (a string) under ``name``; raise RendezvousError
    naming each rank's value unless all are equal. ``what`` says what to make equal."""
    values = exchange(store, name, rank, world_size, value, timeout,
                      f"the check that ranks agree on the {name}", procs)
    if len(set(values)) > 1:
        said = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise RendezvousError(f"ranks disagree on the {name} ({said}); {what}")
