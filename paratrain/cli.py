"""The ``paratrain`` command: one entry point, a subcommand per job.

    paratrain train                          the main job: a built-in model on 2 local workers, with any
                                             strategy: data parallel (allreduce, allreduce-naive), parameter
                                             server (ps: BSP/ASP/SSP), pipeline (GPipe, 1F1B, interleaved,
                                             ZB-H1), tensor and 3D parallel (--tp, --dp, --pp), ZeRO 1-3
                                             (zero), gradient compression (--compression)
    paratrain run -n 4 script.py args...     start workers running your script (like torchrun)
    paratrain trace runs/<id>                where each rank's step time went, stragglers, who was late
    paratrain server --servers 2             parameter servers on this host for a multi-node job
    paratrain compare --model gpt --workers 2   every strategy trained for the same budget, side by side
    paratrain simulate --cluster C.toml --workload W.toml --workers 8,64,512   a step predicted (cost model)
    paratrain plan --model gpt --workers 4   the layouts the workers allow, predicted and ranked
    paratrain bench collectives -n 2         collectives beside Gloo and Open MPI
    paratrain bench data-parallel            DataParallel beside PyTorch DDP
    paratrain bench parameter-server         the parameter server beside all-reduce, BSP beside ASP/SSP
    paratrain bench pipeline                 pipeline schedules beside torch.distributed.pipelining
    paratrain bench tensor                   tensor parallelism beside torch's parallelize_module
    paratrain bench zero                     pt.ZeRO beside DataParallel, ZeroRedundancyOptimizer and FSDP2
    paratrain bench compression              gradient compression beside DDP's, over a slow link
    paratrain bench trace                    what --trace costs, and how well the ranks' clocks line up
"""
import importlib
import sys

USAGE = """usage: paratrain <command> [args]

commands:
  train    train a built-in model (default: digits on 2 workers) with any strategy:
           data parallelism (--strategy allreduce, allreduce-naive), parameter servers
           (--strategy ps: BSP, ASP, SSP), pipeline parallelism (--strategy pipeline or --pp:
           GPipe, 1F1B, interleaved, ZB-H1), tensor and 3D parallelism (--tp, --dp, --pp),
           ZeRO stages 1-3 (--strategy zero), gradient compression (--compression)
  run      start N worker processes running your script (like torchrun), with parameter
           servers if asked (`paratrain run -n 2 --servers 1 script.py`)
  trace    where each rank's time went in a traced run (`paratrain train --trace`,
           `paratrain run --trace DIR`): compute, waiting, communication, idle, stragglers
  server   run parameter servers on this host for workers on other machines
           (`paratrain server --servers 2 --port 29600`, then `paratrain run --ps-addrs ...`)
  compare  train one model under every strategy for the same budget and compare them
           (`paratrain compare --model gpt --workers 2`): runs/compare-<id>/compare.md, .json, .png
  simulate a training step predicted by a cost model for a cluster and a workload, at any
           worker count (`paratrain simulate --cluster C.toml --workload W.toml --workers 8,64,512`)
  plan     the layouts N workers allow for a model (dp x pp x tp, ZeRO, compression),
           predicted, ranked, each with its command (`paratrain plan --model gpt --workers 4`)
  bench    benchmarks beside PyTorch, Gloo and Open MPI: `paratrain bench collectives -n 2`,
           `paratrain bench data-parallel`, `paratrain bench parameter-server`,
           `paratrain bench pipeline`, `paratrain bench tensor`, `paratrain bench zero`,
           `paratrain bench compression`, `paratrain bench trace`

`paratrain <command> --help` for a command's options."""


# each command's module (imported only when it runs: `paratrain run` must not wait for what `train` needs)
COMMANDS = {"train": "train.job", "run": "launch.local", "trace": "trace.command", "server": "launch.serve",
            "compare": "compare.command", "plan": "simulate.plan_command", "simulate": "simulate.command"}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in COMMANDS:
        return importlib.import_module(f".{COMMANDS[cmd]}", __package__).main(rest)
    if cmd == "bench":
        benches = {"collectives": "collectives", "data-parallel": "data_parallel", "parameter-server": "parameter_server",
                   "pipeline": "pipeline", "tensor": "tensor", "zero": "zero",
                   "compression": "compression", "trace": "trace", "elastic": "elastic"}
        if not rest or rest[0] not in benches:
            print(f"usage: paratrain bench {{{','.join(benches)}}} [options]", file=sys.stderr)
            return 2
        return importlib.import_module(f".bench.{benches[rest[0]]}", __package__).main(rest[1:])
    print(f"paratrain: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def console():
    """The ``paratrain`` command: main(), then the process ends as a launched worker's
    does (launch/bootstrap.py's finish: threads joined, atexit handlers run, streams
    flushed, then os._exit), without the interpreter tearing torch down, which takes
    about a second after the last line is printed and shows nothing."""
    from .launch import bootstrap
    try:
        status = bootstrap.exit_code(main())   # main's return, as sys.exit takes it
    except SystemExit as e:
        status = bootstrap.exit_code(e.code)
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter reports it
        status = bootstrap.report(e)   # (a Ctrl-C: death by SIGINT, as Python's)
    bootstrap.finish(status)


if __name__ == "__main__":
    console()
