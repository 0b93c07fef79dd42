"""How fast is paratrain's DataParallel beside PyTorch's DistributedDataParallel (Gloo)?

    python benchmarks/data_parallel.py [--models small,large] [--workers 1,2,4] [--quick]

The same as `paratrain bench data-parallel`; the benchmark lives in
paratrain/bench/ so the CLI and this script run one implementation.
Writes benchmarks/results/data_parallel.json and data_parallel.png.
"""
import sys

from paratrain.bench.data_parallel import main

if __name__ == "__main__":
    sys.exit(main())
