"""Worker: pt.pipeline.split + pt.Pipeline against one process on the whole batch.

Every rank builds the model twice from the same seed: once whole, as the
reference (one process, the whole batch, one backward), once cut into this
rank's stage. After a pipeline step the loss, and the gradient of every
parameter this rank holds, must equal the reference's (1e-5 relative);
a second step after an SGD update checks that state carries over.

    pipeline.py equiv MODELS SCHEDULE MICROBATCHES [--virtual V] [--points a,b] [--by params|time] [--dp D] [--slow-last S]

MODELS and MICROBATCHES are comma lists, every pair is run in turn. MODEL: mlp (nn.Sequential, 7 layers: uneven stages), skip (a skip connection
that jumps over a stage), gpt (the gpt task's model, cut by torch.fx).

    pipeline.py bad           each bad input (BAD_CASES) must raise a clear error on every rank
    pipeline.py die           the middle of 3 stages dies: the other two raise PeerError naming it
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.train.models import GPT

BATCH = 3   # samples per micro-batch
torch.set_default_dtype(torch.float64)


class Skip(nn.Module):
    """x -> a -> b -> c + a -> d: the value of ``a`` crosses the stage holding b."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(6, 10), nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 3)

    def forward(self, x):
        a = torch.tanh(self.a(x))
        return self.d(torch.tanh(self.c(torch.tanh(self.b(a))) + a))


def build(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                             nn.Tanh(), nn.Linear(16, 3))
    if kind == "skip":
        return Skip()
    return GPT(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def data(kind, step, batch):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "gpt":
        x = torch.randint(0, 32, (batch, 8), generator=g)
        return x, torch.randint(0, 32, (batch, 8), generator=g)
    return torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)


