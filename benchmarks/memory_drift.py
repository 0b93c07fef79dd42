"""Is this machine in its fast or its slow state for work shared between cores?

    paratrain run -n 2 benchmarks/memory_drift.py [--seconds 20] [--mb 84] [--out FILE]

The same shm all_reduce of one buffer (84 MB: the 21M-parameter MLP's
gradients), repeated for ``--seconds`` seconds, reported as the median of
every second. On small virtual machines it can run fast for a while, then
flip to a much slower state and stay there, in the same process on the same
buffer. Only work that reads what another core just wrote slows down this
much, which points at where the host places the virtual CPUs, outside
anything a process can choose. Run it before and after a benchmark round to know which
state the numbers came from; ``paratrain bench data-parallel``'s ratio to
DDP follows it (docs/benchmarks.md).

Beside it, each second's median time for every rank to copy its own buffer
into private memory at the same time: traffic that no other core wrote.

Writes ``{"all_reduce_ms_per_second": [...], "own_copy_ms_per_second": [...]}``
to --out (rank 0).
"""
import argparse
import json
import statistics
import time

import torch

import paratrain as pt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--mb", type=float, default=84.0, help="buffer size in MB (default 84)")
    p.add_argument("--out", default=None, help="JSON file to write (rank 0)")
    args = p.parse_args()
    g = pt.init(backend="shm")
    buf = g.empty_shared(int(args.mb * 1e6) // 4, torch.float32)
    buf.fill_(1.0)
    mine = torch.empty_like(buf)
    done = torch.zeros(1)
    per_second, copies = [], []
    for _ in range(args.seconds):
        times, copy_times, end = [], [], time.perf_counter() + 1.0
        while True:
            g.barrier()
            t0 = time.perf_counter()
            g.all_reduce(buf, op="avg")
            times.append(time.perf_counter() - t0)
            g.barrier()
            t0 = time.perf_counter()
            mine.copy_(buf)   # this core's memory traffic alone: both ranks copy their own buffer
            copy_times.append(time.perf_counter() - t0)
            done[0] = float(time.perf_counter() > end)
            g.all_reduce(done, op="max")   # every rank leaves the second together
            if done.item():
                break
        per_second.append(round(statistics.median(times) * 1e3, 2))
        copies.append(round(statistics.median(copy_times) * 1e3, 2))
    if g.rank == 0:
        print(f"all_reduce of {args.mb:g} MB, ms, median of each second: {per_second}")
        print(f"each rank copying its own {args.mb:g} MB at once, ms:     {copies}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"all_reduce_ms_per_second": per_second, "own_copy_ms_per_second": copies,
                           "mb": args.mb, "world_size": g.world_size}, f)
    pt.destroy()


if __name__ == "__main__":
    main()
