"""Small random-weight transformers models for the integration tests: one config per family the
tests cover (Llama-style GQA, Mistral-style sliding windows, Gemma-2-style softcap and
alternating windows, gpt-oss's attention sinks with alternating windows, DeepSeek-V3's MLA with
a value head dim of its own: q / k 24, v 16).

The mixture-of-experts families route every token to every expert: a top-k choice is a step
function of the attention output, so in bf16 a rounding difference between two correct kernels
could pick another expert for a near-tied token and move its logits by their own size."""
from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3")
# transformers' own attention each family is compared with: sdpa has no softcap or sinks (Gemma 2 and
# gpt-oss take eager)
BASELINE = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager", "deepseek_v3": "sdpa"}


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
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(num_hidden_layers=2, sliding_window=8, num_local_experts=4,
                                        num_experts_per_tok=4, **common)
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            num_hidden_layers=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=4, n_group=1,
            topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16,
            **{name: value for name, value in common.items() if name not in ("num_key_value_heads", "head_dim")})
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
