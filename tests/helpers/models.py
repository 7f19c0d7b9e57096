"""Small random-weight transformers models for the integration tests: one config per family the
tests cover (Llama-style GQA, Mistral-style sliding windows, Gemma-2-style softcap and
alternating windows)."""
from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "gemma2")


def config(family: str, **overrides):
    """A two- or four-layer config of `family` with 4 query heads over 2 KV heads of 16 dims."""
    import transformers

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, **common)
    elif family == "mistral":
        cfg = transformers.MistralConfig(num_hidden_layers=2, sliding_window=8, **common)
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=8, attn_logit_softcapping=20.0,
                                        query_pre_attn_scalar=16, **common)
    else:
        raise ValueError(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def model(family: str, attn_implementation: str, dtype=torch.float32, device="cpu", seed: int = 0):
    """A causal LM of `family` with weights drawn from `seed` (the same for every implementation)."""
    import transformers

    torch.manual_seed(seed)
    built = transformers.AutoModelForCausalLM.from_config(config(family), attn_implementation=attn_implementation,
                                                          dtype=dtype)
    return built.to(device).eval()
