"""Worker: all_reduce on tensors from g.empty_shared against a float64 reference.

On shm these live in shared memory and take the zero-copy (resident) path; on
other backends they are ordinary tensors and the same checks must hold. Slices
at an offset, zero and odd lengths, several dtypes and ops, async, all_gather
and reduce_scatter in place; on shm, a
rank passing a private tensor where the others pass a shared one is a
MismatchError, not a hang or a wrong sum.
"""
import numpy as np
import torch

import paratrain as pt


def inputs(P, n, dt, salt):
    if dt.is_floating_point:
        return [torch.from_numpy(np.random.default_rng(100 * r + salt).uniform(0.5, 1.5, n)).to(dt) for r in range(P)]
    return [torch.from_numpy(np.random.default_rng(100 * r + salt).integers(0, 9, n)).to(dt) for r in range(P)]


def main():
    g = pt.init()
    P, me = g.world_size, g.rank
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for n in (0, 5, 1000, 300_001, 1_500_017):
            buf = g.empty_shared(n + 7, dt)
            for op in ("sum", "avg", "max") if dt.is_floating_point else ("sum", "max"):
                ins = inputs(P, n, dt, n + len(op))
                t = buf[3:3 + n]
                t.copy_(ins[me])
                g.all_reduce(t, op=op)
                a = torch.stack([x.double() for x in ins])
                want = {"sum": a.sum(0), "avg": a.mean(0), "max": a.amax(0) if n else a.sum(0)}[op]
                tol = 5e-2 if dt == torch.bfloat16 else 1e-6
                if not torch.allclose(t.double(), want, rtol=tol, atol=tol):
                    raise AssertionError(f"{dt} n={n} op={op}: got {t[:4].tolist()} want {want[:4].tolist()}")
            t = buf[:n]
            t.fill_(me + 1)
            g.all_reduce(t, async_op=True).wait()
            if not (t.double() == P * (P + 1) / 2).all():
                raise AssertionError(f"async all_reduce {dt} n={n}: got {t[:4].tolist()}")
    for n in (0, 3, 70_001):
        ins = inputs(P, P * n, torch.float32, 5)
        src = g.empty_shared(P * n + 16)
        piece = src[16:16 + n]  # all_gather of a resident input, at an offset
        piece.copy_(ins[me][:n])
        out = torch.full((P * n,), -1.0)
        g.all_gather(out, piece)
        want = torch.cat([x[:n] for x in ins])
        if not torch.equal(out, want):
            raise AssertionError(f"all_gather of a shared input, n={n}: got {out[:4].tolist()}")
        whole = src[16:16 + P * n]  # reduce_scatter of a resident input (one tensor of P pieces)
        whole.copy_(ins[me])
        got = torch.full((n,), -1.0)
        g.reduce_scatter(got, whole, op="sum")
        want = torch.stack(ins).double().sum(0)[me * n:(me + 1) * n]
        if not torch.allclose(got.double(), want, rtol=1e-6):
            raise AssertionError(f"reduce_scatter of a shared input, n={n}: got {got[:4].tolist()}")
        g.reduce_scatter(whole[me * n:(me + 1) * n], whole, op="max")  # in place: output inside the input
        want = torch.stack(ins).amax(0)[me * n:(me + 1) * n] if n else torch.zeros(0)
        if not torch.equal(whole[me * n:(me + 1) * n], want):
            raise AssertionError(f"in-place reduce_scatter of a shared input, n={n}")
        whole.copy_(ins[me])   # and a sum, which (unlike max) would show a piece counted twice
        g.reduce_scatter(whole[me * n:(me + 1) * n], whole, op="sum")
        want = torch.stack(ins).double().sum(0)[me * n:(me + 1) * n]
        if not torch.allclose(whole[me * n:(me + 1) * n].double(), want, rtol=1e-6):
            raise AssertionError(f"in-place reduce_scatter (sum) of a shared input, n={n}")
        whole.fill_(-1.0)   # all_gather in place: the input is this rank's piece of the output (ZeRO)
        whole[me * n:(me + 1) * n] = ins[me][:n]
        g.all_gather(whole, whole[me * n:(me + 1) * n])
        if not torch.equal(whole, torch.cat([x[:n] for x in ins])):
            raise AssertionError(f"in-place all_gather in a shared buffer, n={n}: got {whole[:4].tolist()}")
    if g.backend == "shm" and P > 1:
        x = g.empty_shared(1 << 18)
        try:
            g.all_reduce(x if me == 0 else torch.zeros(1 << 18))
        except pt.MismatchError as e:
            if "shared buffer" not in str(e):
                raise
        else:
            raise AssertionError("a shared tensor on rank 0 and private ones elsewhere went unnoticed")
    else:
        g.barrier()
    print(f"shared-buffer checks passed on {g.backend}")


if __name__ == "__main__":
    main()
