"""``paratrain bench elastic``: how fast a job notices a lost worker, goes on, and takes a new one.

    paratrain bench elastic [--rounds 3] [--workers 4] [--steps 60] [--kill-step 25] [--zero STAGE] [--no-torchrun]
    paratrain bench elastic --cut-link [--rounds 3] [--workers 4]

Each round runs the gpt task on ``--workers`` local workers under
``paratrain run --min-workers 2 --max-restarts 1`` (elastic_worker.py), and
kills one worker with SIGKILL as it begins step ``--kill-step`` (round r
kills worker r mod W, so rank 0 dies too). From the workers' timestamps
(one clock, one host) it reports:

- detect: from the kill to the last survivor's broken collective reaching
  pt.elastic (every survivor knows);
- resume: from the kill to the first step completed by the re-formed world
  (on W - 1 workers, or on W where the replacement was ready by then);
- join: from the replacement's process start to the first step completed by
  the world back at its size;
- redone: steps done again (those since the last commit);
- commits: what committing every 10 steps costs, as a share of the step time
  (a commit's median seconds over ten steps' median seconds).

The same round then runs under torchrun (elastic_torchrun_worker.py: PyTorch DDP
over Gloo, ``--max-restarts 1``, a disk checkpoint every 10 steps, with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which its restarted workers
fail to meet, pytorch #135712), killed at the same step: detect is when its
agent told the first survivor to stop, resume the first step of the restarted
job (every worker new), redone the steps since its checkpoint, and commits
the checkpoint's cost. A ratio column gives torchrun's resume over ours.

``--cut-link``: each round runs two pretend hosts of W/2 workers, each in a
network namespace of its own with its own launcher (``--nnodes 2``, the
first hosting the store; launch/netns_pair.py), joined by a link over which
everything goes (Gloo). At ``--kill-step`` the victim cuts the second
host's link: no socket closes, nothing arrives, and nobody reports a death.
The heartbeats declare its workers dead; detect runs from the cut to the
last survivor giving up on the world. No torchrun round: its workers wait
for the collective's timeout there (pytorch #123678). Needs root.

Writes benchmarks/results/elastic.json (elastic-cut-link.json).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ..launch import forkserver
from ..train.argtypes import positive_int

COMMIT_EVERY = 10


def one_round(args, victim, folder):
    path, events = round_config(args, folder, f"paratrain-{victim}", kill_worker=victim, zero=args.zero)
    cmd = [sys.executable, "-m", "paratrain.run", "-n", str(args.workers), "--min-workers", "2", "--max-restarts",
           "1", "-m", "paratrain.bench.elastic_worker", path]
    return measure(read_events(forkserver.run(cmd, timeout=600), events, "elastic"), args.workers)


def round_config(args, folder, name, **more):
    """A round's worker config, written to ``folder``: the job, where the workers' events go,
    and ``more``. Returns (the config's path, the events' path)."""
    events = os.path.join(folder, f"{name}-events.jsonl")
    cfg = {"events": events, "batch": 16, "steps": args.steps, "commit_every": COMMIT_EVERY,
           "kill_step": args.kill_step, **more}
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path, events


def read_events(res, events, what):
    """The workers' event lines of a round whose launcher ended as ``res``; a failed run ends the benchmark."""
    if res.returncode != 0:
        raise SystemExit(f"the {what} run failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    with open(events) as f:
        return [json.loads(line) for line in f]


def cut_round(args, r, folder):
    """Two pretend hosts, each in a network namespace with its own launcher; the second's link is
    cut at the kill step (elastic_worker: the victim runs ``cut``)."""
    from ..launch import netns_pair
    half = args.workers // 2
    with netns_pair.HostPair() as hosts:
        path, events = round_config(args, folder, f"cut-{r}", kill_worker=half, zero=args.zero,
                                    cut=" ".join(hosts.cut_command(1)))

        def cmd(host):
            return hosts.run(host, [sys.executable, "-m", "paratrain.run", "--nnodes", "2", "--node-rank", str(host),
                                    "--master-addr", hosts.address(0), "--master-port", "29400", "-n", str(half),
                                    "--min-workers", str(half), "-m", "paratrain.bench.elastic_worker", path])
        env = dict(os.environ, PARATRAIN_BACKEND="torch")   # every byte over the link (shm does not cross it)
        second = subprocess.Popen(cmd(1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            res = subprocess.run(cmd(0), env=env, capture_output=True, text=True, timeout=600)
        finally:
            second.kill()   # its workers die with it (their parent-death signal)
            second.wait()
    return measure(read_events(res, events, "elastic"), args.workers)


def torchrun_round(args, victim, folder):
    path, events = round_config(args, folder, f"torchrun-{victim}", kill_worker=victim,
                                checkpoint=os.path.join(folder, f"torchrun-{victim}.pt"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.workers),
           "--max-restarts", "1", "-m", "paratrain.bench.elastic_torchrun_worker", path]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    return measure_torchrun(read_events(res, events, "torchrun"))


def measure_torchrun(rows):
    """torchrun's figures: it restarts every worker, so a survivor knows when it is stopped."""
    kill = next(r for r in rows if r["kind"] == "kill")
    t_kill = kill["t"]
    stopped = [r["t"] for r in rows if r["kind"] == "stopped"]
    again = sorted((r["t"], r["step"]) for r in rows if r["kind"] == "step" and r["attempt"] > 0)
    steps_before = max((r["step"] for r in rows if r["kind"] == "step" and r["t"] < t_kill), default=0)
    return {"detect_s": min(stopped) - t_kill if stopped else None,
            "resume_s": again[0][0] - t_kill if again else None,
            "redone_steps": steps_before - (again[0][1] - 1) if again else None,
            **pace(rows, step_seconds([r for r in rows if r.get("attempt") == 0]))}


def measure(rows, workers):
    """The round's figures from the workers' event lines (see the module docstring)."""
    kill = next(r for r in rows if r["kind"] == "kill")
    victim, t_kill = kill["worker"], kill["t"]
    lost = [r for r in rows if r["kind"] == "changed" and r["event"] == "lost"]
    caught = [r["caught_at"] for r in lost]
    knew = max(caught) if caught else t_kill
    after = sorted(r["t"] for r in rows if r["kind"] == "step" and r["t"] > knew)   # the re-formed world's
    joiner = next((r for r in rows if r["kind"] == "start" and r["worker"] >= workers), None)
    back = sorted(r["t"] for r in rows if r["kind"] == "step" and joiner and r["t"] > joiner["t_process"]
                  and r["world"] == workers)
    steps_before = max((r["step"] for r in rows if r["kind"] == "step" and r["t"] < t_kill), default=0)
    resumed_from = min((r["step"] for r in lost), default=steps_before)
    return {"victim": victim, "detect_s": max(caught) - t_kill if caught else None,
            "resume_s": after[0] - t_kill if after else None,
            "join_s": back[0] - joiner["t_process"] if back else None,
            "redone_steps": steps_before - resumed_from,
            **pace(rows, step_seconds(rows))}


def pace(rows, step_times):
    """The median step's seconds, and what a commit every COMMIT_EVERY steps costs as a
    share of them (None without commits)."""
    commits = [r["seconds"] for r in rows if r["kind"] == "commit"]
    step_s = statistics.median(step_times)
    return {"commit_share": statistics.median(commits) / (COMMIT_EVERY * step_s) if commits else None,
            "step_s": step_s}


def step_seconds(rows):
    """Worker 0's time between consecutive steps of one world (its own steps only)."""
    mine = sorted((r["t"], r["step"], r.get("world")) for r in rows if r["kind"] == "step" and r["worker"] == 0)
    return [b[0] - a[0] for a, b in zip(mine, mine[1:]) if b[1] == a[1] + 1 and b[2] == a[2]] or [0.0]


def _s(x):
    return "-" if x is None else f"{x:.2f} s"


def _share(x):
    return "-" if x is None else f"{x:.1%}"


def main(argv=None):
    p = argparse.ArgumentParser(prog="paratrain bench elastic", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--workers", type=positive_int, default=4)
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument("--kill-step", type=positive_int, default=25)
    p.add_argument("--no-torchrun", action="store_true", help="leave out torchrun's rounds")
    p.add_argument("--zero", type=int, choices=(1, 2, 3), default=None,
                   help="pt.ZeRO at this stage instead of pt.DataParallel (torchrun's side stays DDP)")
    p.add_argument("--cut-link", action="store_true",
                   help="two pretend hosts in network namespaces, each with its own launcher; the second's link is "
                        "cut (needs root)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cut_link:
        from ..launch import netns_pair
        if args.workers < 2 or args.workers % 2:
            p.error("--cut-link needs an even --workers, two hosts of --workers / 2")
        if netns_pair.check():
            p.error(f"--cut-link: {netns_pair.check()}")
    args.out = args.out or os.path.join("benchmarks", "results",
                                        "elastic-cut-link.json" if args.cut_link else "elastic.json")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            row = cut_round(args, r, folder) if args.cut_link else one_round(args, r % args.workers, folder)
            if not args.no_torchrun and not args.cut_link:
                row["torchrun"] = torchrun_round(args, r % args.workers, folder)
            rows.append(row)
            what = (f"the link of workers {row['victim']}-{args.workers - 1} cut" if args.cut_link else
                    f"worker {row['victim']} killed")
            back = "" if args.cut_link else \
                f", back to {args.workers} {_s(row['join_s'])} after the replacement started"
            print(f"round {r + 1}/{args.rounds}: {what}; every survivor knew in {_s(row['detect_s'])}, the next "
                  f"step done in {_s(row['resume_s'])}{back}; {row['redone_steps']} steps redone; commits cost "
                  f"{row['commit_share']:.1%} of the step time", flush=True)
    print(f"\n{'':>14}{'paratrain':^52}{'torchrun':^40}")
    print(f"{'round':>5}  {'killed':>6}  {'detect':>8}  {'resume':>8}  {'join':>8}  {'redone':>6}  {'commits':>7}  "
          f"{'detect':>8}  {'resume':>8}  {'redone':>6}  {'commits':>7}  {'resume ratio':>12}")
    for i, row in enumerate(rows):
        t = row.get("torchrun") or {}
        ratio = (f"{t['resume_s'] / row['resume_s']:.1f}x" if t.get("resume_s") and row["resume_s"] else "-")
        print(f"{i + 1:>5}  {row['victim']:>6}  {_s(row['detect_s']):>8}  {_s(row['resume_s']):>8}  "
              f"{_s(row['join_s']):>8}  {row['redone_steps']:>6}  {row['commit_share']:>7.1%}  "
              f"{_s(t.get('detect_s')):>8}  {_s(t.get('resume_s')):>8}  {t.get('redone_steps', '-')!s:>6}  "
              f"{_share(t.get('commit_share')):>7}  {ratio:>12}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"workers": args.workers, "steps": args.steps, "kill_step": args.kill_step, "zero": args.zero,
                   "cut_link": args.cut_link, "rounds": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
