"""Worker: what a job started by `paratrain run --link RATE --nnodes N` finds itself in."""
import os
import subprocess
import sys

import torch

import paratrain as pt


def main():
    g = pt.init()
    from paratrain.launch.link import tool
    qdisc = subprocess.run([tool("tc"), "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    t = torch.full((100_000,), float(g.rank + 1))
    g.all_reduce(t)
    ok = bool((t == g.world_size * (g.world_size + 1) / 2).all())
    print(f"link: rank {g.rank} of {g.world_size}, backend {g.backend}, pretend hosts "
          f"{os.environ.get('PARATRAIN_PRETEND_HOSTS')}, all_reduce {'right' if ok else 'WRONG'}, "
          f"lo: {' '.join(qdisc.split()[:9])}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
