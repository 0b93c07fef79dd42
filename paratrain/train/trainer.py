"""The training loop every worker of ``paratrain train`` runs.

Each worker builds the same task (tasks.py: model, data, loss), hands the model
to the chosen strategy (its step object, strategies/: what is communicated,
how the workers meet, what is checkpointed, its summary fields), reads its
own shard of every epoch through DistributedSampler, and steps. Rank 0 alone
writes: one JSON line per step (metrics.jsonl), the progress lines the
front-end turns into a bar, periodic checkpoints (atomic), and at the end
summary.json and a plot.

How many batches each worker takes, and how the workers' own numbers reach
rank 0 for the summary, is coordination.py's job; the deliberate slowdowns of
--straggler and --jitter are slowdown.py's; the job-wide numbers (samples/s,
each worker's share) are summary.py's.

Resuming is exact: the data order is a function of (seed, epoch) and the step
says where in the epoch we are, the optimizer state travels in the checkpoint,
and the built-in models have no dropout, so a run stopped at step k and
resumed reaches the same parameters at step k+j as a run that never stopped.
"""
import itertools
import json
import os
import time

import torch

import paratrain as pt

from . import checkpoint as ckpt
from . import strategies
from .metrics import MetricsLog, jsonable, plot_loss, read_metrics, time_to_target
from .progress import ProgressReporter
from .slowdown import Slowdown
from .summary import job_numbers
from .tasks import build_task


