"""The training loop of an elastic ``paratrain train`` (``--min-workers``): the steps inside
``pt.elastic.run``, a commit every ``--commit-every`` steps.

When a worker dies, the others catch it in a collective, re-form a world without it
(pt.elastic.run), go back to their last commit and go on; a replacement joins at the
next commit. This loop adds what a training job needs around that:

- **The same global batches.** Each step takes the next G samples of the epoch's
  order (pt.elastic.ElasticSampler with ``global_batch=G``), G = --batch-size x
  --workers, cut into nearly equal shares over whoever is there. Each worker weighs
  its share's mean loss by its share of the step (n_r x W / G) before the
  average the all-reduce takes, so the gradient is the mean over the G samples at
  any world size: the run follows the trajectory it would have followed without
  the failure (to float rounding). With ``--elastic-batch shrink`` each worker keeps
  --batch-size, the global batch shrinks with the world, and the learning rate is
  scaled by W / --workers (Goyal et al., arXiv 1706.02677: the linear scaling rule).
- **One writer.** Rank 0 writes metrics.jsonl and the progress lines; after a
  change the new rank 0 (a survivor) takes over the log, dropping the rows of the
  steps that are done again, and the history of events comes from rank 0's
  memory to every worker, so the summary has all of them whoever writes it.
- **What happened**: elastic_events.py, from the launcher's record of who died or
  started and when, and what the workers agree at the re-form.
- **Meshes** (--tp, --pp): the launcher forms worlds of whole replicas
  (``--replica-size``), and each worker's part of its replica is built again
  in a new world (pt.elastic.Rebuilt, as a joining worker builds it), the
  commit loaded into it; the data is dealt over the replicas, not the workers.
"""
import json
import os
import time

import torch

from .. import config
from ..comm import elastic_rendezvous
from ..comm.world import broadcast_text, elastic_generation, world
from ..elastic import ElasticSampler, Rebuilt, State
from ..elastic import run as elastic_run
from ..trace import recorder as trace
from . import elastic_events, elastic_options, strategies
from .coordination import GroupBoard
from .fail import die_if_due
from .metrics import METRICS_FILE, MetricsLog, drop_rows_after
from .progress import ProgressReporter
from .tasks import build_task


