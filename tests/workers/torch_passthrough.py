"""Worker: on the torch backend, the caller's own tensors reach torch.distributed.

torch.distributed's functions are wrapped to record the tensors they are
given, and ops.as_buffer (the numpy view ProcessGroup's path takes) to count
its calls. For each collective and point-to-point call made with torch
tensors: the result is right, the very tensor object reached torch.distributed
(1-D tensors; a 2-D one may reach it as a flat view of the same memory, its
data_ptr), and no numpy view was made. numpy arrays still take the numpy path.
"""
import sys

import numpy as np
import torch
import torch.distributed as dist

import paratrain as pt
from paratrain.comm import ops

seen = []          # every tensor handed to a torch.distributed function
as_buffer_calls = []
WRAPPED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
           "reduce_scatter_single", "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single",
           "all_to_all", "send", "recv", "isend", "irecv")


def spy(fn):
    def wrapped(*args, **kwargs):
        for a in list(args) + list(kwargs.values()):
            seen.extend(a if isinstance(a, list) else [a] if isinstance(a, torch.Tensor) else [])
        return fn(*args, **kwargs)
    return wrapped


def counting(fn):
    def wrapped(*args, **kwargs):
        as_buffer_calls.append(type(args[0]).__name__)
        return fn(*args, **kwargs)
    return wrapped


def passed_through(what, *tensors, same_object=True):
    """Each tensor reached torch.distributed since the last check: itself, or (same_object
    False) a tensor on its memory; and nothing was viewed through numpy."""
    for t in tensors:
        if same_object:
            ok = any(s is t for s in seen)
        else:
            ok = any(s.data_ptr() == t.data_ptr() and s.device == t.device for s in seen)
        if not ok:
            raise AssertionError(f"{what}: the caller's tensor {tuple(t.shape)} did not reach torch.distributed "
                                 f"{'as it is' if same_object else 'in its own memory'}")
    if as_buffer_calls:
        raise AssertionError(f"{what}: went through numpy ({as_buffer_calls})")
    seen.clear()
    return 1


def check(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()}, want {want.tolist()}")


def main():
    g = pt.init(backend="torch")
    P, me = g.world_size, g.rank
    for name in WRAPPED:
        if hasattr(dist, name):
            setattr(dist, name, spy(getattr(dist, name)))
    ops.as_buffer = counting(ops.as_buffer)
    n = 0

    t = torch.full((4,), float(me + 1))
    g.all_reduce(t)
    check(t, torch.full((4,), float(sum(range(1, P + 1)))), "all_reduce")
    n += passed_through("all_reduce", t)
    m = torch.full((2, 3), float(me))
    g.all_reduce(m, op="max", async_op=True).wait()
    check(m, torch.full((2, 3), float(P - 1)), "async all_reduce of a 2-D tensor")
    n += passed_through("async all_reduce of a 2-D tensor", m)
    w = torch.ones(3, requires_grad=True)   # as a parameter: reduced in its own memory, not as itself
    g.all_reduce(w, op="avg")
    n += passed_through("all_reduce of a tensor that requires grad", w, same_object=False)

    b = torch.arange(5.0) if me == P - 1 else torch.zeros(5)
    g.broadcast(b, src=P - 1)
    check(b, torch.arange(5.0), "broadcast")
    n += passed_through("broadcast", b)

    r = torch.full((3,), float(me + 1))
    g.reduce(r, dst=0)
    if me == 0:
        check(r, torch.full((3,), float(sum(range(1, P + 1)))), "reduce")
        n += passed_through("reduce", r)
    else:
        check(r, torch.full((3,), float(me + 1)), "reduce leaves non-root tensors as they were")
        seen.clear()

    x = torch.full((2,), float(me))
    out = torch.empty(2 * P)
    g.all_gather(out, x)
    check(out, torch.arange(P).float().repeat_interleave(2), "all_gather into one tensor")
    n += passed_through("all_gather into one tensor", out, x)
    pieces = [torch.empty(2) for _ in range(P)]
    g.all_gather(pieces, x)
    check(torch.cat(pieces), torch.arange(P).float().repeat_interleave(2), "all_gather into a list")
    n += passed_through("all_gather into a list", x, *pieces)
    x2 = torch.full((1, 2), float(me))
    out2 = torch.empty(P, 2)
    g.all_gather(out2, x2)
    check(out2, torch.arange(P).float().repeat_interleave(2).view(P, 2), "all_gather of 2-D tensors")
    n += passed_through("all_gather of 2-D tensors", out2, x2, same_object=False)

    inp = torch.arange(2.0 * P) + me
    rs = torch.empty(2)
    g.reduce_scatter(rs, inp)
    want = sum(torch.arange(2.0 * P) + q for q in range(P))[2 * me:2 * me + 2]
    check(rs, want, "reduce_scatter")
    n += passed_through("reduce_scatter", rs, inp)

    gl = [torch.empty(3) for _ in range(P)] if me == 0 else None
    gi = torch.full((3,), float(me))
    g.gather(gi, gl, dst=0)
    if me == 0:
        check(torch.stack(gl), torch.arange(P).float()[:, None].expand(P, 3), "gather")
        n += passed_through("gather", gi, *gl)
    else:
        n += passed_through("gather", gi)

    sl = [torch.full((3,), float(q)) for q in range(P)] if me == 0 else None
    so = torch.empty(3)
    g.scatter(so, sl, src=0)
    check(so, torch.full((3,), float(me)), "scatter")
    n += passed_through("scatter", so, *(sl or []))

    a_in = torch.arange(float(P)) + 10 * me
    a_out = torch.empty(P)
    g.all_to_all(a_out, a_in)
    check(a_out, torch.tensor([10.0 * q + me for q in range(P)]), "all_to_all")
    n += passed_through("all_to_all", a_out, a_in)

    if P > 1:
        if me == 0:
            msg = torch.arange(6.0)
            g.send(msg, 1, tag=3)
            n += passed_through("send", msg)
            amsg = torch.arange(4, dtype=torch.int64)
            g.isend(amsg, 1, tag=4).wait()
            n += passed_through("isend", amsg)
        elif me == 1:
            got = torch.empty(6)
            g.recv(got, 0, tag=3)
            check(got, torch.arange(6.0), "recv")
            n += passed_through("recv", got)
            agot = torch.empty(4, dtype=torch.int64)
            g.irecv(agot, 0, tag=4).wait()
            check(agot, torch.arange(4, dtype=torch.int64), "irecv")
            n += passed_through("irecv", agot)

    arr = np.full(3, float(me + 1), np.float32)   # numpy still takes ProcessGroup's path
    g.all_reduce(arr)
    assert arr.tolist() == [float(sum(range(1, P + 1)))] * 3, arr
    assert as_buffer_calls == ["ndarray"], as_buffer_calls
    g.barrier()
    print(f"rank {me}: {n} tensor pass-through checks passed", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
