"""Worker: pt.init() again after pt.destroy(), three times, while the groups of
the earlier rounds are still referenced (a script that keeps its old ``g``).

Each round builds the world and a sub-group, checks an all_reduce on both
against the sum the ranks' values make, and destroys them; rank 0 destroys
late in one round and early in another, so the ranks re-init out of step.
Every old group must refuse calls (destroyed), and the new ones must not see
anything of the old rounds (keys of the rendezvous, shared-memory segments).
"""
import sys
import time

import numpy as np

import paratrain as pt


def main():
    backend = sys.argv[1]
    kept = []
    for round_ in range(3):
        g = pt.init(backend=backend)
        assert g.backend == backend, f"round {round_}: asked for {backend}, got {g.backend}"
        me, P = g.rank, g.world_size
        members = sorted({0, P - 1})
        sub = pt.new_group(members)
        x = np.full(1000, me + 10 * round_, np.float32)
        g.all_reduce(x)
        want = sum(r + 10 * round_ for r in range(P))
        assert np.all(x == want), f"round {round_}: world all_reduce gave {x[:3]}, want {want}"
        if sub is not None:
            y = np.full(7, me + 1, np.float64)
            sub.all_reduce(y)
            want = sum(m + 1 for m in members)
            assert np.all(y == want), f"round {round_}: sub-group all_reduce gave {y[:3]}, want {want}"
        g.barrier()
        if me == 0:
            time.sleep(0.5 if round_ == 0 else 0.0)   # the others re-init while rank 0 still serves round 0
        elif round_ == 1:
            time.sleep(0.5)                           # rank 0 re-inits first
        pt.destroy()
        kept += [g, sub]
    for old in kept:
        if old is None:
            continue
        try:
            old.all_reduce(np.ones(2, np.float32))
            raise AssertionError(f"{old!r} from an earlier round took a call after pt.destroy()")
        except pt.CommError as e:
            assert "destroyed" in str(e), e
    print(f"rank {me}: re-init checks passed on {backend}", flush=True)


if __name__ == "__main__":
    main()
