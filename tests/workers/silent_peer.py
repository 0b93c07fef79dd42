"""Worker: irecvs posted together from a peer that stays alive and never sends.

Each must fail with a CommTimeout about PARATRAIN_TIMEOUT after it was posted,
all of them, not the k-th after k timeouts (each receive's deadline once
started when the one before it on its peer's lane gave up). Rank 0 receives,
rank 1 stays silent for the whole test, any other rank idles.
"""
import os
import sys
import time

import numpy as np

import paratrain as pt


def main():
    g = pt.init(backend=sys.argv[1])
    timeout = float(os.environ["PARATRAIN_TIMEOUT"])
    if g.rank == 0:
        posted = time.monotonic()
        works = [g.irecv(np.zeros(10, np.float32), 1, tag=t) for t in range(4)]
        for t, w in enumerate(works):
            try:
                w.wait()
                raise AssertionError(f"irecv tag {t} from a silent peer completed")
            except pt.CommTimeout as e:
                assert "rank 1" in str(e), e
        took = time.monotonic() - posted
        assert took < 2 * timeout, f"4 pending irecvs took {took:.1f}s to time out with a {timeout:g}s timeout"
        print(f"silent peer checks passed: 4 receives timed out in {took:.1f}s", flush=True)
    elif g.rank == 1:
        time.sleep(3 * timeout)   # alive, silent
    pt.destroy()


if __name__ == "__main__":
    main()
