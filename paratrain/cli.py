"""The ``paratrain`` command: one entry point, a subcommand per job.

    paratrain run -n 4 script.py args...     start workers (paratrain.launch)
    paratrain bench collectives -n 2         collective benchmark beside Gloo and MPI
"""
import sys

USAGE = """usage: paratrain <command> [args]

commands:
  run      start N worker processes running a script (like torchrun)
  bench    benchmarks: `paratrain bench collectives -n 2`

`paratrain <command> --help` for a command's options."""


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        from .launch.local import main as run_main
        return run_main(rest)
    if cmd == "bench":
        if not rest or rest[0] != "collectives":
            print("usage: paratrain bench collectives [options]   (the only benchmark so far)", file=sys.stderr)
            return 2
        from .bench.collectives import main as bench_main
        return bench_main(rest[1:])
    print(f"paratrain: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
