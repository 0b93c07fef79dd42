"""One worker of the pipeline benchmark: every engine in this process, round by round.

Each engine is a full training step (forward, backward, Adam) of the same GPT
(same initial weights, same batch) cut into the same two stages at
``blocks.<n/2>``, run by:

- ``single``: one process, the whole model, on rank 0 while the other rank sleeps;
- ``pt/<schedule>/m<m>``: pt.Pipeline with that schedule and m micro-batches
  (``interleaved``: each rank holds two of four stages);
- ``torch/<schedule>/m<m>``: torch.distributed.pipelining's PipelineStage and
  ScheduleGPipe / Schedule1F1B over Gloo, on the very same stage modules;
- ``alone/m<m>``: each stage's compute alone, both at once (StagesAlone): the
  ceiling of any schedule on this machine.

Rounds are interleaved: each round times ``steps`` steps of every engine, in an
order that rotates by one each round, after a barrier; a round's time is the
slowest rank's. paratrain's engines also record each round's bubble (the
timeline of its last step, every stage's) and each stage's peak activation
memory (Pipeline.peak_activation_bytes). Rank 0 writes everything to JSON.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

from . import rounds
from .gloo_group import init_gloo


def build_gpt(cfg):
    from ..train.models import GPT
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=cfg["context"], n_layer=cfg["layers"], n_head=cfg["heads"],
               n_embd=cfg["width"])


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class Single:
    """``single``: one process, the whole model, timed in the same rounds as the
    pipelines: rank 0 trains it while the other ranks sleep in the next barrier, so
    the baseline sees the machine the engines beside it see, round by round, not as
    it was minutes before them (on a shared host a machine's speed drifts)."""

    def __init__(self, cfg, group):
        self.name, self.barrier, self.bubble = "single", group.barrier, None
        self.model = build_gpt(cfg) if group.rank == 0 else None
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4) if self.model is not None else None

    def step(self, x, y):
        if self.model is None:
            return
        lm_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()

    def after_round(self):
        pass


def _stage(cfg, group, virtual=1):
    import paratrain as pt
    total = group.world_size * virtual
    per = cfg["layers"] // total
    points = [f"blocks.{per * k}" for k in range(1, total)]
    return pt.pipeline.split(build_gpt(cfg), group=group, split_points=points, virtual=virtual, verbose=False)


class Ours:
    def __init__(self, name, cfg, group, schedule, m):
        import paratrain as pt
        from ..parallel.pipeline import timeline
        self.name, self.group, self.timeline = name, group, timeline
        virtual = 2 if schedule == "interleaved" else 1
        self.stage = _stage(cfg, group, virtual)
        self.pipe = pt.Pipeline(self.stage, group=group, microbatches=m, schedule=schedule, loss_fn=lm_loss)
        self.opt = torch.optim.Adam(self.stage.parameters(), lr=1e-4)
        self.barrier, self.bubble, self.peak_mb = group.barrier, [], None

    def step(self, x, y):
        self.pipe.step(x if self.stage.is_first else None, y if self.stage.is_last else None)
        self.opt.step()
        self.opt.zero_grad()

    def after_round(self):
        self.timelines = self.timeline.gather(self.group, self.pipe.timeline)
        self.bubble.append(self.timeline.bubble(self.timelines))
        peak = torch.zeros(self.group.world_size, dtype=torch.float64)
        self.group.all_gather(peak, torch.tensor([self.pipe.peak_activation_bytes / 1e6], dtype=torch.float64))
        self.peak_mb = peak.tolist()


class Torch:
    """torch.distributed.pipelining on our stage module (one chunk: a GraphModule
    taking and returning one tensor, as PipelineStage wants)."""

    def __init__(self, name, cfg, group, schedule, m, batch):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.name = name
        stage = _stage(cfg, group)
        self.first, self.last = stage.is_first, stage.is_last
        module = _OneTensor(stage.chunks[0])
        self.pipe_stage = PipelineStage(module, group.rank, group.world_size, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(self.pipe_stage, n_microbatches=m, loss_fn=lm_loss)
        self.opt = torch.optim.Adam(module.parameters(), lr=1e-4)
        self.barrier, self.bubble = dist.barrier, None

    def step(self, x, y):
        if self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y)
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad()

    def after_round(self):
        pass


class StagesAlone:
    """``alone/m<m>``: no pipeline. Each rank runs its own stage's m forwards and backwards
    back to back on inputs it already holds (no send, no wait), then Adam: what the two
    stages' compute costs while they share the machine. No schedule of these two stages
    can be faster, so its speed against one process is the ceiling, where the formula
    2m/(m+1) assumes each stage takes half a one-process step. The inputs of a later stage
    are one micro-batch's real activations, sent once by the stage before it in the
    first (untimed) step."""

    def __init__(self, name, cfg, group, m):
        self.name, self.group, self.m = name, group, m
        self.stage = _stage(cfg, group)
        self.opt = torch.optim.Adam(self.stage.parameters(), lr=1e-4)
        self.barrier, self.bubble, self.inputs = group.barrier, None, None

    def _exchange(self, x):
        from ..parallel.pipeline import transport
        chunk, works = self.stage.chunks[0], []
        s = chunk.index
        if s == 0:
            self.inputs = (x.chunk(self.m)[0],)
        else:
            self.inputs = transport.recv_activations(self.group, self.group.rank - 1, s)
        if not self.stage.is_last:
            with torch.no_grad():
                out = chunk(*self.inputs)
            transport.send_activations(self.group, out if isinstance(out, tuple) else (out,), self.group.rank + 1,
                                       s + 1, works)
        for work, _ in works:
            work.wait()
        self.inputs = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in self.inputs)

    def step(self, x, y):
        if self.inputs is None:
            self._exchange(x)
        chunk = self.stage.chunks[0]
        for ys in y.chunk(self.m):
            out = chunk(*self.inputs)
            if self.stage.is_last:
                (lm_loss(out, ys) / self.m).backward()
            else:
                outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        self.opt.step()
        self.opt.zero_grad()

    def after_round(self):
        pass


class _OneTensor(nn.Module):
    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        out = self.chunk(x)
        return out[0] if isinstance(out, tuple) else out


def make_engines(cfg, group):
    engines = []
    for name in cfg["engines"]:
        if name == "single":
            engines.append(Single(cfg, group))
            continue
        if name.startswith("alone/"):
            engines.append(StagesAlone(name, cfg, group, int(name.split("/")[1].lstrip("m"))))
            continue
        owner, schedule, m = name.split("/")
        m = int(m.lstrip("m"))
        if owner == "pt":
            engines.append(Ours(name, cfg, group, schedule, m))
        else:
            init_gloo(group, cfg["timeout"])
            engines.append(Torch(name, cfg, group, schedule, m, cfg["batch"]))
    return engines


def main(cfg_path):
    def report(engines, cfg, x, y):
        return {"bubble": {e.name: e.bubble for e in engines if e.bubble},
                "peak_activation_mb": {e.name: e.peak_mb for e in engines if getattr(e, "peak_mb", None)},
                "timelines": {e.name: e.timelines for e in engines if getattr(e, "timelines", None)}}
    rounds.serve_gpt(cfg_path, make_engines, report, after=lambda e: e.after_round())

if __name__ == "__main__":
    sys.exit(main(sys.argv[-1]))
