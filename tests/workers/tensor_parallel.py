"""Worker: tensor-parallel layers and differentiable collectives against one process.

Every rank builds the one-process model too, from the same seed, and checks
(float64, 1e-10): the tensor-parallel output and loss equal the one-process
ones, and every gradient equals the matching slice of the one-process
gradient. Then each collective's forward and backward against what it must be.
"""
import sys

import torch
from torch import nn

import paratrain as pt

torch.set_default_dtype(torch.float64)
TOL = 1e-10


def close(a, b, what):
    err = float((a - b).detach().abs().max()) if a.numel() else 0.0
    assert err <= TOL * max(1.0, float(b.detach().abs().max())), f"{what}: off by {err:.3e}"


def mlp(g, gather_output):
    p, r = g.world_size, g.rank
    hidden = 12
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Linear(hidden, 8))
    torch.manual_seed(0)
    col = pt.tensor.ColumnParallelLinear(8, hidden, group=g, gather_output=gather_output)
    row = pt.tensor.RowParallelLinear(hidden, 8, group=g, input_is_parallel=not gather_output)
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1))
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    yt = row(nn.functional.gelu(col(xt)))
    close(yt, yr, "output")
    (yr ** 2).sum().backward()
    (yt ** 2).sum().backward()
    rows = slice(r * hidden // p, (r + 1) * hidden // p)
    close(col.weight.grad, ref[0].weight.grad[rows], "column weight grad")
    close(col.bias.grad, ref[0].bias.grad[rows], "column bias grad")
    close(row.weight.grad, ref[2].weight.grad[:, rows], "row weight grad")
    close(row.bias.grad, ref[2].bias.grad, "row bias grad")
    close(xt.grad, xr.grad, "input grad")


def collectives(g):
    p, r = g.world_size, g.rank
    F = pt.functional
    gen = torch.Generator().manual_seed(7)
    whole = torch.randn(2 * p, 3, generator=gen)
    w = torch.randn(2 * p, 3, generator=gen)
    mine = slice(2 * r, 2 * r + 2)
    # all_gather: shards -> whole; d/dshard of sum(whole * w) is w's slice
    x = whole[mine].clone().requires_grad_()
    y = F.all_gather(x, g, dim=0)
    close(y, whole, "all_gather")
    (y * w).sum().backward()
    close(x.grad, w[mine], "all_gather backward")
    # reduce_scatter + all_reduce: z_q differs per rank; L = sum_r <y_r, w_r>, the same on every rank
    zs = [torch.randn(2 * p, 3, generator=torch.Generator().manual_seed(100 + q)) for q in range(p)]
    z = zs[r].clone().requires_grad_()
    y = F.reduce_scatter(z, g, dim=0)
    close(y, sum(zs)[mine], "reduce_scatter")
    loss = F.all_reduce((y * w[mine]).sum().reshape(1), g)
    close(loss, (sum(zs) * w).sum().reshape(1), "all_reduce")
    loss.sum().backward()
    close(z.grad, w, "reduce_scatter + all_reduce backward")
    # split: replicated -> shard; backward gathers
    x = whole.clone().requires_grad_()
    s = F.split(x, g, dim=0)
    close(s, whole[mine], "split")
    F.all_reduce((s * w[mine]).sum().reshape(1), g).sum().backward()
    close(x.grad, w, "split backward")
    # broadcast from the last rank: its tensor everywhere; the gradient lands on it alone
    src = p - 1
    x = zs[r][:2].clone().requires_grad_()
    y = F.broadcast(x, g, src=src)
    close(y, zs[src][:2], "broadcast")
    (y * w[:2]).sum().backward()
    close(x.grad, w[:2] if r == src else torch.zeros_like(w[:2]), "broadcast backward")
    # copy_to_group: identity forward, the ranks' gradients summed backward
    x = whole.clone().requires_grad_()
    (F.copy_to_group(x, g) * (r + 1)).sum().backward()
    close(x.grad, torch.full_like(whole, p * (p + 1) / 2), "copy_to_group backward")


def my_share(name, grad, n_layer, p, r):
    """Rank r's piece of a one-process gpt gradient under pt.tensor.GPT_PLAN at TP size p
    (what the cut model's gradient of ``name`` must equal)."""
    from paratrain.parallel.tensor.layers import _rows
    styles = {key.replace("*", str(i)): v for key, v in pt.tensor.GPT_PLAN.items() for i in range(n_layer)}
    module, _, kind = name.rpartition(".")
    style = styles.get(module)
    if style and style.startswith("colwise"):
        return _rows(grad, p, r, int(style.partition(":")[2] or 1))
    if style == "vocab":
        return grad.chunk(p)[r]
    if style == "rowwise" and kind == "weight":
        return grad.chunk(p, dim=1)[r]
    return grad


def gpt(g, sequence_parallel=False):
    """The gpt model, sharded by pt.tensor.parallelize with its plan, equals the one-process
    model; with sequence parallelism too, where each rank's LayerNorms see 1/p of the tokens
    and the collectives are Korthikanti et al.'s, counted one by one."""
    from paratrain.train.models import GPT
    import torch.nn.functional as F
    p, r = g.world_size, g.rank
    arch = dict(vocab_size=36, block_size=12, n_layer=2, n_head=6, n_embd=24)
    L, T = arch["n_layer"], arch["block_size"]
    torch.manual_seed(0)
    ref = GPT(**arch)
    torch.manual_seed(0)
    tp = pt.tensor.parallelize(GPT(**arch), group=g, plan=pt.tensor.GPT_PLAN, sequence_parallel=sequence_parallel)
    seen = []
    tp.blocks[1].ln2.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 36, (4, T), generator=gen), torch.randint(0, 36, (4, T), generator=gen)
    pt.tensor.traffic.reset()
    lr, lt = (F.cross_entropy(m(x).reshape(-1, 36), y.reshape(-1)) for m in (ref, tp))
    close(lt, lr, "gpt loss")
    assert seen == [(4, T // p if sequence_parallel else T, 24)], seen
    lr.backward()
    lt.backward()
    calls = pt.tensor.traffic.calls
    if sequence_parallel:   # per layer 2 gathers + 2 reduce-scatters forward, the same backward; norms and
        # rowwise biases summed (6 a layer, 2 for ln_f); the embedding's all-reduce; the region's ends
        assert calls == {"all_reduce": 1 + 6 * L + 2, "all_gather": 4 * L + 2, "reduce_scatter": 4 * L,
                         "broadcast": 0}, calls
    else:                   # Megatron: 2 all-reduces a layer forward, 2 backward, and the embedding's
        assert calls == {"all_reduce": 4 * L + 1, "all_gather": 0, "reduce_scatter": 0, "broadcast": 0}, calls
    held = dict(tp.named_parameters())
    for name, q in ref.named_parameters():
        close(held[name].grad, my_share(name, q.grad, L, p, r), f"gpt gradient of {name}")
    mine = sum(q.numel() for q in tp.parameters())
    assert mine < sum(q.numel() for q in ref.parameters()), "nothing was sharded"
    # the full checkpoint: gathered, it is the one-process model's; loaded into a fresh cut model, the same shards
    full = pt.tensor.full_state_dict(tp)
    whole = ref.state_dict()
    assert set(full) == set(whole)
    for k in whole:
        close(full[k], whole[k], f"gathered {k}")
    torch.manual_seed(1)   # other weights, to be overwritten
    again = pt.tensor.parallelize(GPT(**arch), group=g, plan=pt.tensor.GPT_PLAN)
    pt.tensor.load_full_state_dict(again, full)
    for (k, a), (_, b) in zip(again.state_dict().items(), tp.state_dict().items()):
        close(a, b, f"reloaded {k}")
    # Adam's state, gathered whole, is the one-process optimizer's; loaded back, this rank's slices
    opt_ref, opt_tp = torch.optim.Adam(ref.parameters()), torch.optim.Adam(tp.parameters())
    opt_ref.step()
    opt_tp.step()
    whole_state, ref_state = pt.tensor.full_optimizer_state(tp, opt_tp), opt_ref.state_dict()
    assert whole_state["param_groups"] == ref_state["param_groups"]
    for i, entries in ref_state["state"].items():
        for k, v in entries.items():
            close(whole_state["state"][i][k], v, f"gathered Adam {k} of parameter {i}")
    opt_again = torch.optim.Adam(again.parameters())
    pt.tensor.load_full_optimizer_state(again, opt_again, whole_state)
    for (i, a), (_, b) in zip(opt_again.state_dict()["state"].items(), opt_tp.state_dict()["state"].items()):
        for k in a:
            close(a[k], b[k], f"reloaded Adam {k} of parameter {i}")


def vocab(g):
    """VocabParallelEmbedding equals nn.Embedding; the vocabulary-parallel cross-entropy of a
    column-parallel head equals F.cross_entropy of the whole logits, gradients included."""
    import torch.nn.functional as F
    p, r = g.world_size, g.rank
    V, d = 6 * p, 5
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (3, 7), generator=gen)
    target = torch.randint(0, V, (3, 7), generator=gen)
    torch.manual_seed(0)
    emb, head = nn.Embedding(V, d), nn.Linear(d, V)
    torch.manual_seed(0)
    temb = pt.tensor.VocabParallelEmbedding(V, d, group=g)
    thead = pt.tensor.ColumnParallelLinear(d, V, group=g)
    h, th = emb(ids), temb(ids)
    close(th, h, "vocab-parallel embedding")
    ref = F.cross_entropy(head(h).reshape(-1, V), target.reshape(-1))
    loss = pt.tensor.vocab_parallel_cross_entropy(thead(th), target, group=g)
    close(loss, ref, "vocab-parallel cross-entropy")
    ref.backward()
    loss.backward()
    rows = slice(r * V // p, (r + 1) * V // p)
    close(temb.weight.grad, emb.weight.grad[rows], "embedding gradient")
    close(thead.weight.grad, head.weight.grad[rows], "head gradient")
    close(thead.bias.grad, head.bias.grad[rows], "head bias gradient")


def bad_plans(g):
    from paratrain.train.models import GPT
    said = []
    for plan in ({"blocks.*.nothing": "colwise"}, {"blocks.*.ln1": "colwise"}, {"blocks.*.mlp.0": "diagonal"}):
        try:
            pt.tensor.parallelize(GPT(n_layer=1, n_head=6, n_embd=12, vocab_size=12, block_size=4), group=g,
                                  plan=plan)
        except ValueError as e:
            said.append(str(e))
    assert len(said) == 3, said
    assert "names no module" in said[0] and "is a LayerNorm" in said[1] and "'diagonal'" in said[2], said
    try:
        pt.tensor.parallelize(GPT(n_layer=1, n_head=6, n_embd=12, vocab_size=12, block_size=4), group=g,
                              plan={"blocks.0.mlp.0": "vocab"})
    except ValueError as e:
        assert "'vocab' cuts an nn.Embedding" in str(e), e
    else:
        raise AssertionError("a Linear cut as a vocabulary was accepted")
    small = dict(n_layer=1, n_head=6, n_embd=12, vocab_size=12, block_size=5)
    said = []
    for plan, sp in (({"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}, True),
                     ({"blocks.0.mlp.0": "colwise", "blocks.*.mlp.0": "colwise"}, False),
                     ({"blocks.0.mlp.0": "colwise+rowwise"}, False)):
        try:
            pt.tensor.parallelize(GPT(**small), group=g, plan=plan, sequence_parallel=sp)
        except ValueError as e:
            said.append(str(e))
    assert len(said) == 3, said
    assert "names no module as 'split_input'" in said[0] and "named by two plan keys" in said[1], said
    assert "cuts one layer two ways" in said[2], said
    model = pt.tensor.parallelize(GPT(**small), group=g, plan=pt.tensor.GPT_PLAN, sequence_parallel=True)
    try:   # 5 tokens do not cut into 2 or 3 equal pieces
        model(torch.zeros(2, 5, dtype=torch.long))
    except ValueError as e:
        assert f"of size 5 cannot be cut into {g.world_size} equal pieces" in str(e), e
    else:
        raise AssertionError("a sequence of 5 cut into equal pieces was accepted")


def heads_refused(g):
    from paratrain.train.models import GPT
    try:
        pt.tensor.parallelize(GPT(n_layer=1, n_head=6, n_embd=24, vocab_size=36, block_size=4), group=g,
                              plan=pt.tensor.GPT_PLAN)
    except ValueError as e:
        assert "feeds 6 attention heads, which cannot be cut into 4" in str(e), e
    else:
        raise AssertionError("6 heads cut 4 ways was accepted")


def dp_by_tp(g):
    """4 ranks as pt.mesh(dp=2, tp=2): the gpt model sharded over tp, DataParallel over dp,
    each replica on half the batch, equals one process on the whole batch."""
    import torch.nn.functional as F
    from paratrain.train.models import GPT
    mesh = pt.mesh(dp=2, tp=2)
    r = g.rank
    assert list(mesh["tp"].ranks) == [r // 2 * 2, r // 2 * 2 + 1], mesh["tp"].ranks
    if g.backend == "hierarchical":   # 2 pretend hosts: each TP group on one (shm), DP between them
        assert mesh["tp"].backend == "shm" and mesh["dp"].backend == "hierarchical", (mesh["tp"].backend,
                                                                                      mesh["dp"].backend)
    assert list(mesh["dp"].ranks) == [r % 2, r % 2 + 2], mesh["dp"].ranks
    assert mesh.coords == {"dp": r // 2, "pp": 0, "tp": r % 2}, mesh.coords
    try:
        pt.mesh(dp=3, tp=2)
    except ValueError as e:
        assert "dp x pp x tp = 3 x 1 x 2 = 6, but the job has 4 ranks" in str(e), e
    else:
        raise AssertionError("a mesh of 6 on 4 ranks was accepted")
    arch = dict(vocab_size=36, block_size=8, n_layer=2, n_head=6, n_embd=24)
    torch.manual_seed(0)
    ref = GPT(**arch)
    torch.manual_seed(0)
    tp = pt.tensor.parallelize(GPT(**arch), group=mesh["tp"], plan=pt.tensor.GPT_PLAN)
    model = pt.DataParallel(tp, group=mesh["dp"])
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 36, (6, 8), generator=gen), torch.randint(0, 36, (6, 8), generator=gen)
    half = slice(3 * mesh.coords["dp"], 3 * mesh.coords["dp"] + 3)
    F.cross_entropy(ref(x).reshape(-1, 36), y.reshape(-1)).backward()
    F.cross_entropy(model(x[half]).reshape(-1, 36), y[half].reshape(-1)).backward()
    held = dict(tp.named_parameters())
    for name, q in ref.named_parameters():
        close(held[name].grad, my_share(name, q.grad, arch["n_layer"], 2, mesh.coords["tp"]),
              f"dp x tp gradient of {name}")


def pp_by_tp(g):
    """4 ranks as pt.mesh(pp=2, tp=2): the gpt model cut inside its layers across tp, then
    between them into 2 stages (each stage's workers cutting alike), equals one process:
    the loss and every gradient, with 1F1B and with ZB-H1 (whose deferred weight
    gradients must not run a collective)."""
    import torch.nn.functional as F
    from paratrain.train.models import GPT
    mesh = pt.mesh(pp=2, tp=2)
    assert list(mesh["pp"].ranks) == [g.rank % 2, g.rank % 2 + 2], mesh["pp"].ranks
    arch = dict(vocab_size=36, block_size=12, n_layer=2, n_head=6, n_embd=24)
    torch.manual_seed(0)
    ref = GPT(**arch)
    torch.manual_seed(0)
    model = GPT(**arch)
    points = pt.pipeline.choose_cut(model, 2, sample=torch.zeros(2, 12, dtype=torch.long))   # timed: rank 0's
    pt.tensor.parallelize(model, group=mesh["tp"], plan=pt.tensor.GPT_PLAN)
    stage = pt.pipeline.split(model, group=mesh["pp"], split_points=points, verbose=False)
    names = {id(q): n for n, q in model.named_parameters()}
    gen = torch.Generator().manual_seed(9)
    x, y = torch.randint(0, 36, (4, 12), generator=gen), torch.randint(0, 36, (4, 12), generator=gen)

    def lm(out, target):
        return F.cross_entropy(out.reshape(-1, 36), target.reshape(-1))
    want = lm(ref(x), y)
    want.backward()
    grads = dict(ref.named_parameters())
    t = mesh.coords["tp"]
    for schedule in ("1f1b", "zb-h1"):
        for q in stage.parameters():
            q.grad = None
        pipe = pt.Pipeline(stage, group=mesh["pp"], microbatches=2, schedule=schedule, loss_fn=lm)
        loss = pipe.step(x if stage.is_first else None, y if stage.is_last else None)
        close(torch.as_tensor(loss, dtype=torch.float64), want.detach(), f"pp x tp loss ({schedule})")
        held = list(stage.parameters())
        assert held, "this stage holds no parameters"
        for q in held:
            name = names[id(q)]
            close(q.grad, my_share(name, grads[name].grad, arch["n_layer"], 2, t),
                  f"pp x tp gradient of {name} ({schedule})")


def refused(g):
    try:
        pt.tensor.ColumnParallelLinear(8, 10, group=g)
    except ValueError as e:
        return str(e)
    return "accepted"


def main():
    g = pt.init(backend=sys.argv[1] if len(sys.argv) > 1 else None)
    mlp(g, gather_output=False)
    mlp(g, gather_output=True)
    collectives(g)
    vocab(g)
    if g.world_size == 4:
        heads_refused(g)
        dp_by_tp(g)
        pp_by_tp(g)
    else:
        gpt(g)
        gpt(g, sequence_parallel=True)
        bad_plans(g)
    msg = refused(g) if g.world_size in (3, 4) else "out_features 10 cannot be cut (not tried: divides)"
    assert "out_features 10 cannot be cut" in msg, msg
    print(f"tensor parallel passed on rank {g.rank}", flush=True)
    pt.destroy()


if __name__ == "__main__":
    sys.exit(main())
