"""cute-flash as an attention implementation of Hugging Face transformers (5.x).

    from cute_flash.integrations.transformers import register
    register()                                      # the name "cute"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cute")

`register` adds `attention_forward` to transformers' attention registry and flash-attn's mask
rule to its mask registry: a model then passes 2-D padding masks (or none), never a 4-D one, as
it does for flash-attn. Every layer runs `flash_attn_func`, or `flash_attn_varlen_func` for
padded batches (unpadded here, padded back after) and for packed ones (`position_ids`
restarting at 0 in a batch of one row, or transformers' `cu_seq_lens_*` arguments), with the
layer's causal flag, scale, sliding window, softcap, attention sinks (`s_aux`, gpt-oss) and
dropout, forward and backward.

The name has no "flash" in it: transformers 5 takes any implementation whose name contains
"flash" for a flash-attn build it must load itself (`flash_attention_N`, or a kernel from the
hub), and refuses a registered function under such a name.
"""
from __future__ import annotations

import os

import torch

from cute_flash import flash_attn_func, flash_attn_varlen_func

NAME = "cute"


def register(name: str = NAME) -> str:
    """Register cute-flash under `name` with transformers' attention and mask registries (for
    every model, from then on in this process); returns the name to pass as
    `attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (b, h, sq, d), key / value (b, hk, sk,
    d[_v]), attention_mask a 2-D (b, sk) padding mask or None, s_aux a model's attention sinks
    (h,); returns (out (b, sq, h, d_v), None: no attention weights)."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (b, s, heads, d); v's head dim may differ (MLA)
    q, k, v = _half_precision(module, q, k, v)
    options = _options(module, k.shape[1], dropout, scaling, sliding_window, softcap, is_causal,
                       kwargs.get("deterministic"))
    if s_aux is not None:  # attention sinks (gpt-oss): flash-attn-4's learnable_sink
        options["learnable_sink"] = s_aux
    batch, seqlen_q = q.shape[:2]
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, options)
    elif all(kwargs.get(n) is not None for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")):
        out = _packed(q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_length_q"],
                      kwargs["max_length_k"], options)
    elif _is_packed(kwargs.get("position_ids"), batch):
        cu_seqlens, max_seqlen = _from_position_ids(kwargs["position_ids"])
        out = _packed(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, options)
    else:
        out = flash_attn_func(q, k, v, **options)
    return out.reshape(batch, seqlen_q, *out.shape[-2:]), None


def _options(module, seqlen_k, dropout, scaling, sliding_window, softcap, is_causal, deterministic) -> dict:
    """flash-attn's keyword arguments for a layer's call, as transformers' flash path sets them:
    a sliding window of w tokens is (w - 1, w - 1) (causal cuts the right edge to 0), and none
    when the keys fit in it."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (-1, -1)
    if sliding_window is not None and seqlen_k > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    return dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                softcap=softcap or 0.0, deterministic=deterministic)


def _half_precision(module, *tensors):
    """fp32 inputs (layer norms kept in fp32, PEFT) in the half dtype the kernels take: autocast's,
    else the module's first linear layer's."""
    if tensors[0].dtype != torch.float32:
        return tensors
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = next(m for m in module.modules() if isinstance(m, torch.nn.Linear)).weight.dtype
    return tuple(t.to(dtype) for t in tensors)


def _is_packed(position_ids, batch: int) -> bool:
    """A padding-free batch: one row whose positions restart (at 0) somewhere after its start."""
    if position_ids is None or batch != 1:
        return False
    return bool((position_ids[0, 1:] - position_ids[0, :-1] != 1).any())


def _from_position_ids(position_ids) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 (n + 1,), max length) of the sequences of a packed row: each starts
    where its position is 0."""
    positions = position_ids.flatten()
    starts = torch.nonzero(positions == 0).flatten()
    cu_seqlens = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options):
    """Sequences laid end to end in a (1, total, heads, d) batch: the varlen call."""
    flat = [x.reshape(-1, *x.shape[-2:]) for x in (q, k, v)]
    return flash_attn_varlen_func(*flat, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
                                  int(max_seqlen_q), int(max_seqlen_k), **options)


def _padded(q, k, v, attention_mask, options):
    """A padded batch: its valid rows packed, the varlen call, its output scattered back (zeros
    at padded query rows). The mask is (b, sk); queries are the last sq keys' rows (decoding
    with a KV cache: sq < sk, the valid queries right-aligned as transformers pads left)."""
    batch, seqlen_q = q.shape[:2]
    mask_k = attention_mask.bool()
    rows_k, cu_k, max_k = _unpad_indices(mask_k)
    # queries over all the keys (prefill, training) share the keys' rows: one more pass and host sync spared
    rows_q, cu_q, max_q = ((rows_k, cu_k, max_k) if seqlen_q == mask_k.shape[1]
                           else _unpad_indices(mask_k[:, -seqlen_q:]))
    out_rows = flash_attn_varlen_func(q.reshape(-1, *q.shape[-2:])[rows_q], k.reshape(-1, *k.shape[-2:])[rows_k],
                                      v.reshape(-1, *v.shape[-2:])[rows_k], cu_q, cu_k, max_q, max_k, **options)
    out = out_rows.new_zeros(batch * seqlen_q, *out_rows.shape[-2:])
    out[rows_q] = out_rows
    return out


def _unpad_indices(mask) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The flat indices of a (b, s) mask's valid rows, its cu_seqlens (int32) and longest row."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return torch.nonzero(mask.flatten()).flatten(), cu_seqlens, int(lengths.max())
