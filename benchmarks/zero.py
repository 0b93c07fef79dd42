"""How fast is paratrain's ZeRO beside DataParallel and torch's ZeRO?

    python benchmarks/zero.py [--rounds 5] [--quick]

The same as `paratrain bench zero`; the benchmark lives in paratrain/bench/
so the CLI and this script run one implementation. Writes
benchmarks/results/zero.json and zero.png.
"""
import sys

from paratrain.bench.zero import main

if __name__ == "__main__":
    sys.exit(main())
