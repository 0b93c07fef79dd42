"""When does gradient compression pay, beside DDP, over a slow link?

    python benchmarks/compression.py [--links 1gbit,10gbit,unlimited] [--quick]

The same as `paratrain.bench.compression`; the benchmark lives in paratrain/bench/
so the CLI and this script run one implementation. Writes
benchmarks/results/compression.json and compression.png.
"""
import sys

from paratrain.bench.compression import main

if __name__ == "__main__":
    sys.exit(main())
