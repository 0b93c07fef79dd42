"""How fast are paratrain's shared-memory collectives beside Gloo and Open MPI?

    python benchmarks/collectives.py [-n 2] [--quick] [--hierarchical] ...

The same as `paratrain bench collectives`; the benchmark lives in
paratrain/bench/ so the CLI and this script run one implementation.
Writes benchmarks/results/collectives.json and collectives.png.
"""
import sys

from paratrain.bench.collectives import main

if __name__ == "__main__":
    sys.exit(main())
