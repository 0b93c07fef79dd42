"""Ranks find each other through torch.distributed's TCPStore.

Rank 0 serves a key-value store at MASTER_ADDR:MASTER_PORT; every rank
connects, announces itself, and waits for all the others, with a deadline.
We do not write a key-value store: TCPStore is proven, and torch's own
process groups can be built on the same one.

What can go wrong gets a message that says what to do: the port is taken,
rank 0 is unreachable, some ranks never came, or ranks disagree on the
world size.
"""
from datetime import timedelta

from torch.distributed import HashStore, TCPStore

from .errors import CommError


class RendezvousError(CommError):
    """Ranks could not find each other."""


def connect(addr, port, rank, world_size, timeout):
    if world_size == 1:
        return HashStore()
    try:
        store = TCPStore(addr, port, world_size, is_master=(rank == 0),
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:  # torch raises DistNetworkError / RuntimeError / DistStoreError
        msg = str(e)
        low = msg.lower()
        if rank == 0 and ("address already in use" in low or "errno: 98" in low or "eaddrinuse" in low):
            raise RendezvousError(
                f"rank 0 cannot serve the rendezvous on {addr}:{port}: the port is in use (another job?). "
                "Set MASTER_PORT to a free port, or let `paratrain run` pick one.") from None
        if rank == 0:
            raise RendezvousError(f"rank 0 could not start the rendezvous on {addr}:{port}: {msg.splitlines()[0]}") \
                from None
        raise RendezvousError(
            f"rank {rank} could not reach the rendezvous at {addr}:{port} within {timeout:g}s "
            f"({msg.splitlines()[0] if msg else type(e).__name__}). Is rank 0 running, and do all ranks "
            "have the same MASTER_ADDR and MASTER_PORT?") from None
    return store


def wait_for_ranks(store, rank, world_size, timeout, prefix="rdzv"):
    """Every rank announces (rank, world size); wait until all world_size ranks did."""
    store.set(f"{prefix}/rank/{rank}", str(world_size))
    keys = [f"{prefix}/rank/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:
        present = [r for r, k in enumerate(keys) if store.check([k])]
        missing = [r for r in range(world_size) if r not in present]
        sizes = {int(store.get(keys[r])) for r in present}
        hint = (f" Ranks disagree on the world size: {sorted(sizes)}." if len(sizes) > 1 else "")
        raise RendezvousError(
            f"only {len(present)} of {world_size} ranks arrived at the rendezvous within {timeout:g}s; "
            f"missing ranks {missing}.{hint} Check that every rank was started with the same WORLD_SIZE "
            "and that none crashed on start-up.") from None
    sizes = {r: int(store.get(k)) for r, k in enumerate(keys)}
    wrong = {r: s for r, s in sizes.items() if s != world_size}
    if wrong:
        raise RendezvousError(f"ranks disagree on the world size: this rank has {world_size}, ranks {wrong} "
                              "say otherwise. Start every rank with the same WORLD_SIZE.")
