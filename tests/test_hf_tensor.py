"""Tensor parallelism for Hugging Face models: pt.tensor.plan_for reads GPT-2, BERT,
Llama and models built like them, and the cut models equal one process
(tests/workers/hf_tensor.py); without processes, the plans and the refusals."""
import pytest
import torch
from torch import nn

import paratrain as pt
from conftest import launch, passed_on_every_rank

from paratrain.train import hf_models

SIZES = dict(layers=2, width=32, heads=4, kv_heads=2, mlp=64, vocab=64, positions=16)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])   # 2: every family, tp = 2; 4: pt.mesh(dp=2, tp=2), DataParallel over dp
def test_cut_models_equal_one_process(n):
    res = launch(n, "hf_tensor.py")
    passed_on_every_rank(res, "hf tensor", n)


def _tiny(name):
    import transformers
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16)
    if name == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**cfg))
    if name == "qwen3":   # per-head norms of q and k inside attention
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **cfg))
    return hf_models.build(name, **SIZES)


LAYERS = {
    "gpt2": ("transformer.h", {"attn.c_attn": "colwise:3", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                               "mlp.c_proj": "rowwise"}),
    "bert": ("bert.encoder.layer", {"attention.self.query": "colwise", "attention.self.key": "colwise",
                                    "attention.self.value": "colwise", "attention.output.dense": "rowwise",
                                    "intermediate.dense": "colwise", "output.dense": "rowwise"}),
    "llama": ("model.layers", {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                               "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                               "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}),
}
LAYERS["mistral"] = LAYERS["llama"]
VOCAB = {"gpt2": ("transformer.wte", "lm_head"), "bert": ("bert.embeddings.word_embeddings", "cls.predictions.decoder"),
         "llama": ("model.embed_tokens", "lm_head"), "mistral": ("model.embed_tokens", "lm_head")}
NORMS = {"gpt2": ("ln_1", "ln_2"), "bert": ("attention.output.LayerNorm", "output.LayerNorm"),
         "llama": ("input_layernorm", "post_attention_layernorm"),
         "mistral": ("input_layernorm", "post_attention_layernorm")}
WHOLE_SEQUENCE = {"gpt2": ("attn", "mlp"), "bert": ("attention.self", "intermediate"), "llama": ("self_attn", "mlp"),
                  "mistral": ("self_attn", "mlp")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "mistral"])
def test_plan_for_reads_each_family_from_its_blocks(name):
    model = _tiny(name)
    plan = pt.tensor.plan_for(model)
    stack, layers = LAYERS[name]
    want = {f"{stack}.*.{k}": v for k, v in layers.items()}
    want.update({f"{stack}.*.{k}": "sequence" for k in NORMS[name]})
    want.update({f"{stack}.*.{k}": "gather_input" for k in WHOLE_SEQUENCE[name]})
    want.update({f"{stack}.0": "split_input", f"{stack}.1": "gather_output"})
    emb, head = VOCAB[name]
    want.update({emb: "vocab", head: "colwise_gather"})
    assert plan == want
    chosen = pt.tensor.check_plan(model, plan, 2, sequence_parallel=True)   # every key names modules, every cut fits
    assert len(chosen) == 2 * (len(layers) + len(NORMS[name]) + len(WHOLE_SEQUENCE[name])) + 2 + 2
    # wrapped (the trainer's LogitsOf), the same plan under the wrapper's name
    assert pt.tensor.plan_for(hf_models.LogitsOf(model)) == {f"hf.{k}": v for k, v in plan.items()}
    # vocab=False: embedding and head whole
    assert pt.tensor.plan_for(model, vocab=False) == {k: v for k, v in plan.items() if k not in (emb, head)}


@pytest.mark.timeout(60)
def test_plan_for_reads_the_builtin_gpt_too():
    from paratrain.train.models import GPT
    plan = pt.tensor.plan_for(GPT(vocab_size=36, block_size=8, n_layer=2, n_head=6, n_embd=24))
    assert {k: v for k, v in plan.items() if v in ("colwise", "colwise:3", "rowwise")} == {
        k: v for k, v in pt.tensor.GPT_PLAN.items() if v in ("colwise", "colwise:3", "rowwise")}
    assert plan["tok_emb"] == "vocab" and plan["head"] == "colwise_gather"


