"""How long does ``paratrain train`` take, its workers forked from the front-end's own fork server or fresh?

    python benchmarks/train_start.py [--rounds 5]

The command a new user runs first (``paratrain train``: digits, 2 workers, 500
steps) and the same with ``--strategy ps`` (2 workers and a server: three
processes on the machine's cores), each with its workers forked from the fork
server the front-end starts first (launch/warm.py) and with
``PARATRAIN_WARM_START=0`` (fresh interpreters), one after another in every
round so all meet the same machine. The time is the whole command's wall
clock, front-end included; CPU is the children's user + system time.

Prints a table (median, min and max seconds; warm against fresh) and writes
benchmarks/results/train_start.json.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = os.path.join(HERE, "results", "train_start.json")
PARATRAIN = os.path.join(os.path.dirname(sys.executable), "paratrain")
JOBS = {"default": [], "ps": ["--strategy", "ps"]}


def timed(cmd, env):
    """(wall seconds, CPU seconds of the command and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=env)
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0 or "start fresh" in p.stdout + p.stderr:
        raise SystemExit(f"{' '.join(cmd)} failed or did not fork:\n{p.stdout}{p.stderr}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=RESULT)
    args = p.parse_args(argv)
    base = {k: v for k, v in os.environ.items() if k not in ("PARATRAIN_FORKSERVER", "PARATRAIN_WARM_START")}
    runs = {}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for job, extra in JOBS.items():
                for how, warm in (("warm", "1"), ("fresh", "0")):
                    cmd = [PARATRAIN, "train", "--runs", os.path.join(workdir, "runs"), *extra]
                    runs.setdefault((job, how), []).append(timed(cmd, dict(base, PARATRAIN_WARM_START=warm)))
            print(f"round {r + 1}/{args.rounds}", flush=True)
    rows = []
    for (job, how), got in runs.items():
        wall, cpu = [w for w, _ in got], [c for _, c in got]
        fresh = statistics.median(w for w, _ in runs[(job, "fresh")])
        rows.append({"job": job, "workers": how, "median_s": statistics.median(wall), "min_s": min(wall),
                     "max_s": max(wall), "median_cpu_s": statistics.median(cpu),
                     "vs_fresh": statistics.median(wall) / fresh, "runs_s": wall, "cpu_s": cpu})
    print(f"{'job':<8} {'workers':<6} {'median s':>9} {'min s':>6} {'max s':>6} {'CPU s':>6} {'/ fresh':>8}")
    for row in rows:
        print(f"{row['job']:<8} {row['workers']:<6} {row['median_s']:>9.2f} {row['min_s']:>6.2f} {row['max_s']:>6.2f} "
              f"{row['median_cpu_s']:>6.1f} {row['vs_fresh']:>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
