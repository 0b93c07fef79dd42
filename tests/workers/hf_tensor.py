"""Worker: Hugging Face models cut by pt.tensor.plan_for, against one process.

Every rank builds the one-process model too, from the same seed, and checks
in float64 (1e-10, relative to max(1, |reference|)):

- 2 ranks (tp = 2): GPT-2 tied and untied (Conv1D, fused q/k/v; tied also
  with the embedding and head left whole, ``plan_for(vocab=False)``), BERT (tied,
  a padding row, an attention mask), Llama (grouped-query attention: 4 heads,
  2 key-value heads) and Qwen2 (a family paratrain does not name: q/k/v with
  biases, grouped-query attention): the loss and every gradient equal the
  one-process model's (a cut parameter's gradient is the matching slice of
  the whole one), with and without sequence parallelism; the parameters
  after 3 Adam steps too, and the gathered checkpoint is the one-process
  state dict. Then VocabParallelEmbedding's padding row alone.
- 4 ranks: pt.mesh(dp=2, tp=2), Llama cut over tp (with and without
  sequence parallelism) and DataParallel over dp, each replica on half the
  batch, equals one process on the whole batch.
"""
import sys

import torch
from torch import nn

import paratrain as pt
from paratrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paratrain.train import hf_models
from unnamed_family import qwen2

torch.set_default_dtype(torch.float64)
TOL = 1e-10
SIZES = dict(layers=2, width=32, heads=4, kv_heads=2, mlp=64, vocab=64, positions=16)
B, T = 4, 8


def close(a, b, what):
    err = float((a - b).detach().abs().max()) if a.numel() else 0.0
    assert err <= TOL * max(1.0, float(b.detach().abs().max())), f"{what}: off by {err:.3e}"


def rows(t, p, r, parts=1):
    """Rank r's rows of t when it stacks ``parts`` equal blocks, each cut alike."""
    return torch.cat([block.chunk(p)[r] for block in t.chunk(parts)])


def share(module, name, whole, p, r):
    """This rank's piece of the one-process tensor ``whole`` of ``module.name``, by how it was cut."""
    turned = name == "weight" and getattr(module, "transposed", False)   # a Conv1D's (in, out) weight
    t = whole.t() if turned else whole
    if isinstance(module, ColumnParallelLinear):
        t = rows(t, p, r, module.parts)
    elif isinstance(module, RowParallelLinear):
        t = t.chunk(p, dim=1)[r] if name == "weight" else t
    elif isinstance(module, VocabParallelEmbedding):
        t = t.chunk(p)[r]
    return t.t() if turned else t


def cut_of(model):
    """{id(parameter): (cut module, its name)}."""
    kinds = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    return {id(q): (m, n) for m in model.modules() if isinstance(m, kinds)
            for n, q in m.named_parameters(recurse=False)}


def compare(ref, tp, p, r, what, grads=True):
    """Every parameter (or its gradient) of ``tp`` equals its piece of ``ref``'s; returns how many were cut."""
    held, cut = dict(tp.named_parameters()), cut_of(tp)
    assert held.keys() == dict(ref.named_parameters()).keys(), (what, held.keys() ^ dict(ref.named_parameters()).keys())
    n = 0
    for name, q in ref.named_parameters():
        mine = held[name]
        module, attr = cut.get(id(mine), (None, None))
        whole = q.grad if grads else q.detach()
        want = share(module, attr, whole, p, r) if module is not None else whole
        assert mine.shape == want.shape, f"{what} {name}: {tuple(mine.shape)} vs {tuple(want.shape)}"
        close(mine.grad if grads else mine.detach(), want, f"{what} {'gradient' if grads else 'value'} of {name}")
        n += module is not None
    return n


MODELS = {
    "gpt2 tied": lambda: hf_models.build("gpt2", tied=True, **SIZES),
    "gpt2 untied": lambda: hf_models.build("gpt2", tied=False, **SIZES),
    "gpt2 tied, vocab whole": lambda: hf_models.build("gpt2", tied=True, **SIZES),   # plan_for(vocab=False)
    "bert": lambda: hf_models.build("bert", **SIZES),
    "llama": lambda: hf_models.build("llama", **SIZES),
    "qwen2": lambda: qwen2(SIZES),
}


