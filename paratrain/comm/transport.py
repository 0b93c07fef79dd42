"""Transport: everything a collective algorithm may use of its group, in one place.

Gloo hands each algorithm a context with one pair per peer and nothing else;
the algorithm is written against the pairs' send and receive, so it runs on any
transport that provides them. So here: the algorithms of comm/algorithms/ (naive,
ring, tree) take a Transport and use only what is documented below, never the
group behind it. A backend builds its transport from its own point-to-point
(ProcessGroup does, from the backend's ``_send``/``_recv``/...), and a test can
hand an algorithm a fake one in a single process (tests/test_units.py).

The contract, which every backend keeps:

- ``rank``, ``world_size``: this rank's place in the group; peers are named by
  group-local ranks 0..world_size-1.
- Buffers are flat, C-contiguous numpy arrays; ``code`` is their dtype code
  (comm/ops.py), which a transport may use to move bfloat16 as what it is.
  A receive's buffer has exactly the size of the message it takes.
- Tags: the algorithms' own messages use tags from algorithms.TAG up, users'
  messages stay below it, so the two never match each other.
- Order: messages from one rank to another with one tag arrive in the order
  they were sent (MPI's non-overtaking rule, MPI 4.0 sec. 3.5); messages with
  different tags may be received in any order.
- No call waits forever: a wait past the group's timeout, or for a peer that
  died, raises CommTimeout or PeerError naming the peer.
"""


class Transport:
    """Point to point between the ranks of one group, for the collective algorithms.

    ``send(buf, code, dst, tag)``: returns once ``buf`` may be reused.
    ``recv(buf, code, src, tag)``: returns once the oldest message from src with
    this tag is in ``buf``.
    ``sendrecv(send_buf, dst, recv_buf, src, code, tag)``: both at once (dst and
    src may be one peer), so that ranks exchanging in a ring or with a partner
    do not wait on each other's sends: the step of a ring.
    ``isend(buf, code, dst, tag)`` / ``irecv(buf, code, src, tag)``: start the
    operation and return a Work (comm/work.py) whose ``wait()`` returns when it is
    done; sends started to one peer with one tag go in the order started.
    """

    __slots__ = ("rank", "world_size", "send", "recv", "sendrecv", "isend", "irecv")

    def __init__(self, rank, world_size, send, recv, sendrecv, isend, irecv):
        self.rank, self.world_size = rank, world_size
        self.send, self.recv, self.sendrecv = send, recv, sendrecv
        self.isend, self.irecv = isend, irecv

    def __repr__(self):
        return f"<Transport rank {self.rank}/{self.world_size}>"
