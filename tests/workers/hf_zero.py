"""Worker: pt.DataParallel, and pt.ZeRO stages 1-3, on Hugging Face GPT-2 (tied and untied), BERT and Llama,
and on models whose blocks return a dict, a dataclass, a tuple with None in it, or an
object no walk opens, all equal to one process on the global batch.

float64 throughout, so "equal" is 1e-10 relative to max(1, |reference|): the loss
(averaged over the ranks), the global gradient norm, this rank's chunk of every
unit's averaged gradient against the same chunk of the reference's, and every
parameter after 3 Adam steps (eps 1e-6: a gradient that is zero but for rounding,
as a key projection's bias has, does not become a full step either way). Then
stage 3's bytes per rank against the paper's 16P/N (in float64 32P/N: what a rank
holds after backward is its chunks, their gradients and Adam's moments, exactly;
inside a block, that plus the root and the block gathered), a full checkpoint
of a tied model (both names in the state dict) resumed at another stage, and
Llama with activation checkpointing (reentrant and not).
"""
import copy
import dataclasses
import sys

import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.train import hf_models
from unnamed_family import qwen2

TOL = 1e-10
STEPS = 3
SIZES = dict(vocab=96, positions=16, width=32, layers=2, heads=4, kv_heads=2, mlp=64)
CASES = [("gpt2", True), ("gpt2", False), ("bert", None), ("llama", None)]
ADAM = dict(lr=1e-3, eps=1e-6)
MEASURED = []   # stage 3's parameter bytes inside a block, one a step


def close(got, want, what):
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= TOL * max(1.0, float(want.abs().max())), f"{what} off by {err:.3e}"


def tokens(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, SIZES["vocab"], (2, SIZES["positions"]), generator=gen)


def hf_loss(family):
    def loss(model, ids):
        logits = model(input_ids=ids).logits
        if family == "bert":   # the ids themselves: enough to reach every parameter
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return loss


def backward_beside_one_process(g, model, ref, loss_fn, k, what):
    """Step k's backward on this rank's batch and on one process's (every rank's batch):
    the loss averaged over the ranks must be one process's."""
    loss = loss_fn(model, tokens(g.rank, k))
    loss.backward()
    ref_loss = loss_fn(ref, torch.cat([tokens(r, k) for r in range(g.world_size)]))
    ref_loss.backward()
    mean = loss.detach().reshape(1).clone()
    g.all_reduce(mean, op="avg")
    close(mean, ref_loss.detach().reshape(1), f"{what}: loss")


def equal_to_one_process(g, build, loss_fn, stage, what, inside=None):
    """3 Adam steps of pt.ZeRO (each rank its own batch) beside one process on both batches.
    ``inside(engine, step)`` runs in the middle of each ZeRO forward (stage 3's memory)."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    engine = pt.ZeRO(model, torch.optim.Adam, stage=stage, group=g, **ADAM)
    ref_opt = torch.optim.Adam(ref.parameters(), **ADAM)
    by_name = dict(ref.named_parameters())
    for k in range(STEPS):
        if inside is not None:
            inside(engine, k)
        backward_beside_one_process(g, engine, ref, loss_fn, k, f"{what} stage {stage} step {k}")
        norm = engine.clip_grad_norm_(float("inf"))   # (stage 1: reduces the gradients into the chunks)
        ref_norm = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in ref.parameters()]))
        close(norm.double(), ref_norm, f"{what} stage {stage} step {k}: gradient norm")
        for u in engine.units:
            want = u.flat_of([by_name[name].grad for name, _ in u.params])[g.rank * u.chunk:(g.rank + 1) * u.chunk]
            close(u.shard.grad, want, f"{what} stage {stage} step {k}: gradient chunk of {u.name}")
        engine.step()
        engine.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = engine.full_state_dict(), ref.state_dict()
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for name in want:
        close(got[name], want[name], f"{what} stage {stage} after {STEPS} steps: {name}")
    return engine, ref, ref_opt


def data_parallel_cases(g):
    """pt.DataParallel on each family, as the baseline the other strategies are held to:
    the loss, every averaged gradient and the parameters after 3 Adam steps equal to one
    process on the global batch (a tied weight's gradient is both uses' sum)."""
    for family, tied in CASES:
        what = f"DataParallel {family}" + ("" if tied is None else " tied" if tied else " untied")
        torch.manual_seed(0)
        model = hf_models.build(family, tied=tied, **SIZES)
        ref = copy.deepcopy(model)
        dp = pt.DataParallel(model, group=g)
        opt, ref_opt = torch.optim.Adam(dp.parameters(), **ADAM), torch.optim.Adam(ref.parameters(), **ADAM)
        loss_fn = hf_loss(family)
        for k in range(STEPS):
            backward_beside_one_process(g, dp, ref, loss_fn, k, f"{what} step {k}")
            for (name, q), r in zip(model.named_parameters(), ref.parameters()):
                close(q.grad, r.grad, f"{what} step {k}: gradient of {name}")
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        for (name, q), r in zip(model.named_parameters(), ref.parameters()):
            close(q.detach(), r.detach(), f"{what} after {STEPS} steps: {name}")


def hf_cases(g):
    for family, tied in CASES:
        what = f"{family}" + ("" if tied is None else " tied" if tied else " untied")

        def build(family=family, tied=tied):
            return hf_models.build(family, tied=tied, **SIZES)
        for stage in (1, 2, 3):
            engine, ref, ref_opt = equal_to_one_process(g, build, hf_loss(family), stage, what,
                                                        inside=stage3_bytes_inside if stage == 3 else None)
            if stage == 3:
                assert len(MEASURED) == STEPS, MEASURED
                MEASURED.clear()
                stage3_bytes_after_backward(g, engine, build, hf_loss(family), what)
                assert [u.name for u in engine.units][0] == "(root)" and len(engine.units) == 1 + SIZES["layers"], \
                    [u.name for u in engine.units]
            if family == "gpt2" and tied and stage == 3:
                checkpoint_resumes(g, engine, ref, ref_opt, build, hf_loss(family))
    # a family paratrain names nowhere, built like Llama: its blocks found as units all the same
    engine, _, _ = equal_to_one_process(g, lambda: qwen2(SIZES), hf_loss("qwen2"), 3, "qwen2")
    assert [u.name for u in engine.units][1:] == [f"model.layers.{i}" for i in range(SIZES["layers"])], \
        [u.name for u in engine.units]
    for reentrant in (False, True):   # each block's forward run again in backward: its unit stays gathered
        def checkpointed(reentrant=reentrant):
            model = hf_models.build("llama", **SIZES)
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
            return model
        equal_to_one_process(g, checkpointed, hf_loss("llama"), 3, f"llama, activation checkpointing "
                             f"({'reentrant' if reentrant else 'non-reentrant'})")


def stage3_bytes_inside(engine, step):
    """In the middle of a block's forward: this rank's chunks, the root (gathered for the whole
    forward and backward) and this block; from the second step on the next block may be
    gathered too (prefetch)."""
    block = engine.units[1]
    size = block.flat.element_size()
    chunks = sum(u.chunk for u in engine.units) * size
    root = engine.units[0].padded * size

    def check(module, args):
        held = engine.memory()["parameters"]
        low = chunks + root + block.padded * size
        high = low + max(u.padded for u in engine.units[2:]) * size if step else low
        assert low <= held <= high, (step, held, low, high)
        MEASURED.append(held)
        handle.remove()
    handle = block.module.register_forward_pre_hook(check)


def stage3_bytes_after_backward(g, engine, build, loss_fn, what):
    """After backward nothing is gathered: the chunks, their gradients and Adam's two moments,
    4 x 8 bytes an element in float64, plus Adam's step counts; against the formula 32P/N."""
    loss_fn(engine, tokens(g.rank, 0)).backward()
    held = engine.memory()
    size = engine.units[0].flat.element_size()
    chunks = sum(u.chunk for u in engine.units)
    steps = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values()
                for key, t in s.items() if key == "step")
    assert held == {"parameters": chunks * size, "gradients": chunks * size, "optimizer": 2 * chunks * size + steps}, \
        (what, held, chunks)
    P = sum(q.numel() for q in engine.module.parameters())
    formula = 4 * size * P / g.world_size
    total = sum(held.values())
    assert abs(total - formula) <= 0.02 * formula, (what, total, formula)
    engine.zero_grad()


