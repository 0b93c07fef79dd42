"""How fast is paratrain's tensor parallelism beside one process and torch's own?

    python benchmarks/tensor.py [--rounds 5] [--sizes 2,4] [--quick]

The same as `paratrain bench tensor`; the benchmark lives in paratrain/bench/
so the CLI and this script run one implementation. Writes
benchmarks/results/tensor.json and tensor.png.
"""
import sys

from paratrain.bench.tensor import main

if __name__ == "__main__":
    sys.exit(main())
