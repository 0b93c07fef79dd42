"""How long does a short job take to start and end: workers started fresh, forked from a fork server, or by torchrun?

    python benchmarks/worker_start.py [--rounds 10] [--workers 2,4]

The job: each worker imports torch, builds an nn.Linear and its SGD optimizer
(which imports torch._dynamo), joins a Gloo group, all-reduces one tensor and
ends: what every training script does before its first step. Three ways, one
after another in every round so all meet the same machine: ``paratrain run``
(fresh interpreters), ``paratrain run`` with ``PARATRAIN_FORKSERVER`` (forks of
a server that imported torch and torch._dynamo once, started before the
rounds), and ``torchrun``. The time is the whole command's wall clock, launcher
included.

Prints a table (median, min and max seconds; each against torchrun) and
writes benchmarks/results/worker_start.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = os.path.join(HERE, "results", "worker_start.json")
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.dirname(HERE))

SCRIPT = """\
import torch, torch.distributed as dist
model = torch.nn.Linear(10, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def commands(script, n):
    return {
        "fresh": [os.path.join(BIN, "paratrain"), "run", "-n", str(n), script],
        "forked": [os.path.join(BIN, "paratrain"), "run", "-n", str(n), script],
        "torchrun": [os.path.join(BIN, "torchrun"), "--nproc-per-node", str(n), script],
    }


def timed(cmd, env):
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
    took = time.perf_counter() - start
    if p.returncode != 0 or "note" in p.stderr:
        raise SystemExit(f"{' '.join(cmd)} failed or did not fork:\n{p.stdout}{p.stderr}")
    return took


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--workers", default="2,4", help="comma list of worker counts (default 2,4)")
    p.add_argument("--out", default=RESULT)
    args = p.parse_args(argv)
    from paratrain.launch.forkserver import start_server
    with tempfile.TemporaryDirectory() as workdir:
        script = os.path.join(workdir, "job.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        address = os.path.join(workdir, "fork.sock")
        server = start_server(address)
        base = {k: v for k, v in os.environ.items() if k != "PARATRAIN_FORKSERVER"}
        envs = {"fresh": dict(base), "forked": dict(base, PARATRAIN_FORKSERVER=address),
                "torchrun": dict(base, OMP_NUM_THREADS="1")}
        times = {}
        try:
            for n in map(int, args.workers.split(",")):
                cmds = commands(script, n)
                for r in range(args.rounds):
                    for case, cmd in cmds.items():
                        times.setdefault(f"{case} n={n}", []).append(timed(cmd, envs[case]))
                    print(f"n={n} round {r + 1}/{args.rounds}", flush=True)
        finally:
            server.kill()
    rows = []
    for key, ts in times.items():
        case, n = key.split(" ")
        ref = statistics.median(times[f"torchrun {n}"])
        rows.append({"case": case, "workers": int(n[2:]), "median_s": statistics.median(ts), "min_s": min(ts),
                     "max_s": max(ts), "vs_torchrun": statistics.median(ts) / ref, "runs": ts})
    print(f"{'case':<9} {'workers':>7} {'median s':>9} {'min s':>6} {'max s':>6} {'/ torchrun':>10}")
    for row in rows:
        print(f"{row['case']:<9} {row['workers']:>7} {row['median_s']:>9.2f} {row['min_s']:>6.2f} "
              f"{row['max_s']:>6.2f} {row['vs_torchrun']:>10.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
