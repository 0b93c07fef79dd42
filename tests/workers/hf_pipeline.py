"""Worker: Hugging Face models cut by pt.pipeline.split and trained by pt.Pipeline,
against one process on the whole batch, in float64.

Every rank builds each model twice from one seed: the reference (one process,
the whole batch) and the model it cuts. Each case is split once, then run under
each of its schedules from the same starting weights: every step's loss and
every gradient this rank holds must equal the reference's within TOL (relative
to max(1, |reference|)), and so must the weights after STEPS Adam steps. A
weight two stages share (tied embeddings) is held by both, and both copies
are checked.

    hf_pipeline.py equiv [CASE,...]     every case of CASES (default: all)
"""
import argparse
import dataclasses
import sys

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.train import hf_models
from paratrain.train.models import GPT
from unnamed_family import qwen2

torch.set_default_dtype(torch.float64)
TOL, STEPS, M, MB, SEQ, VOCAB = 1e-10, 3, 4, 2, 8, 64
SIZES = dict(vocab=VOCAB, positions=16, width=32, layers=2, heads=4, kv_heads=2, mlp=64)
ALL = ("1f1b", "gpipe", "zb-h1")


def logits_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def field_loss(get):
    return lambda out, y: logits_loss(get(out), y)


def hf(family, **kw):
    torch.manual_seed(0)
    return hf_models.build(family, **SIZES, **kw)


def seeded(build, *args):
    torch.manual_seed(0)
    return build(*args)


def bare_gpt2():
    model = hf("gpt2", tied=False)
    model.config.use_cache = False     # the advice split gives for a model that returns its cache
    return model


def blocks_in_sequence():
    """GPT-2's own modules in an nn.Sequential: its blocks are not traceable by torch.fx,
    so split must cut between the children without looking inside them."""
    model = hf("gpt2")
    t = model.transformer
    return nn.Sequential(t.wte, *t.h, t.ln_f, model.lm_head)


