"""pt.pipeline.split on real models: tracing (torch.fx, blocks kept whole, torch.export),
the layers found (a wrapped model's blocks), cut names inside layers, nn.Sequential
children kept whole, tied weights, the outputs a last stage may return, and each
refusal's advice followed to a model that splits.

Without processes, a pipeline of p stages is split once per stage with a stand-in
group and its chunks chained in one process: their output and gradients must be
the model's. Then Hugging Face GPT-2 (tied and untied), BERT and Llama under 2
real ranks against one process (tests/workers/hf_pipeline.py).
"""
import dataclasses

import pytest
import torch
from torch import nn

from conftest import launch
import paratrain as pt
from paratrain.parallel.pipeline import layers as pipeline_layers
from paratrain.parallel.pipeline.trace import trace
from paratrain.train.models import GPT

# ---- one process: every stage of a split, chained -----------------------------------------------


class Ranks:
    """What split asks of a group: its size and this rank (cut by parameters or at
    named points: a cut by time is measured on rank 0 and broadcast)."""

    def __init__(self, world_size, rank):
        self.world_size, self.rank = world_size, rank

    def broadcast(self, tensor, src):
        assert self.world_size == 1, "a cut by time needs real ranks"


def stages_of(model, p=2, **kw):
    return [pt.pipeline.split(model, group=Ranks(p, r), verbose=False, **kw) for r in range(p)]


def chained(stages, *inputs):
    values = inputs
    for stage in stages:
        out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    return out


def assert_same_as_model(model, stages, x, pick=lambda out: out):
    """The chained stages' output and gradients are the model's own."""
    model.zero_grad()
    got = pick(chained(stages, x))
    got.square().sum().backward()
    grads = {n: q.grad for n, q in model.named_parameters()}
    model.zero_grad()
    want = pick(model(x))
    want.square().sum().backward()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for n, q in model.named_parameters():
        if q.grad is None:    # (a branch not taken)
            assert grads[n] is None, n
        else:
            assert torch.allclose(grads[n], q.grad, rtol=1e-12, atol=1e-12), n


def names(model):
    return [key for key, _ in pipeline_layers.find_layers(trace(model).gm)]


class Wrapped(nn.Module):
    """A model inside a thin wrapper, as Hugging Face models are wrapped to return logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.m = GPT(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=8)

    def forward(self, ids):
        return self.m(ids)


def ids(batch=4):
    return torch.randint(0, 16, (batch, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.timeout(60)
def test_the_layers_of_a_wrapped_model_are_its_blocks():
    assert names(Wrapped()) == ["m.tok_emb", "m.pos_emb", "m.blocks.0", "m.blocks.1", "m.blocks.2", "m.ln_f",
                                "m.head"]
    gm = torch.fx.symbolic_trace(Wrapped())        # a graph traced by the user is cut as given
    assert trace(gm).how == "given" and names(gm) == names(Wrapped())
    assert_same_as_model(gm, stages_of(gm, p=3), ids())
    # only the first list on a path opens: the experts inside a block stay in their block
    assert pipeline_layers.containers(["hf.model.layers.0.mlp.experts.3", "hf.lm_head"]) == \
        {"", "hf", "hf.model", "hf.model.layers"}
    assert pipeline_layers.containers(["blocks.1"], points=["blocks.1.mlp"]) == {"", "blocks", "blocks.1"}


@pytest.mark.timeout(60)
def test_split_points_name_nested_modules():
    model = Wrapped()
    stages = stages_of(model, p=3, split_points=["m.blocks.1", "m.blocks.2.mlp"])
    assert "stage 1: m.blocks.1" in stages[0].report and "stage 2: m.blocks.2.mlp..m.head" in stages[0].report
    assert_same_as_model(model, stages, ids())
    with pytest.raises(ValueError, match=r"split point 'm\.blocks\.9' is not a layer of the model .*m\.blocks\.0"):
        stages_of(model, split_points=["m.blocks.9"])


class Branchy(nn.Module):
    """Python control flow on a tensor's value: neither torch.fx nor torch.export can trace it."""

    def __init__(self):
        super().__init__()
        self.inp, self.a, self.b, self.out = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        if x.sum() > 0:
            x = self.a(x)
        else:
            x = self.b(x)
        return self.out(x)