class ElasticLoop:
    """Runs ``job`` (a trainer.TrainingRun) elastically; ``run()`` returns when the job's
    steps are done, in whatever world is left."""

    def __init__(self, job):
        self.job = job
        args, strategy = job.args, job.strategy
        self.replica = elastic_options.replica_size(args)   # workers per data-parallel replica
        self.asked, self.batch = args.workers // self.replica, job.settings.batch_size   # replicas asked for
        self.shrink = elastic_options.batch_mode(args) == "shrink"
        self.commit_every = elastic_options.commit_every(args)
        self.worker_id = config.get("PARATRAIN_ELASTIC")
        if self.replica > 1:   # a mesh: this worker's part of its replica, built again in each new world
            rebuilt = Rebuilt(self._rebuild, first=strategy.elastic_replica())
            model, optimizer = rebuilt, rebuilt.optimizer
        else:
            model, optimizer = strategy.elastic_parts()
        self.base_lrs = [g["lr"] for g in strategy.param_groups()]
        D = strategy.data_replicas
        self.sampler = ElasticSampler(job.task.train_set, seed=args.seed, global_batch=self._global_batch(D),
                                      rank=strategy.data_rank, num_replicas=D)
        resumed = getattr(job, "resumed", None) or {}
        if "elastic_sampler" in resumed:   # --resume: where the data order was, and the samples so far
            self.sampler.load_state_dict(resumed["elastic_sampler"])
        self.state = State(model=model, optimizer=optimizer, sampler=self.sampler, report=False,
                           step=job.start, epoch=self.sampler.epoch, samples=int(resumed.get("elastic_samples", 0)))
        self.state.on_reset(self._on_reset)
        self.events = []        # the run's elastic_events, the same on every rank
        self._pending = []      # events whose resume time the next step gives
        self._seen = 0          # state.events already taken into account
        self._generation = elastic_generation()[1]   # the last world whose changes are in self.events

    def _die_if_due(self, step, when):
        if self.job.failures:   # --fail RANK:STEP[:WHEN], RANK the worker id
            die_if_due(self.job.failures, self.worker_id, step, when)

    def _global_batch(self, replicas):
        return self.batch * (replicas if self.shrink else self.asked)

    def _rebuild(self, world):
        """A mesh in a new world: the task's model and the strategy made again there, the
        collectives of construction run in the same order as a joining worker's."""
        job = self.job
        chosen = strategies.STRATEGIES[job.args.strategy]
        job.task = build_task(job.args.model, seed=job.args.seed, sparse=chosen.SPARSE)
        job.strategy = chosen.make_step(job.task, job.args, job.settings)
        return job.strategy.elastic_replica()

    def run(self):
        elastic_run(self._train)(self.state)

    # ---- the steps -----------------------------------------------------------------------

    def _train(self, state):
        steps = self.job.settings.steps
        while state.step < steps:
            self.sampler.set_epoch(state.epoch)
            plan = self.sampler.plan()
            loader = torch.utils.data.DataLoader(self.job.task.train_set, batch_sampler=self.sampler)
            for mine, total, batch in zip(plan[self.sampler.rank], map(sum, zip(*plan)), loader):
                self._step(state, batch, mine, total)
                if state.step % self.commit_every == 0 and state.step < steps:   # (the end: none, a joiner leaves)
                    self._die_if_due(state.step, "commit")
                    state.commit()
                if state.step >= steps:
                    return
            state.epoch += 1

    def _step(self, state, batch, mine, total):
        job, strategy = self.job, self.job.strategy
        self._die_if_due(state.step + 1, "step")
        strategy.loss_weight = mine * strategy.data_replicas / total   # the share's weight in the step's mean
        stats = strategy.stats
        wait0, bytes0 = stats.wait_seconds, stats.bytes
        t0 = time.perf_counter()
        dt, compute, slept = job.run_step(batch)
        state.step += 1
        state.samples += total
        job.pool.taken += 1
        job.train_seconds += dt
        if self._pending:
            elastic_events.resumed(self._pending, time.time())
            if job.lead:
                for e in self._pending:
                    print(f"paratrain train: elastic: {elastic_events.describe(e)}", flush=True)
            self._pending = []
        done = state.step
        if trace.ON:
            trace.add("step", "step", "compute", t0, time.perf_counter(), {"step": done})
        if job.board_tb is not None:
            job.board_tb.step(done, dt)
        s = job.settings
        evaluation = strategy.evaluate(job.task) if done % s.eval_every == 0 or done == s.steps else None
        if job.lead:
            seconds = time.perf_counter() - job.t_start
            job.record_step(done, dt, compute, slept, stats.wait_seconds - wait0, stats.bytes - bytes0, evaluation,
                        progress=(done, state.samples / seconds if seconds > 0 else 0.0))
        if s.checkpoint_every and done % s.checkpoint_every == 0 and done < s.steps:
            job.save(done)

    # ---- after the world changed ----------------------------------------------------------

    def _on_reset(self, state):
        """Every worker, in the new world, with the commit restored: the strategy, the
        batch, the events, and who writes (collective: a joiner calls it too)."""
        job, group = self.job, world()
        self._die_if_due(state.step, "reform")
        job.strategy.regrouped(group)
        job.strategy.zero_grad()
        job.board = GroupBoard(group)
        W, D = group.world_size, job.strategy.data_replicas
        if self.shrink:   # each replica keeps its batch: the step takes less, at a learning rate scaled to it
            self.sampler.global_batch = self._global_batch(D)
            for g, lr in zip(job.strategy.param_groups(), self.base_lrs):
                g["lr"] = lr * D / self.asked
        mine = state.events[-1] if len(state.events) > self._seen else None
        self._seen = len(state.events)
        # the last survivor to know, the first (as -time), and the furthest step one had done
        agreed = torch.tensor([mine["caught_at"] if mine else 0.0, -mine["caught_at"] if mine else -float("inf"),
                               mine["at_step"] if mine and mine["at_step"] is not None else -1.0],
                              dtype=torch.float64)
        group.all_reduce(agreed, op="max")
        store, generation = elastic_generation()
        changes = {"lost": [], "joined": []}   # every world formed since ours (one may come and go unjoined)
        for g in range(self._generation + 1, generation + 1):
            for kind, who in elastic_rendezvous.changes(store, g).items():
                changes[kind] += who
        self._generation = generation
        new = elastic_events.from_changes(changes, caught_at=float(agreed[0]), first_caught=-float(agreed[1]),
                                          at_step=int(agreed[2]), commit_step=state.step, world_size=W)
        # rank 0's history and new events for everyone (a joiner has neither, and may write one day)
        said = json.dumps({"events": self.events + new, "new": len(new)}) if group.rank == 0 else None
        told = json.loads(broadcast_text(group, said, 0))
        self.events = told["events"]
        self._pending = self.events[len(self.events) - told["new"]:]
        self._take_over_the_log(state.step, group.rank == 0)

    def _take_over_the_log(self, commit_step, lead):
        job = self.job
        if job.log is not None:
            job.log.close()
            job.log = None
        job.lead = lead
        if lead:
            drop_rows_after(os.path.join(job.run_dir, METRICS_FILE), commit_step)
            job.log = MetricsLog(job.run_dir)
            if job.board_tb is not None:
                job.board_tb.take_lead()
        job.progress = ProgressReporter(job.settings.steps, enabled=lead)

    def checkpoint_fields(self):
        """What a checkpoint adds for an elastic run: where the data order is (--resume)."""
        return {"elastic_sampler": self.sampler.state_dict(), "elastic_samples": self.state.samples}

    # ---- the summary -------------------------------------------------------------------------

    def summary_fields(self):
        """summary.json's elastic fields (rank 0, at the end)."""
        loop = time.perf_counter() - self.job.t_start
        return {"elastic": {"min_workers": self.job.args.min_workers,
                            "max_workers": self.job.args.max_workers or self.job.args.workers,
                            "batch": "shrink" if self.shrink else "keep", "commit_every": self.commit_every,
                            "global_batch": self.sampler.global_batch, "commits": self.state.commits},
                "workers_at_start": self.job.args.workers,
                "elastic_events": [{k: v for k, v in e.items() if not k.startswith("_")} for e in self.events],
                "samples_per_s": self.state.samples / loop if loop > 0 else 0.0}
