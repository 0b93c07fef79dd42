"""A transformers family paratrain names nowhere, for the workers that check a model
"shaped like" GPT-2, BERT or Llama needs no change: Qwen2 (q/k/v with biases,
grouped-query attention, rotary positions, RMSNorm, a gated MLP; untied)."""


def qwen2(sizes):
    """A small, randomly initialised Qwen2ForCausalLM; ``sizes`` as hf_models.SIZES."""
    import transformers
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=sizes["vocab"], hidden_size=sizes["width"], intermediate_size=sizes["mlp"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=sizes["positions"]))
