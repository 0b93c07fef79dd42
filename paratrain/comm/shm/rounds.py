"""Rounds: everything the shared-memory algorithms may use of their group, in one place.

The algorithms that only make sense in shared memory (direct, cma, resident)
are not built from messages but from rounds of "write into my slot, barrier,
read what I need from anyone's slot" (group.py explains the slots). They take
a Rounds, as the portable algorithms take a Transport (comm/transport.py), and
use only what is documented here, never the ShmGroup behind it.

- ``rank``, ``world_size``: this rank's place in the group; ``ranks``: the
  global rank of each member, for naming a peer in an error.
- ``slot_bytes``: the size of one slot.
- ``next_slots()``: this round's slot of every rank, a list of uint8 views of
  slot_bytes each (rank q's at index q). Each call hands out the next of three
  buffers per rank, in turn. The rule that makes one barrier per round enough:
  read a round's slots only before arriving at the next ``sync``, and write a
  buffer only after every read of its previous use is over (three calls later).
- ``next_words()``: the same, as int64 views, for publishing addresses and
  lengths (cma.py); it takes its turn in the same sequence as next_slots.
- ``sync()``: a barrier of every rank of the group. The first one of a
  collective also compares what each rank called (the always-on mismatch
  check), so an algorithm must sync before it reads anything a peer wrote.
- ``pids``: the pid of every rank (int64), for reading a peer's memory (cma.py).
"""


class Rounds:
    """What a shared-memory algorithm sees of its group (see the module docstring)."""

    __slots__ = ("rank", "world_size", "ranks", "slot_bytes", "pids", "sync", "next_slots", "next_words")

    def __init__(self, rank, world_size, ranks, slot_bytes, pids, sync, next_slots, next_words):
        self.rank, self.world_size, self.ranks = rank, world_size, ranks
        self.slot_bytes, self.pids = slot_bytes, pids
        self.sync, self.next_slots, self.next_words = sync, next_slots, next_words

    def __repr__(self):
        return f"<Rounds rank {self.rank}/{self.world_size}>"