def batch(family, seed):
    """Keyword arguments of one forward with a loss: next tokens, or BERT's masked ones
    (with padding: id 0, its padding_idx, masked out of attention)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SIZES["vocab"], (B, T), generator=gen)
    if family != "bert":
        return {"input_ids": ids, "labels": ids}
    ids[:, -2:] = 0
    labels = torch.where(torch.rand(B, T, generator=gen) < 0.5, ids, -100)
    labels[:, 0] = ids[:, 0]
    mask = (ids != 0).long()
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pair(name, g, sequence_parallel=False):
    torch.manual_seed(0)
    ref = MODELS[name]()
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = pt.tensor.plan_for(model, vocab="vocab whole" not in name)
    pt.tensor.parallelize(model, group=g, plan=plan, sequence_parallel=sequence_parallel)
    return ref, model


def one_family(name, g):
    p, r = g.world_size, g.rank
    family = name.split()[0]
    for sp in (False, True):
        ref, tp = pair(name, g, sp)
        what = f"{name}{' sequence-parallel' if sp else ''}"
        if family in ("gpt2", "bert"):
            tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
            assert (tp.get_output_embeddings().weight is tp.get_input_embeddings().weight) == tied, what
        opt_ref, opt_tp = torch.optim.Adam(ref.parameters(), lr=1e-3), torch.optim.Adam(tp.parameters(), lr=1e-3)
        steps = 1 if sp else 3
        for step in range(steps):
            kw = batch(family, seed=step)
            opt_ref.zero_grad()
            opt_tp.zero_grad()
            want, got = ref(**kw).loss, tp(**kw).loss
            close(got, want, f"{what} loss, step {step}")
            want.backward()
            got.backward()
            n = compare(ref, tp, p, r, f"{what} step {step}")
            assert n >= 4 * SIZES["layers"] + 1, f"{what}: only {n} parameters cut"
            opt_ref.step()
            opt_tp.step()
        compare(ref, tp, p, r, f"{what} after {steps} Adam steps", grads=False)
        if family == "bert":
            emb = tp.get_input_embeddings()
            assert emb.padding_idx == 0, emb
            if r == 0:   # the padding row: only the tied decoder's gradient, as in one process
                close(emb.weight.grad[0], ref.get_input_embeddings().weight.grad[0], f"{what} padding row")
        if not sp:
            checkpoint(name, g, ref, tp, opt_ref, opt_tp)


def checkpoint(name, g, ref, tp, opt_ref, opt_tp):
    """Gathered, the cut model and its Adam state are the one-process ones (a Conv1D's shard
    in its (in, out) layout, a tied parameter under both names); loaded into a freshly cut
    model, this rank's shards again."""
    full, whole = pt.tensor.full_state_dict(tp), ref.state_dict()
    assert full.keys() == whole.keys(), full.keys() ^ whole.keys()
    for k in whole:
        close(full[k], whole[k], f"{name} gathered {k}")
    state, want = pt.tensor.full_optimizer_state(tp, opt_tp), opt_ref.state_dict()
    for i, entries in want["state"].items():
        for k, v in entries.items():
            close(state["state"][i][k], v, f"{name} gathered Adam {k} of parameter {i}")
    _, again = pair(name, g)
    pt.tensor.load_full_state_dict(again, full)
    for (k, a), (_, b) in zip(again.state_dict().items(), tp.state_dict().items()):
        close(a, b, f"{name} reloaded {k}")


def padding_row(g):
    """VocabParallelEmbedding keeps nn.Embedding's padding_idx: its row's gradient is zero,
    wherever the row lies; options no rank can honour alone are refused."""
    p, r = g.world_size, g.rank
    V, d = 4 * p, 3
    ids = torch.tensor([[0, 1, V - 1, 5], [V - 1, V - 1, 2, 0]])
    for pad in (0, V - 1):
        torch.manual_seed(0)
        emb = nn.Embedding(V, d, padding_idx=pad)
        torch.manual_seed(0)
        cut = VocabParallelEmbedding(V, d, group=g, padding_idx=pad)
        w = torch.randn(2, 4, d, generator=torch.Generator().manual_seed(1))
        close(cut(ids), emb(ids), "padding embedding")
        (emb(ids) * w).sum().backward()
        (cut(ids) * w).sum().backward()
        close(cut.weight.grad, emb.weight.grad.chunk(p)[r], f"padding_idx={pad} gradient")
        assert float(emb.weight.grad[pad].abs().max()) == 0.0
    for option in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        try:
            VocabParallelEmbedding.from_embedding(nn.Embedding(V, d, **option), group=g)
        except ValueError as e:
            assert f"{next(iter(option))}=" in str(e) and "cannot be cut by rows" in str(e), e
        else:
            raise AssertionError(f"an embedding with {option} was cut")


def dp_by_tp(g, mesh, sequence_parallel):
    """pt.mesh(dp=2, tp=2): Llama cut over tp, DataParallel over dp, half the batch each,
    equals one process on the whole batch: gradients, and parameters after 2 Adam steps."""
    torch.manual_seed(0)
    ref = MODELS["llama"]()
    torch.manual_seed(0)
    tp = MODELS["llama"]()
    pt.tensor.parallelize(tp, group=mesh["tp"], plan=pt.tensor.plan_for(tp), sequence_parallel=sequence_parallel)
    model = pt.DataParallel(tp, group=mesh["dp"])
    opt_ref, opt_tp = torch.optim.Adam(ref.parameters(), lr=1e-3), torch.optim.Adam(model.parameters(), lr=1e-3)
    half = slice(B // 2 * mesh.coords["dp"], B // 2 * (mesh.coords["dp"] + 1))
    t, what = mesh.coords["tp"], f"dp x tp{' sequence-parallel' if sequence_parallel else ''}"
    for step in range(2):
        kw = batch("llama", seed=step)
        opt_ref.zero_grad()
        opt_tp.zero_grad()
        ref(**kw).loss.backward()
        model(**{k: v[half] for k, v in kw.items()}).loss.backward()
        compare(ref, tp, 2, t, f"{what} step {step}")
        opt_ref.step()
        opt_tp.step()
    compare(ref, tp, 2, t, f"{what} after 2 Adam steps", grads=False)


def main():
    g = pt.init()
    if g.world_size == 4:
        mesh = pt.mesh(dp=2, tp=2)
        for sp in (False, True):
            dp_by_tp(g, mesh, sp)
    else:
        for name in MODELS:
            one_family(name, g)
        padding_row(g)
    print(f"hf tensor passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