class Returning(nn.Module):
    """A GPT whose forward returns a dict or a tuple holding a None."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.gpt = kind, GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)

    def forward(self, ids):
        logits = self.gpt(ids)
        if self.kind == "dict":
            return {"logits": logits, "mean": logits.mean(-1)}
        return logits, None


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    nothing: torch.Tensor = None


class ReturningDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Returning("dict")

    def forward(self, ids):
        return Out(self.inner(ids)["logits"])


# name: (build, split arguments, schedules, loss_fn, what the last stage's first layer must be)
CASES = {
    "gpt2": (lambda: hf_models.LogitsOf(hf("gpt2")), dict(by="params"), ALL, logits_loss,
             "hf.transformer.h.1"),
    "gpt2-untied": (bare_gpt2, dict(split_points=["transformer.h.1"]), ALL, field_loss(lambda o: o.logits),
                    "transformer.h.1"),
    "bert": (lambda: hf_models.LogitsOf(hf("bert")), dict(split_points=["hf.bert.encoder.layer.1"]), ALL,
             logits_loss, "hf.bert.encoder.layer.1"),
    "llama": (lambda: hf_models.LogitsOf(hf("llama")), dict(by="params"), ALL, logits_loss, "hf.model.layers.1"),
    "qwen2": (lambda: hf_models.LogitsOf(seeded(qwen2, SIZES)), dict(by="params"), ("1f1b",), logits_loss,
              "hf.model.layers.1"),   # a family paratrain names nowhere
    "sequential": (blocks_in_sequence, dict(by="time"), ("1f1b", "zb-h1"), logits_loss, None),
    "interleaved": (blocks_in_sequence, dict(by="params", virtual=2), ("interleaved",), logits_loss, None),
    "dict": (lambda: Returning("dict"), dict(split_points=["gpt.blocks.1"]), ("1f1b",),
             field_loss(lambda o: o["logits"]), "gpt.blocks.1"),
    "tuple-none": (lambda: Returning("tuple"), dict(split_points=["gpt.blocks.1"]), ("1f1b",),
                   field_loss(lambda o: o[0]), "gpt.blocks.1"),
    "dataclass": (ReturningDataclass, dict(split_points=["inner.gpt.blocks.1"]), ("1f1b",),
                  field_loss(lambda o: o.logits), "inner.gpt.blocks.1"),
}


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (M * MB, SEQ), generator=g),
            torch.randint(0, VOCAB, (M * MB, SEQ), generator=g))


def off(a, b):
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def run_case(world, name):
    build, kw, schedules, loss_fn, last_starts = CASES[name]
    ref, model = build(), build()
    sample = data(0)[0][:MB]
    stage = pt.pipeline.split(model, group=world, sample=sample, verbose=False, **kw)
    if last_starts is not None:
        line = next(x for x in stage.report.splitlines() if x.startswith("  stage 1:"))
        assert line.startswith(f"  stage 1: {last_starts}"), stage.report
    tied = [n for n, _, _ in stage.tied]
    names = {id(q): n for n, q in model.named_parameters()}
    held = list(stage.parameters())
    start = {n: q.detach().clone() for n, q in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    for schedule in schedules:
        with torch.no_grad():
            for n, q in model.named_parameters():
                q.copy_(start[n])
                ref_params[n].copy_(start[n])
        pipe = pt.Pipeline(stage, group=world, microbatches=M, schedule=schedule, loss_fn=loss_fn)
        opt = torch.optim.Adam(held, lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for step in range(STEPS):
            x, y = data(step)
            ref_opt.zero_grad()
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            loss = pipe.step(x if stage.is_first else None, y if stage.is_last else None)
            assert abs(float(loss) - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item())), \
                (name, schedule, step, float(loss), ref_loss.item())
            for q in held:
                assert q.grad is not None, f"{name} {schedule} step {step}: {names[id(q)]} got no gradient"
                err = off(q.grad, ref_params[names[id(q)]].grad)
                assert err <= TOL, f"{name} {schedule} step {step}: gradient of {names[id(q)]} off by {err:.1e}"
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.step()
        for q in held:
            err = off(q.detach(), ref_params[names[id(q)]].detach())
            assert err <= TOL, f"{name} {schedule}: {names[id(q)]} off by {err:.1e} after {STEPS} Adam steps"
        if name in ("dict", "tuple-none", "gpt2-untied"):
            check_forward(pipe, stage, ref, name)
        print(f"hf pipeline {name} {schedule} passed on rank {world.rank} (tied: {', '.join(tied) or 'none'})",
              flush=True)
    if name == "dataclass":
        try:
            pipe.forward(data(0)[0] if stage.is_first else None)
        except ValueError as e:
            print(f"hf pipeline dataclass forward refused on rank {world.rank}: {' '.join(str(e).split())}",
                  flush=True)


def check_forward(pipe, stage, ref, name):
    """Pipeline.forward gives every rank the model's output, in its structure (the
    reference's: this rank's copy of the model has only its own stage trained)."""
    x = data(9)[0]
    got = pipe.forward(x if stage.is_first else None)
    with torch.no_grad():
        want = ref(x)
    if name == "dict":
        assert set(got) == {"logits", "mean"} and off(got["mean"], want["mean"]) <= TOL
        got, want = got["logits"], want["logits"]
    elif name == "tuple-none":
        assert isinstance(got, tuple) and len(got) == 2 and got[1] is None, got
        got, want = got[0], want[0]
    else:
        assert type(got) is type(want), (type(got), type(want))
        got, want = got.logits, want.logits
    assert off(got, want) <= TOL, off(got, want)


def equiv(args):
    world = pt.init()
    for name in (args.cases.split(",") if args.cases else CASES):
        run_case(world, name)
    pt.destroy()


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("equiv")
    e.add_argument("cases", nargs="?", default="")
    args = p.parse_args()
    return {"equiv": equiv}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
