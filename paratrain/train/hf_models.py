"""Small Hugging Face models, built from configs (no download): GPT-2, BERT and Llama.

    model = hf_models.build("llama")                 # a transformers LlamaForCausalLM, random init
    model = hf_models.build("gpt2", tied=False)      # GPT-2 with its head untied from the embedding
    lm = hf_models.LogitsOf(model)                   # forward(ids) -> logits: a tensor in, a tensor out

The three families cover the shapes most language models have: GPT-2 (fused
q/k/v in transformers' ``Conv1D``, tied input and output embeddings), BERT (an
encoder with a padding row in its embedding, tied too) and Llama (separate
q/k/v/o with grouped-query attention, gated MLP, RMSNorm, rotary positions;
untied). Dropout is off, so a model is a pure function of its parameters and
every strategy can be checked against one process.

``transformers`` is an optional dependency (``pip install -e '.[hf]'``): it is
imported when a model is built, and its absence is an error that says so.
"""
from torch import nn

FAMILIES = ("gpt2", "bert", "llama")

SIZES = {"vocab": 256, "positions": 64, "width": 64, "layers": 4, "heads": 4, "kv_heads": 2, "mlp": 128}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("the hf-* models need the transformers package: pip install -e '.[hf]' "
                          "(or pip install transformers)") from None
    transformers.logging.set_verbosity_error()   # the tiny configs' token ids outside the vocabulary
    return transformers


def config(family, tied=None, **sizes):
    """The transformers config of a small ``family`` model; ``sizes`` override SIZES.
    tied: None keeps the family's default (GPT-2 and BERT tie, Llama does not)."""
    tf = _transformers()
    s = dict(SIZES, **sizes)
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=s["vocab"], n_positions=s["positions"], n_embd=s["width"],
                            n_layer=s["layers"], n_head=s["heads"], n_inner=s["mlp"],
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif family == "bert":
        cfg = tf.BertConfig(vocab_size=s["vocab"], max_position_embeddings=s["positions"], hidden_size=s["width"],
                            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                            intermediate_size=s["mlp"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    elif family == "llama":
        cfg = tf.LlamaConfig(vocab_size=s["vocab"], max_position_embeddings=s["positions"], hidden_size=s["width"],
                             num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                             num_key_value_heads=s["kv_heads"], intermediate_size=s["mlp"])
    else:
        raise ValueError(f"unknown Hugging Face family {family!r}; choose from {', '.join(FAMILIES)}")
    if tied is not None:
        cfg.tie_word_embeddings = bool(tied)
    return cfg


def build(family, tied=None, **sizes):
    """A randomly initialised ``family`` model (GPT2LMHeadModel, BertForMaskedLM,
    LlamaForCausalLM) from ``config``; seed torch first for the same weights everywhere."""
    cfg = config(family, tied, **sizes)   # (which refuses an unknown family)
    tf = _transformers()
    return {"gpt2": tf.GPT2LMHeadModel, "bert": tf.BertForMaskedLM, "llama": tf.LlamaForCausalLM}[family](cfg)


class LogitsOf(nn.Module):
    """``forward(ids) -> hf(input_ids=ids).logits``: a Hugging Face model as a module that
    takes a tensor and returns one, the thin wrapper torch's pipelining examples use."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(input_ids=ids).logits
