"""How fast is paratrain's pipeline beside one process and torch.distributed.pipelining?

    python benchmarks/pipeline.py [--rounds 5] [--engines ...] [--quick]

The same as `paratrain bench pipeline`; the benchmark lives in paratrain/bench/
so the CLI and this script run one implementation. Writes
benchmarks/results/pipeline.json and pipeline.png.
"""
import sys

from paratrain.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
