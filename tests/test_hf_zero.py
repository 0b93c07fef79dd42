"""pt.ZeRO on any nn.Module: Hugging Face GPT-2 (tied and untied), BERT and Llama, and blocks
returning dicts, dataclasses, tuples with None or opaque objects, equal to one process at
every stage, as pt.DataParallel is on the same models (tests/workers/hf_zero.py); and, in
process, how stage 3 chooses its units."""
import warnings

import pytest
import torch
from torch import nn

from conftest import launch, passed_on_every_rank
from paratrain.parallel.zero.layout import bucket_units, layer_units
from paratrain.train import hf_models

SMALL = dict(vocab=96, positions=16, width=32, layers=2, heads=4, kv_heads=2, mlp=64)


@pytest.mark.timeout(240)
def test_hf_models_under_data_parallel_and_every_stage_equal_one_process_and_hold_the_papers_bytes():
    res = launch(2, "hf_zero.py", timeout=230)
    passed_on_every_rank(res, "hf zero", 2)


def names(units):
    return [u.name for u in units]


def owned(units, name):
    return {n for u in units if u.name == name for n, _ in u.params}


def units_of(model, units=None):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # none of these is lopsided
        return layer_units(model, 2, units)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family,blocks", [("gpt2", "transformer.h"), ("bert", "bert.encoder.layer"),
                                           ("llama", "model.layers")])
def test_stage3_units_are_the_blocks_and_a_root_owning_the_rest_and_the_tied_weights(family, blocks):
    torch.manual_seed(0)
    model = hf_models.build(family, **SMALL)
    units = units_of(model)
    assert names(units) == ["(root)", f"{blocks}.0", f"{blocks}.1"]
    every = [q for u in units for _, q in u.params]
    assert len(every) == len({id(q) for q in every}) == len(list(model.parameters()))   # each once
    root = owned(units, "(root)")
    assert all(not n.startswith(blocks + ".") for n in root)
    if family == "gpt2":   # tied: one parameter, in the root, under its first name
        assert model.lm_head.weight is model.transformer.wte.weight
        assert "transformer.wte.weight" in root and "lm_head.weight" not in root


@pytest.mark.timeout(60)
def test_units_by_class_name_or_predicate_and_nested():
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Block
    torch.manual_seed(0)
    model = hf_models.build("gpt2", **SMALL)
    assert names(units_of(model, GPT2Block)) == ["(root)", "transformer.h.0", "transformer.h.1"]
    with pytest.warns(UserWarning, match=r"unit \(root\) holds"):   # the root keeps block 1 and the embeddings
        one = layer_units(model, 2, ["transformer.h.0"])
    assert names(one) == ["(root)", "transformer.h.0"]
    assert "transformer.h.1.attn.c_attn.weight" in owned(one, "(root)")
    with pytest.warns(UserWarning, match=r"unit \(root\) holds"):   # the root keeps the MLPs
        by_predicate = layer_units(model, 2, lambda name, m: name.endswith(".attn"))
    assert names(by_predicate) == ["(root)", "transformer.h.0.attn", "transformer.h.1.attn"]
    nested = units_of(model, [GPT2Block, GPT2MLP])   # a block owns what its MLP unit does not
    assert names(nested) == ["(root)", "transformer.h.0", "transformer.h.0.mlp", "transformer.h.1",
                             "transformer.h.1.mlp"]
    assert not any(".mlp." in n for n in owned(nested, "transformer.h.0"))


@pytest.mark.timeout(60)
def test_our_gpt_and_a_plain_stack_are_cut_in_their_layers():
    from paratrain.train.models import GPT
    units = units_of(GPT(n_layer=3, n_embd=32))
    assert names(units) == ["(root)", "blocks.0", "blocks.1", "blocks.2"]
    assert owned(units, "(root)") == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "head.weight"}
    stack = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert names(units_of(stack)) == ["0", "2"]


@pytest.mark.timeout(60)
def test_a_unit_holding_most_of_the_model_is_a_warning_naming_it_and_the_fix():
    torch.manual_seed(0)
    model = hf_models.build("gpt2", **SMALL)
    with pytest.warns(UserWarning, match=r"unit transformer holds \d+% .*units=.*GPT2Block"):
        layer_units(model, 2, ["transformer"])
    with pytest.warns(UserWarning, match=r"unit \(root\) holds 100%"):
        layer_units(model, 2, lambda name, m: False)


@pytest.mark.timeout(60)
def test_units_naming_no_module_or_a_module_list_is_refused_saying_what_to_name():
    torch.manual_seed(0)
    model = hf_models.build("gpt2", **SMALL)
    with pytest.raises(ValueError, match=r"'transformer\.h\.9', which is no module of this model.*'transformer\.h\.0'"):
        layer_units(model, 2, ["transformer.h.0", "transformer.h.9"])
    with pytest.raises(ValueError, match=r"'transformer\.h', a ModuleList, which never runs a forward"):
        layer_units(model, 2, "transformer.h")
    with pytest.raises(TypeError, match="module classes, module names or a predicate"):
        layer_units(model, 2, [3])


@pytest.mark.timeout(60)
def test_stage1_and_2_buckets_hold_a_tied_parameter_once():
    torch.manual_seed(0)
    model = hf_models.build("bert", **SMALL)   # ties the decoder to the word embeddings, and its bias
    held = [q for u in bucket_units(model, 2, 1e4) for _, q in u.params]
    assert len(held) == len({id(q) for q in held}) == len(list(model.parameters()))
