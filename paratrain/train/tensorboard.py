"""``paratrain train --tensorboard``: the run's numbers as TensorBoard scalars, in ``runs/<id>/tb/``.

Written through ``torch.utils.tensorboard``'s SummaryWriter. Rank 0 writes the job's
scalars to ``tb/job``: the loss, the evaluation metrics, samples/s, and the
communication time and bytes of each step. Every rank writes its own step time to
``tb/rank-<R>``. TensorBoard shows each folder as a run, so the ranks' step times
share one chart.

    tensorboard --logdir runs/<id>/tb

TensorBoard is an optional extra (``pip install -e '.[tensorboard]'``).
"""
import importlib.util
import os

INSTALL = "pip install -e '.[tensorboard]' (or pip install tensorboard)"


def installed():
    return importlib.util.find_spec("tensorboard") is not None


def missing():
    """Why --tensorboard cannot work here, or None."""
    if not installed():
        return f"--tensorboard needs the tensorboard package, which is not installed: {INSTALL}"
    return None


class Board:
    """This worker's writers: its own step time, and on rank 0 the job's scalars."""

    def __init__(self, run_dir, rank, lead):
        from torch.utils.tensorboard import SummaryWriter
        self.root = os.path.join(run_dir, "tb")
        self.mine = SummaryWriter(os.path.join(self.root, f"rank-{rank}"))
        self.job = SummaryWriter(os.path.join(self.root, "job")) if lead else None

    def take_lead(self):
        """This worker is rank 0 now (an elastic job lost its rank 0): it writes the job's scalars."""
        if self.job is None:
            from torch.utils.tensorboard import SummaryWriter
            self.job = SummaryWriter(os.path.join(self.root, "job"))

    def step(self, step, seconds):
        self.mine.add_scalar("step_time_s", seconds, step)

    def record(self, step, row, samples_per_s, evaluation=None):
        """Rank 0: one step's line of metrics.jsonl (and its evaluation, if one ran), as scalars."""
        w = self.job
        w.add_scalar("loss", row["loss"], step)
        w.add_scalar("samples_per_s", samples_per_s, step)
        w.add_scalar("comm/wait_s", row["comm_wait_seconds"], step)
        w.add_scalar("comm/bytes", row.get("bytes", 0), step)
        for key, value in (evaluation or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                w.add_scalar(f"eval/{key}", value, step)

    def close(self):
        for w in (self.mine, self.job):
            if w is not None:
                w.close()
