"""What one process training a built-in model holds, measured: ``python -m paratrain.simulate.footprint gpt 16``.

``paratrain plan`` predicts a worker's memory as what every layout shares
plus what each layout changes. What they share (the runtime's scratch: the
kernels' caches and buffers, tens of MiB here; the data; the evaluation) no
formula knows, so it is measured: a fresh process, as a worker starts
(torch loaded, nothing run), builds the task, trains a few steps with the
task's optimizer and evaluates once, while train/memory.py's sampler
watches the heap. It prints four numbers (MiB above the start): ``task``
(data and model built), ``steady`` (between steps: the state and the
runtime's scratch), ``train_peak`` and ``peak`` (with the evaluation, which
rank 0 runs); ``train_peak - steady`` is what backward keeps (activations)
at this batch, measured, which plan scales to each layout's micro-batches,
stages and tensor cut. For a model paratrain train --tp cuts, also
``cut_evaluation_share``: the evaluation's heap through the model cut two
ways (here.ComputeOnlyGroup) against the whole one's.

A fresh process because the heap of one that has trained already holds the
scratch this measures; one that has imported what compare's and plan's
workers start with (launch/forkserver.py's TRAINING_PRELOAD: matplotlib's import alone
allocates some 20 MiB a first training step would), since what was there
before a worker began is not counted.
"""
import functools
import json
import subprocess
import sys
from dataclasses import dataclass

from .memory import MB

STEPS = 5
CUT = 2   # the tensor cut the evaluation is measured at


def measure(model, batch, seed=0):
    """{"task_mb", "steady_mb", "train_peak_mb", "peak_mb"} for built-in ``model`` at ``batch``
    samples, in this process."""
    import torch

    from ..train.memory import PeakMemory, heap_mb
    from ..train.tasks import build_task
    from .here import cut_copy   # (imported before the heap's baseline)
    from .timing import training_steps
    torch.set_num_threads(1)
    memory = PeakMemory()
    task = build_task(model, seed=seed)
    built = heap_mb() - memory.heap_before
    steps = training_steps(task, batch, copied=False, sample=memory.sample)   # its optimizer lives on below
    for _ in range(STEPS):
        next(steps)
    steady = heap_mb() - memory.heap_before
    train_peak = memory.heap_peak - memory.heap_before
    evaluation = memory.added_by(lambda: task.evaluate(task.model))
    peak = memory.report()["peak_memory_mb"]
    got = {"task_mb": built, "steady_mb": steady, "train_peak_mb": train_peak, "peak_mb": peak}
    if task.tensor_plan is not None:   # the evaluation through the model cut for --tp 2, against the whole
        cut = cut_copy(task, CUT)
        memory = PeakMemory()
        got["cut_evaluation_share"] = memory.added_by(lambda: task.evaluate(cut)) / evaluation \
            if evaluation > 0 else 1.0
        memory.report()
    return got


@dataclass(frozen=True)
class Footprint:
    """A worker's memory in parts: ``shared`` bytes every layout holds (the runtime's
    scratch, the data), the ``activations`` backward keeps for the whole model at the
    measured ``batch``, and what an ``evaluation`` (between steps, rank 0) adds; a layout
    adds its own training state, and peaks at the larger of its activations and the
    evaluation (0 for a run that does not evaluate). ``cut_evaluation_share``: what an
    evaluation through the model cut across CUT tensor-parallel workers holds, against the
    whole model's (every worker of a tensor group evaluates its share)."""
    shared: float
    activations: float
    evaluation: float
    batch: int
    cut_evaluation_share: float = 1.0

    def evaluation_at(self, tp):
        """The evaluation of one worker of a tp-wide tensor group: a part of it is cut (the
        heads', the MLP's outputs), the rest is whole (embeddings, norms, the loss's
        inputs); the two measured points, whole and cut CUT ways, say which is which."""
        if tp <= 1:
            return self.evaluation
        cut = min(1.0, max(0.0, (1 - self.cut_evaluation_share) * CUT / (CUT - 1)))   # divides by tp
        return self.evaluation * (1 - cut + cut / tp)

    def peak(self, state, activations, tp=1):
        return self.shared + state + max(activations, self.evaluation_at(tp))


def footprint(model, batch, state_bytes, seed=0):
    """The Footprint of built-in ``model`` at ``batch`` samples, measured here; ``state_bytes``
    the training state one process holds (memory.state_bytes of dp on one worker), which
    its heap between steps also holds. None where the heap cannot be read."""
    got = measured(model, batch, seed)
    if got is None:
        return None
    steady = got["steady_mb"] * MB
    return Footprint(steady - state_bytes, max(0.0, got["train_peak_mb"] * MB - steady),
                     max(0.0, got["peak_mb"] * MB - steady), batch, got.get("cut_evaluation_share", 1.0))


@functools.lru_cache(maxsize=None)
def measured(model, batch, seed=0):
    """``measure`` run in a fresh process (see above); None where the heap cannot be read."""
    res = subprocess.run([sys.executable, "-m", "paratrain.simulate.footprint", model, str(batch), str(seed)],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"measuring {model}'s memory failed:\n{res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return None if out["peak_mb"] is None else out


if __name__ == "__main__":
    import importlib

    from ..launch.forkserver import TRAINING_PRELOAD
    from ..train.memory import heap_mb
    for name in TRAINING_PRELOAD:
        importlib.import_module(name)
    if heap_mb() is None:
        print(json.dumps({"peak_mb": None}))
    else:
        print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)))