def loss_fn(kind):
    if kind == "gpt":
        return lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def equiv(args):
    world = pt.init()
    dp = args.dp
    pp = world.world_size // dp
    # ranks r*pp .. r*pp+pp-1 form pipeline r; rank i of every pipeline joins DP group i
    pipes = [pt.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(dp)]
    dps = [pt.new_group(list(range(i, world.world_size, pp))) for i in range(pp)] if dp > 1 else [None] * pp
    groups = (pipes[world.rank // pp], dps[world.rank % pp], world.rank // pp, pp, dp)
    for schedule in args.schedule.split(","):   # several schedules in one launch: one start-up
        for model in args.model.split(","):
            for m in args.microbatches.split(","):
                one(world, args, groups, model, int(m), schedule)
    pt.destroy()


def one(world, args, groups, kind, microbatches, schedule):
    group, dp_group, replica, pp, dp = groups
    ref = build(kind)
    model = build(kind)
    names = {id(q): n for n, q in model.named_parameters()}
    kw = dict(group=group, stages=pp, virtual=args.virtual, verbose=group.rank == 0 and replica == 0)
    if args.points:
        kw["split_points"] = args.points.split(",")
    elif args.by == "time":
        kw["sample"] = data(kind, 0, BATCH * microbatches)[0]
    else:
        kw["by"] = args.by
    stage = pt.pipeline.split(model, **kw)
    loss = loss_fn(kind)
    if args.slow_last:
        loss = _slowed(loss, args.slow_last)
    pipe = pt.Pipeline(stage, group=group, microbatches=microbatches, schedule=schedule,
                       loss_fn=loss, dp_group=dp_group)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    held = [q for q in stage.parameters()]
    assert held, "this rank holds no parameters"
    for step in range(2):
        batch = BATCH * microbatches
        x, y = data(kind, step, batch * dp)
        ref_opt.zero_grad()
        ref_loss = loss_fn(kind)(ref(x), y)
        ref_loss.backward()
        mine = slice(replica * batch, (replica + 1) * batch)
        with _first_gradient_sends(stage) as first_sends:
            loss = pipe.step(x[mine] if stage.is_first else None, y[mine] if stage.is_last else None)
        if args.send_before_weights:
            sending = sorted(ch.index for ch in stage.chunks if ch.index > 0)
            assert sorted(first_sends) == sending, (first_sends, sending)
            assert all(first_sends.values()), f"a weight gradient was computed before the first send: {first_sends}"
        assert abs(float(loss) - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), (step, float(loss), ref_loss.item())
        for q in held:
            name = names[id(q)]
            r = ref_params[name].grad
            assert q.grad is not None, f"step {step}: {name} got no gradient"
            assert rel(q.grad, r) <= 1e-5, f"step {step}: gradient of {name} off by {rel(q.grad, r):.2e}"
        check_activation_memory(pipe, group, schedule, microbatches)
        if args.slow_last and stage.is_first:
            check_weights_filled_the_wait(pipe, microbatches)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
    print(f"pipeline {kind} {schedule} m={microbatches} passed on rank {world.rank}", flush=True)


class _first_gradient_sends:
    """Records, for each stage this rank holds, whether its nn.Linear weights still had
    no gradient when it first sent an input gradient back in a step (gradients start
    the step as None: zero_grad sets them so)."""

    def __init__(self, stage):
        from paratrain.parallel.pipeline import transport
        self.transport, self.stage, self.seen = transport, stage, {}

    def __enter__(self):
        send = self.original = self.transport.send_gradients
        chunks = {ch.index: ch for ch in self.stage.chunks}

        def recording(group, grads, dst, s, works):
            if s not in self.seen:
                linears = [m for m in chunks[s].modules() if isinstance(m, nn.Linear)]
                self.seen[s] = all(m.weight.grad is None for m in linears) and bool(linears)
            return send(group, grads, dst, s, works)
        self.transport.send_gradients = recording
        return self.seen

    def __exit__(self, *exc):
        self.transport.send_gradients = self.original
        return False


def _slowed(fn, seconds):
    import time

    def slow(out, y):
        time.sleep(seconds)
        return fn(out, y)
    return slow


def check_weights_filled_the_wait(pipe, m):
    """The first stage's executed order: every W once, after its own B; and, the last
    stage being slow, every W but the last micro-batch's run while the last B's gradient
    was on its way (zb-h1's static list leaves some after it: W1 at p=2, m=3)."""
    ran = [(kind, mb) for kind, mb, *_ in pipe.timeline]
    assert sorted(mb for kind, mb in ran if kind == "W") == list(range(m)), ran
    for mb in range(m):
        assert ran.index(("B", mb)) < ran.index(("W", mb)), ran
    after_last_b = ran[ran.index(("B", m - 1)):]
    assert [x for x in after_last_b if x[0] == "W"] == [("W", m - 1)], ran


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:   # control flow on a tensor: fx cannot trace it
            return self.a(x)
        return self.b(x)


BAD_CASES = ("stages", "untraceable", "point", "m0", "schedule", "batch", "disagree", "targets")


def check_activation_memory(pipe, group, schedule, m):
    """GPipe holds every micro-batch's activations at its peak; 1F1B at most p - r of them
    on rank r (equal micro-batches save equal bytes)."""
    saved = pipe.saved_per_forward
    if len(set(saved)) != 1 or schedule in ("interleaved", "zb-h1"):
        return
    held = {"gpipe": m, "1f1b": min(group.world_size - group.rank, m)}[schedule]
    assert pipe.peak_activation_bytes == held * saved[0], (schedule, pipe.peak_activation_bytes, saved)


def bad(args):
    """Every case must raise ValueError on every rank, and the next case still runs."""
    world = pt.init()
    for case in BAD_CASES:
        try:
            if case == "stages":
                pt.pipeline.split(nn.Sequential(nn.Linear(6, 3)), group=world, verbose=False)
            elif case == "untraceable":
                pt.pipeline.split(Branchy(), group=world, verbose=False)
            elif case == "point":
                pt.pipeline.split(build("gpt"), group=world, split_points=["blocks.9"], verbose=False)
            else:
                stage = pt.pipeline.split(build("mlp"), group=world, by="params", verbose=False)
                m = {"m0": 0, "batch": 3, "disagree": world.rank + 2}.get(case, 2)
                schedule = "2f2b" if case == "schedule" else "1f1b"
                pipe = pt.Pipeline(stage, group=world, microbatches=m, schedule=schedule, loss_fn=F.cross_entropy)
                x, y = data("mlp", 0, 8)
                pipe.step(x if stage.is_first else None, y if stage.is_last and case != "targets" else None)
        except ValueError as e:
            print(f"case {case} refused on rank {world.rank}: {' '.join(str(e).split())}", flush=True)
        else:
            print(f"case {case} accepted on rank {world.rank}", flush=True)
    pt.destroy()


def die(args):
    """The middle stage dies before the step: the stages before and after it wait on
    it and must raise on their own, naming it, long before the timeout."""
    import os
    world = pt.init()
    stage = pt.pipeline.split(build("mlp"), group=world, by="params", verbose=False)
    pipe = pt.Pipeline(stage, group=world, microbatches=2, schedule="1f1b", loss_fn=F.cross_entropy)
    world.barrier()
    if world.rank == 1:
        os._exit(1)
    x, y = data("mlp", 0, 8)
    try:
        pipe.step(x if stage.is_first else None, y if stage.is_last else None)
    except pt.PeerError as e:
        print(f"rank {world.rank} caught PeerError: {e}", flush=True)
        os._exit(0)
    print(f"rank {world.rank} finished the step", flush=True)
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("equiv")
    e.add_argument("model")
    e.add_argument("schedule")
    e.add_argument("microbatches")
    e.add_argument("--virtual", type=int, default=1)
    e.add_argument("--points", default=None)
    e.add_argument("--by", default="params")
    e.add_argument("--dp", type=int, default=1)
    e.add_argument("--send-before-weights", action="store_true",
                   help="check that every stage past the first sends its input gradient before it has "
                        "computed any of its linear layers' weight gradients")
    e.add_argument("--slow-last", type=float, default=0.0,
                   help="seconds the last stage's loss sleeps per micro-batch: the first stage then waits for "
                        "every gradient of its tail, and zb-h1 must fill the waits with W's")
    sub.add_parser("bad")
    sub.add_parser("die")
    args = p.parse_args()
    return {"equiv": equiv, "bad": bad, "die": die}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
