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
import importlib
import itertools
import json
import os
import time

import torch

import paratrain as pt

from .. import config
from ..launch import bootstrap
from ..trace import recorder as trace
from . import checkpoint as ckpt
from . import elastic_options, strategies
from .fail import die_if_due
from .memory import PeakMemory
from .metrics import MetricsLog, jsonable, plot_loss, read_metrics, time_to_target
from .progress import ProgressReporter
from .slowdown import Slowdown
from .summary import job_numbers
from .tensorboard import Board
from .tasks import build_task


UNBOUNDED = 10 ** 9   # the steps of a run that stops on its budget


class Settings:
    """The task's defaults, overridden by whatever the user gave on the command line."""

    def __init__(self, task, args):
        d = task.defaults
        self.budget = getattr(args, "budget", None)   # seconds of training (paratrain compare), then stop
        self.steps = args.steps or (UNBOUNDED if self.budget else d["steps"])
        self.batch_size = args.batch_size or d["batch_size"]
        self.lr = args.lr or d["lr"]
        self.optimizer = args.optimizer or d["optimizer"]
        self.eval_every = args.eval_every or d.get("eval_every") or max(1, min(self.steps, d["steps"]) // 5)
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
        for batch in itertools.islice(epoch_batches(task.train_set, sampler, batch_size), skip, steps_per_epoch):
            yield step, batch
            step += 1


def epoch_batches_naive(dataset, sampler, batch_size):
    """One epoch's full batches in ``sampler``'s order: torch's DataLoader, which fetches
    each sample alone and stacks them (default_collate)."""
    return iter(torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True))


def epoch_batches(dataset, sampler, batch_size):
    """``epoch_batches_naive``'s batches, equal to the bit; a dataset of tensors in memory
    (TensorDataset: digits, the MLP's and recsys' data) has each batch gathered by one
    index per tensor instead. A sample at a time, a digits batch of 32 took 0.74 ms of a
    worker's 9 ms step."""
    if not isinstance(dataset, torch.utils.data.TensorDataset):
        yield from epoch_batches_naive(dataset, sampler, batch_size)
        return
    order = iter(sampler)
    while len(chosen := list(itertools.islice(order, batch_size))) == batch_size:
        index = torch.tensor(chosen)
        yield [t[index] for t in dataset.tensors]   # a list, as default_collate makes of a tuple


def run(args):
    """Train as one worker of the job; returns the summary dict (rank 0) or None."""
    job = TrainingRun(args)
    job.train()
    gathered = job.finish()
    return job.write_summary(*gathered) if job.lead else None


