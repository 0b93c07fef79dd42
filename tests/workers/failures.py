"""Worker: scenarios where ranks misbehave. Prints what each rank caught.

    mismatch_shape  rank 1 all-reduces a longer tensor
    mismatch_dtype  rank 1 all-reduces float64 while the others float32
    mismatch_op     rank 1 uses op=max while the others sum
    mismatch_coll   rank 1 calls all_gather while the others all_reduce
    die             rank 1 kills itself (SIGKILL) just before an all_reduce
    die_mid         all ranks all-reduce 4 MiB in a loop; rank 1 is killed (SIGKILL,
                    from a timer thread) while inside one
    hang            rank 1 never calls the all_reduce (sleeps)
    late            rank 1 calls the all_reduce 2 s late; the others report the CPU
                    time they spent waiting in it (a blocking wait, not a spin)
    loop            all ranks all-reduce 1 MiB forever (stopped from outside)
"""
import os
import signal
import sys
import threading
import time

import numpy as np

import paratrain as pt


def main():
    scenario = sys.argv[1]
    g = pt.init()
    me = g.rank
    g.barrier()
    x = np.ones(1000, dtype=np.float32)
    try:
        if scenario == "mismatch_shape":
            g.all_reduce(np.ones(2000 if me == 1 else 1000, dtype=np.float32))
        elif scenario == "mismatch_dtype":
            g.all_reduce(np.ones(1000, dtype=np.float64 if me == 1 else np.float32))
        elif scenario == "mismatch_op":
            g.all_reduce(x, op="max" if me == 1 else "sum")
        elif scenario == "mismatch_coll":
            if me == 1:
                g.all_gather(np.zeros(1000 * g.world_size, dtype=np.float32), x)
            else:
                g.all_reduce(x)
        elif scenario == "die":
            if me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            t = time.time()
            g.all_reduce(np.ones(1 << 20, dtype=np.float32))
        elif scenario == "die_mid":
            big = np.ones(1 << 20, dtype=np.float32)
            g.all_reduce(big)
            print(f"rank {me}: looping", flush=True)
            if me == 1:
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
            t = time.time()
            while time.time() - t < 60:   # bounded, so a survivor that never notices still ends
                g.all_reduce(big, op="max")
        elif scenario == "loop":
            big = np.ones(1 << 18, dtype=np.float32)
            print(f"rank {me}: looping", flush=True)
            while True:
                g.all_reduce(big, op="max")
        elif scenario == "late":
            if me == 1:
                time.sleep(2.0)
            wall, cpu = time.perf_counter(), time.process_time()
            g.all_reduce(x)
            print(f"rank {me}: waited {time.perf_counter() - wall:.2f} s wall, "
                  f"{time.process_time() - cpu:.2f} s cpu", flush=True)
        elif scenario == "hang":
            if me == 1:
                time.sleep(60)
                return 0
            g.all_reduce(x)
        print(f"rank {me}: no error", flush=True)
        return 0
    except pt.CommError as e:
        print(f"rank {me}: caught {type(e).__name__}: {e}", flush=True)
        if scenario in ("die", "die_mid"):
            print(f"rank {me}: raised after {time.time() - t:.1f}s", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
