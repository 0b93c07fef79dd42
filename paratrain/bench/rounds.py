"""The benchmarks' timing loop: every engine in this process, interleaved round by round.

Each engine is an object with ``name``, ``step(x, y)`` (one training step)
and ``barrier()``. After ``warmup`` untimed steps each, every round times
``steps`` steps of every engine, in an order that rotates by one each round
(so no engine always runs first, on a cooler or a warmer machine), each after
its own barrier. A round lasts as long as its slowest rank: the times are
all-reduced by max, so every rank returns the same lists.
"""
import sys
import time

import torch


def interleaved(engines, cfg, group, x, y, before=None, after=None):
    """{engine name: [seconds per step, one per round]}; ``before(e)`` and ``after(e)``
    run around each engine's timed steps (outside the time)."""
    for e in engines:
        for _ in range(cfg["warmup"]):
            e.step(x, y)
    times = {e.name: [] for e in engines}
    for r in range(cfg["rounds"]):
        k = r % len(engines)
        for e in engines[k:] + engines[:k]:
            if before:
                before(e)
            e.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                e.step(x, y)
            times[e.name].append((time.perf_counter() - t0) / cfg["steps"])
            if after:
                after(e)
        if group.rank == 0:
            print(f"[bench] round {r + 1}/{cfg['rounds']} done", file=sys.stderr, flush=True)
    flat = torch.tensor([t for e in engines for t in times[e.name]], dtype=torch.float64)
    group.all_reduce(flat, op="max")
    per = flat.view(len(engines), -1).tolist()
    return {e.name: per[i] for i, e in enumerate(engines)}