class Settings:
    """The task's defaults, overridden by whatever the user gave on the command line."""

    def __init__(self, task, args):
        d = task.defaults
        self.steps = args.steps or d["steps"]
        self.batch_size = args.batch_size or d["batch_size"]
        self.lr = args.lr or d["lr"]
        self.optimizer = args.optimizer or d["optimizer"]
        self.eval_every = args.eval_every or d.get("eval_every") or max(1, self.steps // 5)
        self.checkpoint_every = args.checkpoint_every
        self.steps_per_epoch = None

    def shard_data(self, task, replicas):
        """Steps per epoch when the data is cut into ``replicas`` shards (the strategy says how many)."""
        per_epoch = len(task.train_set) // (replicas * self.batch_size)
        if per_epoch < 1:
            raise ValueError(f"the {task.name} training set has {len(task.train_set)} samples, fewer than one "
                             f"step needs ({replicas} data shards x batch {self.batch_size}); lower --batch-size")
        self.steps_per_epoch = per_epoch


def batches_from(task, sampler, batch_size, start_step, steps_per_epoch):
    """Yield (step, batch) from start_step on; epoch e's order is set_epoch(e)'s, and a
    resumed run skips the steps of its epoch that were already taken."""
    step = start_step
    while True:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(task.train_set, batch_size=batch_size, sampler=sampler, drop_last=True)
        for batch in itertools.islice(loader, skip, steps_per_epoch):
            yield step, batch
            step += 1


def run(args):
    """Train as one worker of the job; returns the summary dict (rank 0) or None.

    Each step is timed in parts: the strategy's communication (its stats), the
    compute (forward and backward, less any communication waited for inside
    backward), and the slowdown the options ask for (slowdown.py), which sleeps
    after backward and before the gradients leave, as a slower machine would."""
    chosen = strategies.STRATEGIES[args.strategy]
    task = build_task(args.model, seed=args.seed, sparse=chosen.SPARSE)
    s = Settings(task, args)
    strategy = chosen.make_step(task, args, s)
    me, P = strategy.rank, strategy.world_size
    s.shard_data(task, strategy.data_replicas)
    lead = me == 0
    start = 0
    if args.resume:
        state = ckpt.load_checkpoint(strategy.checkpoint_path(args.resume, writing=False), expect_config=task.config)
        strategy.load_model_state(task, state["model"])
        strategy.load_state_dict(state)
        start = int(state["step"])
        if start >= s.steps:
            raise ValueError(f"the checkpoint {args.resume} is already at step {start}; ask for more --steps "
                             f"than that (got {s.steps})")
    board, pool = strategy.coordination(s, start)
    slow = Slowdown.from_args(args, me)
    sampler = pt.DistributedSampler(task.train_set, num_replicas=strategy.data_replicas, rank=strategy.data_rank,
                                    seed=args.seed, drop_last=True)
    run_dir = args.run_dir
    log = MetricsLog(run_dir) if lead else None
    progress = ProgressReporter(s.steps, enabled=lead)
    loss_value = float("nan")
    train_seconds = wait_before = 0.0
    bytes_before = strategy.stats.bytes
    last_eval = {}

    def save(step):
        model_state = strategy.model_state(task)   # on every worker: gathering a cut model is collective,
        extra = strategy.state_dict()              # and so is its optimizer's state
        path = strategy.checkpoint_path(os.path.join(run_dir, "checkpoint.pt"), writing=True)
        if path:
            ckpt.save_checkpoint(path, {
                "config": task.config, "model_name": task.name, "step": step,
                "model": model_state, **extra})

    board.start()
    t_start = time.perf_counter()
    for step, batch in batches_from(task, sampler, s.batch_size, start, s.steps_per_epoch):
        if not pool.take():
            break
        t0 = time.perf_counter()
        strategy.before_step()
        tc, waited = time.perf_counter(), strategy.stats.wait_seconds
        loss = strategy.forward_backward(task, batch)
        compute = time.perf_counter() - tc - (strategy.stats.wait_seconds - waited)
        slept = slow.after_compute(compute)
        strategy.after_backward()
        loss_value = strategy.logged_loss(loss)
        dt = time.perf_counter() - t0
        train_seconds += dt
        wait = strategy.stats.wait_seconds - wait_before
        wait_before = strategy.stats.wait_seconds
        sent = strategy.stats.bytes - bytes_before   # rank 0's bytes of this step (compressed: what went)
        bytes_before = strategy.stats.bytes
        done = step + 1
        board.beat(done - start, time.perf_counter() - t_start)
        evaluation = strategy.evaluate(task) if done % s.eval_every == 0 or done == s.steps else None
        if lead:
            row = {"step": done, "time": round(time.perf_counter() - t_start, 4), "loss": loss_value,
                   "step_seconds": round(dt, 5), "compute_seconds": round(compute, 5),
                   "comm_wait_seconds": round(wait, 5)}
            if slept:
                row["slowdown_seconds"] = round(slept, 5)
            if sent:
                row["bytes"] = sent
            if pool.shared:  # the job's batches so far (taken, not all finished yet)
                row["job_batches"] = min(pool.last_ticket + 1, pool.total)
            if evaluation is not None:
                last_eval = evaluation
                row.update(last_eval)
            log.log(**row)
            R = strategy.data_replicas
            job_batches = min(pool.last_ticket + 1, pool.total) if pool.shared else (done - start) * R
            progress.update(min(s.steps, start + job_batches // R), loss=loss_value,
                            samples_per_s=job_batches * s.batch_size / (time.perf_counter() - t_start))
        if s.checkpoint_every and done % s.checkpoint_every == 0 and done < s.steps:
            save(done)
    loop_seconds = time.perf_counter() - t_start
    strategy.finish()
    board.beat(pool.taken, loop_seconds, force=True)
    if lead and strategy.finish_changes_weights:
        last_eval = task.evaluate(task.model)  # e.g. the servers' final weights
    save(s.steps)
    report = {"rank": me, "batches": pool.taken, "compute_s": slow.compute_s, "slowdown_s": slow.slept_s,
              "slowed_steps": slow.slowed_steps, "comm_wait_s": strategy.stats.wait_seconds,
              "loop_s": loop_seconds, "last_loss": loss_value}
    gathered = board.gather(report)
    if not lead:
        return None
    reports, lost = gathered
    log.close()
    if pool.shared:
        progress.update(s.steps, loss=loss_value)  # the bar ends full, whoever took the last batches
    plot = plot_loss(os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "loss.png"),
                     f"{task.name}: {args.strategy}, {P} workers")
    st = strategy.stats
    total_s = time.perf_counter() - t_start   # (before the strategy's fields, which may ask the network)
    summary = {
        "model": task.name, "strategy": args.strategy, **strategies.summary_fields(args, strategy),
        "workers": P, "steps": s.steps, "resumed_from": start or None,
        "batch_per_worker": s.batch_size, "final_loss": loss_value, **last_eval,
        **job_numbers(reports, lost, s.batch_size, mean_loss=strategy.local_loss,
                      ranks_per_batch=P // strategy.data_replicas),
        "time_total_s": total_s, "time_training_s": train_seconds,
        "time_compute_s": slow.compute_s, "time_slowdown_s": slow.slept_s if slow.active else None,
        "time_comm_wait_s": st.wait_seconds,
        "time_comm_s": st.comm_seconds, "bytes_communicated": st.bytes,
        "straggler": f"{args.straggler[0]}:{args.straggler[1]:g}" if args.straggler else None,
        "jitter": f"{args.jitter[0]:g}:{args.jitter[1]:g}" if args.jitter else None,
        **(time_to_target(read_metrics(log.path), args.target_loss) if args.target_loss else {}),
        "run_dir": run_dir, "plot": plot, "checkpoint": os.path.join(run_dir, "checkpoint.pt"),
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(jsonable(summary), f, indent=1)
    return summary