class Where(Branchy):
    """Branchy as the advice says: torch.where instead of the if (torch.fx traces it)."""

    def forward(self, x):
        x = self.inp(x)
        return self.out(torch.where(x.sum() > 0, self.a(x), self.b(x)))


class Cond(Branchy):
    """Branchy as the advice says: torch.cond instead of the if (torch.export traces it)."""

    def forward(self, x):
        x = self.inp(x)
        return self.out(torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: self.b(x), (x,)))


class Blocks(nn.Module):
    def __init__(self, block, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


class ShapeBranch(Blocks):
    """Branches on a shape at the top: torch.fx cannot trace it, torch.export can."""

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        return super().forward(x)


@pytest.mark.timeout(60)
def test_a_sequential_is_cut_at_its_children_without_tracing_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Branchy(), nn.Tanh(), nn.Sequential(Branchy(), nn.Linear(4, 2)))
    assert names(model) == ["0", "1", "2", "3.0", "3.1"]
    assert_same_as_model(model, stages_of(model, p=3), torch.randn(5, 4))


@pytest.mark.timeout(60)
def test_blocks_torch_fx_cannot_trace_are_kept_whole():
    model = Blocks(Branchy)
    traced = trace(model)
    assert traced.how == "torch.fx, each block whole"
    assert [key for key, _ in pipeline_layers.find_layers(traced.gm)] == ["inp", "blocks.0", "blocks.1", "blocks.2"]
    assert_same_as_model(model, stages_of(model), torch.randn(5, 4))


@pytest.mark.timeout(90)
def test_a_model_torch_fx_cannot_trace_asks_for_a_sample_and_splits_with_it():
    model = ShapeBranch(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    with pytest.raises(ValueError, match="torch.fx cannot trace ShapeBranch .*Pass sample="):
        stages_of(model)
    x = torch.randn(6, 4)
    stages = stages_of(model, sample=x[:1], by="params")        # a batch of one, traced as two
    assert "traced by torch.export" in stages[0].report
    assert_same_as_model(model, stages, x)
    assert_same_as_model(model, stages, x[:3])    # another batch size: the shapes stay symbolic
    layers = [key for key, _ in pipeline_layers.find_layers(trace(model, x).gm)]
    assert layers == ["inp", "blocks.0.0", "blocks.0.1", "blocks.1.0", "blocks.1.1", "blocks.2.0", "blocks.2.1"]
    cut = pt.pipeline.choose_cut(model, 2, sample=x, group=Ranks(1, 0))     # by time, measured
    assert len(cut) == 1 and cut[0] in layers[1:]


@pytest.mark.timeout(90)
def test_control_flow_on_a_tensor_is_refused_and_torch_where_splits():
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="neither torch.fx nor torch.export can trace Branchy.*torch.where"):
        stages_of(Branchy(), sample=x, by="params")
    for model in (Where(), Cond()):
        assert_same_as_model(model, stages_of(model, sample=x, by="params"), x)


@pytest.mark.timeout(120)
def test_a_hugging_face_model_returning_its_cache_is_refused_with_the_fix():
    """The fix, config.use_cache = False, is followed in tests/workers/hf_pipeline.py."""
    from paratrain.train import hf_models
    torch.manual_seed(0)
    model = hf_models.build("gpt2", vocab=32, positions=8, width=16, layers=1, heads=2, mlp=32)
    with pytest.raises(ValueError, match=r"set config.use_cache = False, or wrap the model"):
        stages_of(model, sample=torch.randint(0, 32, (2, 8)), by="params")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


