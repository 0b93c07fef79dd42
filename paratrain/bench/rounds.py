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

from .gloo_group import release_ddp


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


def serve_gpt(cfg_path, make_engines, report, split_batch=False, after=None):
    """A GPT benchmark worker's whole life (pipeline_, tensor_ and zero_worker.py): one
    thread, the shm group, ``make_engines(cfg, group)``, one token batch (seeded
    alike on every rank; ``split_batch``: each rank its slice, as data parallelism
    reads), the interleaved rounds, then ``report(engines, cfg, x, y)`` (called on every
    rank: it may be collective) written by rank 0 to ``cfg["result"]``; torch's
    engines and Gloo group are released last."""
    import json

    import paratrain as pt

    cfg = json.loads(open(cfg_path).read())
    torch.set_num_threads(1)
    group = pt.init(backend="shm")
    engines = make_engines(cfg, group)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (cfg["batch"], cfg["context"]), generator=gen)
    y = torch.randint(0, 256, (cfg["batch"], cfg["context"]), generator=gen)
    if split_batch:
        per = cfg["batch"] // group.world_size
        x, y = x[group.rank * per:(group.rank + 1) * per], y[group.rank * per:(group.rank + 1) * per]
    times = interleaved(engines, cfg, group, x, y, after=after)
    result = dict(times=times, **report(engines, cfg, x, y))
    if group.rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(result, f)
    group.barrier()
    pt.destroy()
    release_ddp(engines)   # in the order that neither hangs nor aborts (gloo_group.py)