class TrainingRun:
    """One worker's run, in the order it happens: set up (the task, the strategy's
    step, a resume), the loop, the end (the strategy's finish, the last checkpoint,
    every worker's report), and on rank 0 the summary.

    Each step is timed in parts: the strategy's communication (its stats), the
    compute (forward and backward, less any communication waited for inside
    backward), and the slowdown the options ask for (slowdown.py), which sleeps
    after backward and before the gradients leave, as a slower machine would."""

    def __init__(self, args):
        self.args = args
        # torch._dynamo, which the optimizer's first step imports, holds 23 MiB of heap: imported
        # before the baseline, a fresh worker counts what one forked from a fork server does
        importlib.import_module("torch._dynamo")
        self.memory = PeakMemory()   # above the interpreter and its libraries, before the task
        chosen = strategies.STRATEGIES[args.strategy]
        self.task = build_task(args.model, seed=args.seed, sparse=chosen.SPARSE)
        self.settings = Settings(self.task, args)
        self.strategy = chosen.make_step(self.task, args, self.settings)
        self.settings.shard_data(self.task, self.strategy.data_replicas)
        self.lead = self.strategy.rank == 0
        self.start = self._resume() if args.resume else 0
        self.board, self.pool = self.strategy.coordination(self.settings, self.start)
        self.slow = Slowdown.from_args(args, self.strategy.rank)
        self.run_dir = args.run_dir
        self.log = MetricsLog(self.run_dir) if self.lead else None
        # (a run on a --budget has no step count to show; compare draws its own bar)
        self.progress = ProgressReporter(self.settings.steps, enabled=self.lead and not self.settings.budget)
        worker = config.get("PARATRAIN_ELASTIC")   # elastic: a worker's id, for life (its rank moves)
        self.board_tb = Board(self.run_dir, self.strategy.rank if worker is None else worker, self.lead) \
            if args.tensorboard else None
        self.loss = float("nan")   # the last step's logged loss
        self.stopped_at = None     # the step a --budget ended the run at
        self.last_eval = {}
        self.train_seconds = self.loop_seconds = 0.0
        self.t_start = None
        self.failures = set(getattr(args, "fail", None) or ())   # --fail RANK:STEP
        self.every_other = getattr(args, "trace_every_other", False)   # bench trace: traced and untraced steps
        self.elastic = None   # --min-workers: the elastic loop (elastic_loop.py)
        if elastic_options.given(args):
            from .elastic_loop import ElasticLoop
            self.elastic = ElasticLoop(self)

    def _resume(self):
        """Load the checkpoint into the model and the strategy; returns the step it was at."""
        args, strategy = self.args, self.strategy
        path = strategy.checkpoint_path(args.resume, writing=False)
        state = ckpt.load_checkpoint(path, expect_config=self.task.config)
        problem = elastic_options.resume_problem(args, state)
        if problem:
            raise ValueError(problem)
        self.resumed = state   # (the elastic loop takes its data position from it)
        strategy.load_model_state(self.task, state["model"])
        strategy.load_state_dict(state)
        start = int(state["step"])
        if start >= self.settings.steps:
            raise ValueError(f"the checkpoint {args.resume} is already at step {start}; ask for more --steps "
                             f"than that (got {self.settings.steps})")
        return start

    def save(self, step):
        """The checkpoint at ``step``: called on every worker, since gathering a cut model
        (and its optimizer's state) is collective; written by those the strategy names."""
        model_state = self.strategy.model_state(self.task)
        extra = self.strategy.state_dict()
        if self.elastic is not None:
            extra.update(self.elastic.checkpoint_fields())
        path = self.strategy.checkpoint_path(os.path.join(self.run_dir, "checkpoint.pt"), writing=True)
        if path:
            with trace.span("checkpoint", "checkpoint", step=step):
                ckpt.save_checkpoint(path, {
                    "config": self.task.config, "model_name": self.task.name, "step": step,
                    "model": model_state, **extra})

    def train(self):
        """The loop: while the pool gives this worker a batch, a step, rank 0's line in
        the log and the progress bar, an evaluation and a checkpoint when they are due."""
        if self.elastic is not None:   # its first step meets the others (a joiner's state comes from them)
            self.t_start = time.perf_counter()
            self.elastic.run()
            self.loop_seconds = time.perf_counter() - self.t_start
            return
        s, strategy, stats = self.settings, self.strategy, self.strategy.stats
        sampler = pt.DistributedSampler(self.task.train_set, num_replicas=strategy.data_replicas,
                                        rank=strategy.data_rank, seed=self.args.seed, drop_last=True)
        wait_before, bytes_before = 0.0, stats.bytes
        self.board.start()
        self.t_start = fetched = time.perf_counter()
        for step, batch in batches_from(self.task, sampler, s.batch_size, self.start, s.steps_per_epoch):
            if not self.pool.take():
                break
            if self.failures:
                die_if_due(self.failures, strategy.rank, step + 1)
            if self.every_other:
                trace.pause(step % 2 == 0)
            if trace.ON:
                trace.add("data", "data", "data", fetched, time.perf_counter())
            dt, compute, slept = self.run_step(batch)
            if self.board_tb is not None:
                self.board_tb.step(step + 1, dt)
            if trace.ON:
                trace.add("step", "step", "compute", fetched, time.perf_counter(), {"step": step + 1})
            self.train_seconds += dt
            wait, wait_before = stats.wait_seconds - wait_before, stats.wait_seconds
            sent, bytes_before = stats.bytes - bytes_before, stats.bytes   # this step's (compressed: what went)
            done = step + 1
            self.board.beat(done - self.start, time.perf_counter() - self.t_start)
            with trace.span("evaluate", "compute", track="compute"):
                evaluation = strategy.evaluate(self.task) if done % s.eval_every == 0 or done == s.steps else None
            if self.lead:
                self.record_step(done, dt, compute, slept, wait, sent, evaluation)
            if s.checkpoint_every and done % s.checkpoint_every == 0 and done < s.steps:
                self.save(done)
            if s.budget and self.board.agree_stop(time.perf_counter() - self.t_start >= s.budget, done,
                                                  self.pool.shared):
                self.stopped_at = done
                break
            fetched = time.perf_counter()
        self.loop_seconds = time.perf_counter() - self.t_start

    def run_step(self, batch):
        """One training step; returns its seconds, the compute's, and the slowdown's."""
        strategy = self.strategy
        t0 = time.perf_counter()
        strategy.before_step()
        tc, waited = time.perf_counter(), strategy.stats.wait_seconds
        loss = strategy.forward_backward(self.task, batch)
        compute = time.perf_counter() - tc - (strategy.stats.wait_seconds - waited)
        self.memory.sample()   # every gradient held
        slept = self.slow.after_compute(compute)
        strategy.after_backward()
        self.memory.sample()   # and the optimizer's state
        self.loss = strategy.logged_loss(loss)
        return time.perf_counter() - t0, compute, slept

    def record_step(self, done, dt, compute, slept, wait, sent, evaluation, progress=None):
        """Rank 0: the step's line in metrics.jsonl, and the progress the front-end draws
        (``progress``: (step, samples/s), where the caller knows them better than the pool)."""
        pool, s = self.pool, self.settings
        row = {"step": done, "time": round(time.perf_counter() - self.t_start, 4), "loss": self.loss,
               "step_seconds": round(dt, 5), "compute_seconds": round(compute, 5),
               "comm_wait_seconds": round(wait, 5)}
        if slept:
            row["slowdown_seconds"] = round(slept, 5)
        if self.every_other:
            row["traced"] = trace.ON
        if sent:
            row["bytes"] = sent
        if pool.shared:  # the job's batches so far (taken, not all finished yet)
            row["job_batches"] = min(pool.last_ticket + 1, pool.total)
        if evaluation is not None:
            self.last_eval = evaluation
            row.update(self.last_eval)
        self.log.log(**row)
        if progress is None:
            R = self.strategy.data_replicas
            job_batches = min(pool.last_ticket + 1, pool.total) if pool.shared else (done - self.start) * R
            progress = (min(s.steps, self.start + job_batches // R),
                        job_batches * s.batch_size / (time.perf_counter() - self.t_start))
        samples_per_s = progress[1]
        self.progress.update(progress[0], loss=self.loss, samples_per_s=samples_per_s)
        if self.board_tb is not None:
            self.board_tb.record(done, row, samples_per_s, evaluation)

    def finish(self):
        """Every worker: the strategy's end, the final checkpoint, and this worker's report
        handed in. Returns (reports by rank, lost workers) on rank 0, None elsewhere."""
        strategy, slow = self.strategy, self.slow
        strategy.finish()
        if self.board_tb is not None:
            self.board_tb.close()
        self.board.beat(self.pool.taken, self.loop_seconds, force=True)
        if self.lead and strategy.finish_changes_weights:
            self.last_eval = self.task.evaluate(self.task.model)  # e.g. the servers' final weights
        self.save(self.steps_done)
        report = {"rank": strategy.rank, "batches": self.pool.taken, "compute_s": slow.compute_s,
                  "slowdown_s": slow.slept_s, "slowed_steps": slow.slowed_steps,
                  "comm_wait_s": strategy.stats.wait_seconds, "loop_s": self.loop_seconds,
                  "last_loss": self.loss, **self.memory.report()}
        return self.board.gather(report)

    @property
    def steps_done(self):
        return self.stopped_at or self.settings.steps

    def write_summary(self, reports, lost):
        """Rank 0: summary.json and the loss plot, from every worker's report; returns the summary."""
        args, s, task, strategy, slow = self.args, self.settings, self.task, self.strategy, self.slow
        run_dir, P = self.run_dir, strategy.world_size
        self.log.close()
        if self.pool.shared:
            self.progress.update(s.steps, loss=self.loss)  # the bar ends full, whoever took the last batches
        plot = plot_loss(os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "loss.png"),
                         f"{task.name}: {args.strategy}, {P} workers")
        st = strategy.stats
        total_s = time.perf_counter() - self.t_start   # (before the strategy's fields, which may ask the network)
        summary = {
            "model": task.name, "strategy": args.strategy, **strategies.summary_fields(args, strategy),
            "workers": P, "steps": self.steps_done, "resumed_from": self.start or None,
            "batch_per_worker": s.batch_size, "final_loss": self.loss, **self.last_eval,
            **job_numbers(reports, lost, s.batch_size, mean_loss=strategy.local_loss,
                          ranks_per_batch=P // strategy.data_replicas),
            "time_total_s": total_s, "time_training_s": self.train_seconds,
            "started": "a fork of a process with torch imported" if bootstrap.FORKED_FROM else "a fresh interpreter",
            "time_compute_s": slow.compute_s, "time_slowdown_s": slow.slept_s if slow.active else None,
            "time_comm_wait_s": st.wait_seconds,
            "time_comm_s": st.comm_seconds, "bytes_communicated": st.bytes,
            "straggler": f"{args.straggler[0]}:{args.straggler[1]:g}" if args.straggler else None,
            "jitter": f"{args.jitter[0]:g}:{args.jitter[1]:g}" if args.jitter else None,
            **(time_to_target(read_metrics(self.log.path), args.target_loss) if args.target_loss else {}),
            "run_dir": run_dir, "plot": plot, "checkpoint": os.path.join(run_dir, "checkpoint.pt"),
        }
        if self.elastic is not None:
            summary.update(self.elastic.summary_fields())
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(jsonable(summary), f, indent=1)
        return summary