def checkpoint_resumes(g, engine, ref, ref_opt, build, loss_fn):
    """A tied model's full checkpoint: both names in the state dict, the optimizer state as one
    process's over model.parameters(); loaded at stage 2 it continues equal to one process."""
    state, opt_state = engine.full_state_dict(), engine.full_optimizer_state()
    assert "lm_head.weight" in state and "transformer.wte.weight" in state
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    want = ref_opt.state_dict()
    assert opt_state["param_groups"] == want["param_groups"], (opt_state["param_groups"], want["param_groups"])
    for i, entries in want["state"].items():
        for key, v in entries.items():
            close(torch.as_tensor(opt_state["state"][i][key]).double(), v.double(), f"Adam's {key} of parameter {i}")
    torch.manual_seed(1)   # other weights: everything must come from the checkpoint
    fresh = pt.ZeRO(build(), torch.optim.Adam, stage=2, group=g, **ADAM)
    fresh.load_full_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})   # either name will do
    fresh.load_full_optimizer_state(opt_state)
    loss_fn(fresh, tokens(g.rank, STEPS)).backward()
    fresh.step()
    loss_fn(ref, torch.cat([tokens(r, STEPS) for r in range(g.world_size)])).backward()
    ref_opt.step()
    got, want = fresh.full_state_dict(), ref.state_dict()
    for name in want:
        close(got[name], want[name], f"resumed at stage 2, one step later: {name}")


# ---- blocks returning what torch's module backward hooks cannot see --------------------------------

@dataclasses.dataclass
class Hidden:
    state: torch.Tensor
    extra: object = None


class Box:
    """An object no walk opens: the block's output reaches backward only through it."""
    def __init__(self, tensor):
        self.tensor = tensor


class Block(nn.Module):
    def __init__(self, width, style):
        super().__init__()
        self.style = style
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        if self.style == "dict":
            return {"hidden": h, "aux": None}
        if self.style == "dataclass":
            return Hidden(h, extra="x")
        if self.style == "tuple":
            return h, None, 3
        return Box(h)


def unpack(out):
    if isinstance(out, dict):
        return out["hidden"]
    if isinstance(out, Hidden):
        return out.state
    if isinstance(out, tuple):
        return out[0]
    return out.tensor


class Toy(nn.Module):
    def __init__(self, style, vocab=40, width=24, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, style) for _ in range(layers))
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight   # tied

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = unpack(block(x))
        return self.head(x)


def toy_cases(g):
    def loss(model, ids):
        ids = ids % 40
        return F.cross_entropy(model(ids)[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))
    for style in ("dict", "dataclass", "tuple", "opaque"):
        engine, _, _ = equal_to_one_process(g, lambda: Toy(style), loss, 3, f"blocks returning a {style}")
        assert [u.name for u in engine.units] == ["(root)", "blocks.0", "blocks.1", "blocks.2"], engine.units
        assert engine.prefetched > 0


def main():
    torch.set_default_dtype(torch.float64)
    g = pt.init()
    data_parallel_cases(g)
    hf_cases(g)
    toy_cases(g)
    print(f"hf zero passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
