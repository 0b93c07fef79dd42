"""How often does a finished torch.distributed job die at exit, under paratrain run and under torchrun?

    python benchmarks/exit_aborts.py [--runs 300] [--jobs 2] [--cases run,torchrun,train]

A plain DDP script (Gloo, nn.Linear(10, 1), 5 steps, an all_gather,
destroy_process_group) run with 2 workers by ``paratrain run`` and by
``torchrun``, and ``paratrain train --backend torch --steps 5``, interleaved
round by round so every case meets the same machine. A run counts as an
abort when a worker died of SIGABRT or printed "terminate called" (Gloo's
worker thread ended mid-destructor by the interpreter's teardown:
docs/exit-abort.md); any other failure is counted apart. ``--jobs`` runs that
many rounds at once, which is the load of a test suite on 2 cores.

Prints a table and writes benchmarks/results/exit_aborts.json after every
round, so a run stopped early still leaves its counts.
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = os.path.join(HERE, "results", "exit_aborts.json")
BIN = os.path.dirname(sys.executable)

DDP_SCRIPT = """\
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(nn.Linear(10, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad(); model(torch.randn(8, 10)).sum().backward(); opt.step()
out = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(out, torch.ones(1) * dist.get_rank())
print("result", [t.item() for t in out])
dist.destroy_process_group()
"""


def commands(workdir):
    script = os.path.join(workdir, "ddp_script.py")
    with open(script, "w") as f:
        f.write(DDP_SCRIPT)
    return {
        "run": [os.path.join(BIN, "paratrain"), "run", "-n", "2", script],
        "torchrun": [os.path.join(BIN, "torchrun"), "--nproc-per-node", "2", script],
        "train": [os.path.join(BIN, "paratrain"), "train", "--backend", "torch", "--steps", "5",
                  "--runs", os.path.join(workdir, "runs")],
    }


def outcome(cmd):
    """'ok', 'abort' or 'failed' for one run of cmd (3 minutes at most)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        return "failed", "timed out after 180 s"
    text = p.stdout + p.stderr
    if "terminate called" in text or "SIGABRT" in text or "Signals.SIGABRT" in text:
        return "abort", text[-400:]
    if p.returncode != 0:
        return "failed", text[-400:]
    return "ok", ""


def table(counts):
    lines = [f"{'case':<10} {'runs':>5} {'ok':>5} {'aborts':>7} {'other':>6} {'abort rate':>11}"]
    for name, c in counts.items():
        n = sum(c.values())
        rate = c["abort"] / n if n else 0.0
        lines.append(f"{name:<10} {n:>5} {c['ok']:>5} {c['abort']:>7} {c['failed']:>6} {rate:>10.1%}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=300, help="runs of each case (default 300)")
    p.add_argument("--jobs", type=int, default=2, help="rounds at once (default 2: a suite's load)")
    p.add_argument("--cases", default="run,torchrun,train", help="which of run,torchrun,train")
    p.add_argument("--out", default=RESULT, help=f"the JSON to write (default {RESULT})")
    args = p.parse_args(argv)
    names = args.cases.split(",")
    with tempfile.TemporaryDirectory() as workdir:
        cmds = commands(workdir)
        unknown = set(names) - set(cmds)
        if unknown:
            p.error(f"unknown case(s) {sorted(unknown)}; choose from {sorted(cmds)}")
        counts = {n: {"ok": 0, "abort": 0, "failed": 0} for n in names}
        examples = {n: [] for n in names}
        started = time.time()

        def one_round(_):
            return [(n, *outcome(cmds[n])) for n in names]

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for i, results in enumerate(pool.map(one_round, range(args.runs)), 1):
                for name, result, tail in results:
                    counts[name][result] += 1
                    if result != "ok" and len(examples[name]) < 3:
                        examples[name].append(tail)
                save(args.out, counts, examples, args, started, i)
                if i % 10 == 0 or i == args.runs:
                    print(f"round {i}/{args.runs}  " + "  ".join(
                        f"{n}: {c['abort']} aborts, {c['failed']} other" for n, c in counts.items()), flush=True)
    print(table(counts))
    print(f"wrote {args.out}")
    return 0


def save(path, counts, examples, args, started, rounds):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rounds_done": rounds, "runs_asked": args.runs, "jobs": args.jobs,
                   "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
                   "seconds": round(time.time() - started, 1), "counts": counts,
                   "failure_tails": examples}, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
