"""Why paratrain's shm engine copies with a ufunc instead of memcpy.

1. Copies a 32 MiB private buffer out of a small reused shared-memory window, in
   chunks of 32 KiB to 4 MiB (what a pipelined collective does each round), with
   numpy assignment (glibc memcpy) and with ``np.positive`` over uint8 views
   (paratrain.comm.ops.copy).
2. One-shot copies of 1 to 32 MiB between private buffers that are not in cache
   (a 64 MiB copy elsewhere runs before each), as cma.all_gather copies its own
   input (paratrain.comm.ops.copy_vectorised), and the same with both in cache.

Both in the same run, alternated; prints GB/s and the ratio. Writes
benchmarks/results/memcpy.json.
"""
import json
import mmap
import time
from pathlib import Path

import numpy as np


def _rate(fn, nbytes, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times)) / 1e9


def _one_shot(reps=21):
    """Whole-buffer copies, cold (after flushing the caches with a 64 MiB copy) and hot."""
    big, big2 = np.ones(64 << 20, dtype=np.uint8), np.zeros(64 << 20, dtype=np.uint8)
    rows = []
    print(f"\n{'one shot':>8} {'caches':>6} {'memcpy GB/s':>12} {'ufunc GB/s':>11} {'ratio':>6}")
    for nbytes in (1 << 20, 8 << 20, 32 << 20):
        src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
        for cold in (True, False):
            times = {"memcpy": [], "ufunc": []}
            for _ in range(reps):
                for name in times:
                    if cold:
                        big2[...] = big
                    else:
                        dst[...] = src
                    t = time.perf_counter()
                    if name == "memcpy":
                        dst[...] = src
                    else:
                        np.positive(src, out=dst)
                    times[name].append(time.perf_counter() - t)
            a, u = (nbytes / float(np.median(times[k])) / 1e9 for k in ("memcpy", "ufunc"))
            state = "cold" if cold else "hot"
            rows.append({"one_shot_bytes": nbytes, "caches": state, "memcpy_gbs": a, "ufunc_gbs": u})
            print(f"{nbytes >> 20:>7}M {state:>6} {a:12.2f} {u:11.2f} {u / a:5.2f}x")
    return rows


def main():
    window = mmap.mmap(-1, 16 << 20)
    shared = np.frombuffer(window, dtype=np.uint8)
    shared[:] = 1
    private = np.ones(32 << 20, dtype=np.uint8)
    rows = []
    print(f"{'chunk':>8} {'memcpy GB/s':>12} {'ufunc GB/s':>11} {'ratio':>6}")
    for chunk in (32 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20):
        spots = [((lo // chunk) % 3) * chunk for lo in range(0, private.size, chunk)]

        def assign():
            for i, lo in enumerate(range(0, private.size, chunk)):
                private[lo:lo + chunk] = shared[spots[i]:spots[i] + chunk]

        def ufunc():
            for i, lo in enumerate(range(0, private.size, chunk)):
                np.positive(shared[spots[i]:spots[i] + chunk], out=private[lo:lo + chunk])

        a, u = _rate(assign, private.size), _rate(ufunc, private.size)
        rows.append({"chunk_bytes": chunk, "memcpy_gbs": a, "ufunc_gbs": u})
        print(f"{chunk >> 10:>7}K {a:12.2f} {u:11.2f} {u / a:5.2f}x")
    rows += _one_shot()
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "memcpy.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {out / 'memcpy.json'}")


if __name__ == "__main__":
    main()
