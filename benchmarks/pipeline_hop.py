"""What an isend copied in by its caller gives two pipeline stages that compute, against one on a lane thread.

Two ranks on this host (shared memory) pass gpt's micro-batch bundle between
them as two pipeline stages do (parallel/pipeline/transport.py: a header and
a 128 KiB tensor forward, the gradient back), each computing ``C`` ms between
(a loop of small matrix products, holding the GIL between them as a model's
forward does):

    rank 0: isend activations, compute C, receive the gradient
    rank 1: receive the activations, compute C, isend the gradient

A cycle takes C plus the two hops, so the hop is (cycle - C) / 2. Variants,
alternated round by round in the same two processes:

- ``caller``: the shm engine as it is: an isend that fits the channel's free
  frames is copied in on the calling thread (comm/shm/group.py _post_send).
- ``lane``: the generic path every isend took before: the copy queued on the
  peer's send lane, a helper thread that must win this process's GIL from the
  computing main thread.

    python benchmarks/pipeline_hop.py [--compute-ms 0,2,5] [--rounds 5]

Prints the median hop per variant and compute, and their ratio; writes
benchmarks/results/pipeline_hop.json.
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BUNDLE_BYTES = 131072   # gpt's micro-batch of 4 samples: 4 x 64 tokens x 128 x 4 bytes
CYCLES = 60


def _compute(a, seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def worker(compute_ms, rounds, out):
    import torch

    import paratrain as pt
    from paratrain.comm.group import ProcessGroup
    from paratrain.simulate.stage_send import exchange_times
    torch.set_num_threads(1)
    g = pt.init(backend="shm")
    values, a = (torch.randn(BUNDLE_BYTES // 4),), torch.randn(96, 96)
    engine = g._post_send
    variants = {"caller": engine, "lane": functools.partial(ProcessGroup._post_send, g)}
    hops = {(v, c): [] for v in variants for c in compute_ms}
    for r in range(rounds):
        for c in compute_ms:
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for v in order:
                g._post_send = variants[v]
                compute = functools.partial(_compute, a, c / 1e3)
                exchange_times(g, values, 10, compute)   # warm-up
                cycle = statistics.median(exchange_times(g, values, CYCLES, compute))
                hops[(v, c)].append((cycle - c / 1e3) / 2)
    g._post_send = engine
    if g.rank == 0:
        rows = [{"variant": v, "compute_ms": c, "hop_us": [h * 1e6 for h in hops[(v, c)]]} for (v, c) in hops]
        Path(out).write_text(json.dumps({"bundle_bytes": BUNDLE_BYTES, "cycles": CYCLES, "rows": rows}, indent=1))
    pt.destroy()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute-ms", default="0,2,5", help="compute between the messages, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/pipeline_hop.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    compute_ms = [float(x) for x in args.compute_ms.split(",")]
    if args.worker:
        return worker(compute_ms, args.rounds, args.out)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    cmd = [sys.executable, "-m", "paratrain.run", "-n", "2", __file__, "--worker", "--compute-ms", args.compute_ms,
           "--rounds", str(args.rounds), "--out", args.out]
    subprocess.run(cmd, check=True, timeout=600)
    rows = json.loads(Path(args.out).read_text())["rows"]
    hop = {(r["variant"], r["compute_ms"]): statistics.median(r["hop_us"]) for r in rows}
    print(f"{'compute between':>16} {'caller hop':>11} {'lane hop':>9} {'lane / caller':>14}")
    for c in compute_ms:
        print(f"{c:>13g} ms {hop[('caller', c)]:>8.0f} us {hop[('lane', c)]:>6.0f} us "
              f"{hop[('lane', c)] / hop[('caller', c)]:>13.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
