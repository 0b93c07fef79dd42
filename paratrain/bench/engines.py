"""The engines under test, each behind the same five calls on numpy buffers.

    barrier()  all_reduce(buf)  all_gather(out, inp)  reduce_scatter(out, inp)  broadcast(buf, src)
    reduce(buf, dst)  gather(out, inp, dst)  scatter(out, inp, src)  all_to_all(out, inp)

Sums of float32, results in place, ``out`` being one flat buffer of
world_size pieces (torch's ``*_single`` layout). Every engine is called the
way its own users would call it, and each gets its *own* barrier before a
timed call: a barrier of another engine would leave this one's internal state
(Gloo's background thread, MPI's progress engine) in an unfair place.

- Paratrain: ``pt.init(backend="shm")`` (or "hierarchical"), numpy in, numpy out.
- Gloo: torch.distributed with its own store (gloo_group.py); torch tensors
  share the numpy buffers' memory (``torch.from_numpy`` is a view, no copy).
- Mpi: mpi4py's buffer-protocol calls (capitalised: no pickling), which go
  straight to Open MPI's C collectives.
"""
import numpy as np
import torch


class Paratrain:
    def __init__(self, group, algorithm=None, name="paratrain"):
        self.g, self.algorithm, self.name = group, algorithm, name
        self.notes = {}

    def barrier(self):
        self.g.barrier()

    def all_reduce(self, buf):
        self.g.all_reduce(buf, op="sum", algorithm=self.algorithm)

    def all_gather(self, out, inp):
        self.g.all_gather(out, inp)

    def reduce_scatter(self, out, inp):
        self.g.reduce_scatter(out, inp, op="sum")

    def broadcast(self, buf, src):
        self.g.broadcast(buf, src)

    def reduce(self, buf, dst):
        self.g.reduce(buf, dst=dst)

    def gather(self, out, inp, dst):
        self.g.gather(inp, out if self.g.rank == dst else None, dst=dst)

    def scatter(self, out, inp, src):
        self.g.scatter(out, inp if self.g.rank == src else None, src=src)

    def all_to_all(self, out, inp):
        self.g.all_to_all(out, inp)


class Gloo:
    """torch.distributed over Gloo, the engine PyTorch users get on CPU."""

    name = "gloo"

    def __init__(self, group, addr, timeout):
        import torch.distributed as dist

        from .gloo_group import init_gloo
        self.dist, self.rank = dist, group.rank
        init_gloo(group, timeout, addr)   # its store on a port rank 0 bound and sent over ``group``
        # torch 2.13 renamed the flat-buffer collectives; the old names warn on every call.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._emulate_rs = False
        self.notes = {}

    def barrier(self):
        self.dist.barrier()

    def all_reduce(self, buf):
        self.dist.all_reduce(torch.from_numpy(buf))

    def all_gather(self, out, inp):
        self._all_gather(torch.from_numpy(out), torch.from_numpy(inp))

    def reduce_scatter(self, out, inp):
        """Gloo lacked reduce_scatter for years; if this torch's Gloo still raises,
        fall back to what users do: all_reduce a copy, keep this rank's slice.
        (The raise is a local "unsupported" check, the same on every rank, so
        all ranks switch together.)"""
        if not self._emulate_rs:
            try:
                self._reduce_scatter(torch.from_numpy(out), torch.from_numpy(inp))
                return
            except (RuntimeError, NotImplementedError, ValueError) as e:
                self._emulate_rs = True
                self.notes["reduce_scatter"] = f"emulated (all_reduce + slice): {str(e).splitlines()[0][:80]}"
        tmp = torch.from_numpy(inp).clone()
        self.dist.all_reduce(tmp)
        n = out.size
        out[...] = tmp[self.rank * n:(self.rank + 1) * n].numpy()

    def broadcast(self, buf, src):
        self.dist.broadcast(torch.from_numpy(buf), src)

    def reduce(self, buf, dst):
        self.dist.reduce(torch.from_numpy(buf), dst)

    def gather(self, out, inp, dst):
        pieces = list(torch.from_numpy(out).chunk(self.dist.get_world_size())) if self.rank == dst else None
        self.dist.gather(torch.from_numpy(inp), pieces, dst=dst)

    def scatter(self, out, inp, src):
        pieces = list(torch.from_numpy(inp).chunk(self.dist.get_world_size())) if self.rank == src else None
        self.dist.scatter(torch.from_numpy(out), pieces, src=src)

    def all_to_all(self, out, inp):
        self.dist.all_to_all_single(torch.from_numpy(out), torch.from_numpy(inp))

    def close(self):
        self.dist.destroy_process_group()


class Mpi:
    """Open MPI through mpi4py. Initialised with MPI_THREAD_FUNNELED: only the
    main thread calls MPI (paratrain's helper threads never do), and Open MPI's
    THREAD_MULTIPLE locking, mpi4py's default, would tax MPI unfairly."""

    name = "mpi"

    def __init__(self):
        import mpi4py
        mpi4py.rc.thread_level = "funneled"
        from mpi4py import MPI
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.notes = {}

    def library_version(self):
        return self.MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]

    def barrier(self):
        self.comm.Barrier()

    def all_reduce(self, buf):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def all_gather(self, out, inp):
        self.comm.Allgather(inp, out)

    def reduce_scatter(self, out, inp):
        self.comm.Reduce_scatter_block(inp, out, op=self.MPI.SUM)

    def broadcast(self, buf, src):
        self.comm.Bcast(buf, root=src)

    def reduce(self, buf, dst):
        if self.comm.rank == dst:
            self.comm.Reduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM, root=dst)
        else:
            self.comm.Reduce(buf, None, op=self.MPI.SUM, root=dst)

    def gather(self, out, inp, dst):
        self.comm.Gather(inp, out if self.comm.rank == dst else None, root=dst)

    def scatter(self, out, inp, src):
        self.comm.Scatter(inp if self.comm.rank == src else None, out, root=src)

    def all_to_all(self, out, inp):
        self.comm.Alltoall(inp, out)


def gather_to_all(group, values):
    """Every rank's float64 vector, stacked (P x n), over the paratrain group: how
    per-rank times and checks reach rank 0 (outside any timed region)."""
    local = np.ascontiguousarray(values, dtype=np.float64)
    out = np.empty(group.world_size * local.size, dtype=np.float64)
    group.all_gather(out, local)
    return out.reshape(group.world_size, local.size)