@pytest.mark.timeout(60)
def test_a_weight_two_stages_read_is_held_by_both():
    model = Tied()
    stages = stages_of(model, split_points=["mid"])
    for rank, stage in enumerate(stages):
        assert [(n, q is model.inp.weight, r) for n, q, r in stage.tied] == [("inp.weight", True, [0, 1])], rank
    assert "inp.weight is read by stages 0, 1 (tied)" in stages[0].report
    # interleaved on one rank, a weight read by two of its stages is no one else's business
    assert all(not s.tied for s in stages_of(model, p=1, virtual=3))
    assert_same_as_model(model, stages, torch.randn(3, 4))


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    nothing: torch.Tensor = None


class Returns(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.a, self.b = kind, nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        return {"dict": lambda: {"y": y, "none": None}, "tuple": lambda: (y, None),
                "dataclass": lambda: Out(y)}[self.kind]()


@dataclasses.dataclass
class Unknown:
    logits: torch.Tensor


class ShapeBranchUnknown(ShapeBranch):
    """torch.fx cannot trace it, and torch.export knows no Unknown until it is registered."""

    def forward(self, x):
        return Unknown(super().forward(x))


@pytest.mark.timeout(90)
def test_an_output_torch_export_does_not_know_is_refused_and_registering_it_splits():
    model = ShapeBranchUnknown(lambda: nn.Linear(4, 4))
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="register a dataclass it returns with torch.utils._pytree.register_dataclass"):
        stages_of(model, sample=x, by="params")
    torch.utils._pytree.register_dataclass(Unknown)
    stages = stages_of(model, sample=x, by="params")
    assert type(chained(stages, x)) is Unknown and stages[0].output_unsendable is None
    assert_same_as_model(model, stages, x, lambda o: o.logits)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,pick", [("dict", lambda o: o["y"]), ("tuple", lambda o: o[0]),
                                       ("dataclass", lambda o: o.logits)])
def test_the_last_stage_returns_what_the_model_returns(kind, pick):
    model = Returns(kind)
    stages = stages_of(model)
    out = chained(stages, torch.randn(2, 4))
    assert type(out) is type(model(torch.randn(2, 4)))
    assert stages[0].output_unsendable == ("Out" if kind == "dataclass" else None)
    assert_same_as_model(model, stages, torch.randn(3, 4), pick)


# ---- Hugging Face models under two ranks ---------------------------------------------------------


@pytest.mark.timeout(300)
def test_hugging_face_models_equal_one_process_under_every_schedule():
    """GPT-2 tied (wrapped, cut by parameters) and untied (bare, its ModelOutput to loss_fn,
    cut at a nested name), BERT (tied), Llama (rotary, grouped-query attention), Qwen2 (a
    family paratrain names nowhere), GPT-2's
    blocks in an nn.Sequential (cut by time; and in four stages, two a rank, interleaved), and outputs that are a dict, a tuple with a
    None and a dataclass: loss, gradients and the weights after 3 Adam steps within 1e-10."""
    res = launch(2, "hf_pipeline.py", "equiv", timeout=280, env={"PARATRAIN_TIMEOUT": "120"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    runs = {"gpt2": 3, "gpt2-untied": 3, "bert": 3, "llama": 3, "qwen2": 1, "sequential": 2, "interleaved": 1, "dict": 1,
            "tuple-none": 1, "dataclass": 1}
    tied = {"gpt2": "hf.transformer.wte.weight", "bert": "hf.bert.embeddings.word_embeddings.weight",
            "sequential": "0.weight", "interleaved": "0.weight"}
    for rank in range(2):
        for case, n in runs.items():
            lines = [x for x in out.splitlines() if f"hf pipeline {case} " in x and f"passed on rank {rank}" in x]
            assert len(lines) == n, (case, rank, out[-3000:])
            assert all(f"(tied: {tied.get(case, 'none')})" in x for x in lines), lines
        assert f"dataclass forward refused on rank {rank}: Pipeline.forward: the model returns an object of " \
               "class Out" in out, out[-3000:]
