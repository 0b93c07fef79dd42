"""The parameter server beside all-reduce, and BSP beside ASP and SSP under slow workers.

    python benchmarks/parameter_server.py [--tables 1,2,3] [--quick]

The same as `paratrain bench parameter-server`; the benchmark lives in
paratrain/bench/ so the CLI and this script run one implementation.
Writes benchmarks/results/parameter_server.json and parameter_server.png.
"""
import sys

from paratrain.bench.parameter_server import main

if __name__ == "__main__":
    sys.exit(main())