@pytest.mark.timeout(60)
def test_plan_for_refuses_what_it_does_not_know():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.query_key_value = nn.Linear(8, 24)   # fused, but no one says how (GPT-NeoX interleaves by head)
            self.dense = nn.Linear(8, 8)

    stack = nn.Sequential(nn.Embedding(10, 8))
    stack.blocks = nn.ModuleList([Block(), Block()])
    for model, said in ((nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), "no stack of transformer blocks"),
                        (stack, "no q, k, v projections"),
                        (_tiny("qwen3"), "holds parameters inside attention")):
        with pytest.raises(ValueError, match=said) as e:
            pt.tensor.plan_for(model)
        assert "pass plan=" in str(e.value)


@pytest.mark.timeout(60)
def test_refusals_before_anything_is_cut():
    llama = hf_models.build("llama", **SIZES)   # 4 heads, 2 key-value heads
    plan = pt.tensor.plan_for(llama)
    with pytest.raises(ValueError, match="k_proj feeds 2 attention heads, which cannot be cut into 4"):
        pt.tensor.check_plan(llama, plan, 4)
    # sequence parallelism around attention that would see part of the sequence
    bare = {k: v for k, v in plan.items() if "gather_input" not in v}
    with pytest.raises(ValueError, match="reads the sequence length from its input.*'gather_input'"):
        pt.tensor.check_plan(llama, bare, 2, sequence_parallel=True)
    pt.tensor.check_plan(llama, bare, 2)   # without it, the plan is fine
    # a tied pair cut one way and left whole the other, or cut two ways
    gpt2 = hf_models.build("gpt2", tied=True, **SIZES)
    for plan in ({"transformer.wte": "vocab"}, {"transformer.wte": "vocab", "lm_head": "rowwise"}):
        with pytest.raises(ValueError, match="are one tied parameter"):
            pt.tensor.check_plan(gpt2, plan, 2)
    # an embedding option no rank can honour alone: refused, and plan_for leaves the tied pair whole
    gpt2.transformer.wte.max_norm = 1.0
    with pytest.raises(ValueError, match="max_norm=1.0 cannot be cut by rows"):
        pt.tensor.check_plan(gpt2, {"transformer.wte": "vocab", "lm_head": "colwise_gather"}, 2)
    plan = pt.tensor.plan_for(gpt2)
    assert "transformer.wte" not in plan and "lm_head" not in plan
    pt.tensor.check_plan(gpt2, plan, 2)
    with pytest.raises(ValueError, match="'colwise_gather' cuts an nn.Linear"):
        pt.tensor.check_plan(gpt2, {"transformer.wpe": "colwise_gather"}, 2)


@pytest.mark.timeout(60)
def test_conv1d_is_cut_as_its_transpose():
    """Without a group: a one-rank 'group' of rank 1 of 2 holds the second slice of a Conv1D
    in its own (in, out) layout, and computes what that slice of nn.Linear would."""
    from transformers.pytorch_utils import Conv1D

    class Half:
        world_size, rank = 2, 1
    torch.manual_seed(0)
    conv = Conv1D(12, 4)    # (in 4, out 12): q | k | v of 4 each
    col = pt.tensor.ColumnParallelLinear.from_linear(conv, Half(), parts=3, input_gathered=True)
    assert col.transposed and col.weight.shape == (4, 6) and col.bias.shape == (6,)
    assert torch.equal(col.weight, torch.cat([conv.weight[:, 2:4], conv.weight[:, 6:8], conv.weight[:, 10:12]], 1))
    x = torch.randn(2, 3, 4)
    whole = conv(x)
    assert torch.allclose(col(x), torch.cat([whole[..., 2:4], whole[..., 6:8], whole[..., 10:12]], -1))
    row = pt.tensor.RowParallelLinear.from_linear(Conv1D(4, 12), Half())
    assert row.transposed and row.weight.shape == (6, 4)
