"""Why paratrain's workers step torch's fused optimizers.

    python benchmarks/optimizer.py [--steps 200] [--model gpt]

1. torch's Adam and SGD (momentum 0.9) over every parameter of a built-in
   model, one thread, as torch runs them by default (a chain of foreach
   operations) and fused (``fused=True``, what paratrain/train/optimizer.py
   asks for), with dense gradients and with gradients as top-k leaves them
   (1% of the entries non-zero, a fresh 1% each step: what error feedback
   selects moves from step to step). Each optimizer starts fresh and steps
   ``--steps`` times; the steps' median, and the medians of their first and
   last fifths (Adam's second moment fills in as entries get selected).
2. Why: torch.sqrt over 1 M floats with a share of exact zeros, beside
   numpy.sqrt. Adam's default chain takes the square root of its second
   moment, which stays exactly zero at every entry no gradient has reached.

Both kernels of a kind run in the same process, alternated. Prints tables
with the ratio, writes benchmarks/results/optimizer.json.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from paratrain.simulate.timing import task_of

SPARSE_SHARE = 0.01   # paratrain train --compression topk's default ratio


def _steps(start, cls, hyper, sparse, steps, seed=0):
    params = [torch.nn.Parameter(p.detach().clone()) for p in start]
    optimizer = cls(params, **hyper)
    generator = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=generator) * 1e-3
            if sparse:
                grad *= torch.rand(p.shape, generator=generator) < SPARSE_SHARE
            p.grad = grad
        t0 = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return times, params


def optimizers(model, steps):
    start = list(task_of(model).model.parameters())
    rows = []
    print(f"{'optimizer':>9} {'gradients':>9} {'default ms':>10} {'fused ms':>9} {'ratio':>6} "
          f"{'first fifth':>16} {'last fifth':>16} {'largest difference':>19}")
    for name, cls, hyper in (("adam", torch.optim.Adam, {"lr": 1e-3}),
                             ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        for sparse in (False, True):
            default, a = _steps(start, cls, hyper, sparse, steps)
            fused, b = _steps(start, cls, dict(hyper, fused=True), sparse, steps)
            fifth = max(1, steps // 5)
            row = {"optimizer": name, "gradients": "top-k" if sparse else "dense", "steps": steps,
                   "default_ms": statistics.median(default) * 1e3, "fused_ms": statistics.median(fused) * 1e3,
                   "first_fifth_ms": [statistics.median(t[:fifth]) * 1e3 for t in (default, fused)],
                   "last_fifth_ms": [statistics.median(t[-fifth:]) * 1e3 for t in (default, fused)],
                   "largest_difference": max(float((p - q).detach().abs().max()) for p, q in zip(a, b))}
            rows.append(row)
            print(f"{name:>9} {row['gradients']:>9} {row['default_ms']:10.2f} {row['fused_ms']:9.2f} "
                  f"{row['default_ms'] / row['fused_ms']:5.2f}x "
                  f"{'%.2f / %.2f' % tuple(row['first_fifth_ms']):>16} {'%.2f / %.2f' % tuple(row['last_fifth_ms']):>16} "
                  f"{row['largest_difference']:19.3g}")
    return rows


def square_roots(n=1 << 20, reps=100):
    out = torch.empty(n)
    rows = []
    print(f"\n{'zero share':>10} {'torch.sqrt us':>13} {'numpy.sqrt us':>13} {'ratio':>6}")
    for share in (0.0, 0.01, 0.1, 0.5, 0.99, 1.0):
        x = torch.rand(n) * 1e-6 * (torch.rand(n) >= share)
        times = {"torch": [], "numpy": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.sqrt(x, out=out)
            t1 = time.perf_counter()
            np.sqrt(x.numpy(), out=out.numpy())
            times["torch"].append(t1 - t0)
            times["numpy"].append(time.perf_counter() - t1)
        t, u = (statistics.median(times[k]) * 1e6 for k in ("torch", "numpy"))
        rows.append({"zero_share": share, "torch_us": t, "numpy_us": u})
        print(f"{share:10.2f} {t:13.0f} {u:13.0f} {t / u:5.2f}x")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"model": args.model, "date": time.strftime("%Y-%m-%d %H:%M"),
              "optimizers": optimizers(args.model, args.steps), "square_roots": square_roots()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
