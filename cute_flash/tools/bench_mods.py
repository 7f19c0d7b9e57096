"""`python -m cute_flash bench --sections mods`: attention variants written in Python (issue
"Attention variants written in Python"), forward and forward + backward, bf16.

Each variant of `cute_flash.mods` at 4k and 16k tokens a sequence (16k tokens a batch, hidden
2048), d 64 and 128: ours (the default path), ours on the SM80 path (sm_90 only),
FlexAttention (torch.compile of `flex_attention` with the variant's torch twin: a
`create_block_mask` block mask for a mask, the score_mod as it is) and flash-attn-4 given the same
mods and block mask where it runs them. Ours takes the same block mask for a mask (`block_mask=`:
the kernels skip its empty blocks); "no lists" is ours with the mask_mod alone, evaluated on every
block the built-in range visits. Causal as a mask_mod beside the built-in `causal=True` prices a mod
that reproduces a flag. TFLOP/s count every (query, key) pair (4 * d FLOPs a pair forward, 3.5x
that forward + backward), the same work for every column, so ratios are ratios of times.
"""
from __future__ import annotations

import operator

from cute_flash.tools.peers import arch_path, grad_ms, hopper_gpu, time_ms

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (4096, 16384)
HEAD_DIMS = (64, 128)
# `_specs`' variants in its order: what `bench --mods` picks among
VARIANTS = ("document", "prefix_lm", "window_sinks", "relative_bias", "alibi", "softcap", "causal_mod")


def _specs(batch: int, seqlen: int, nheads: int):
    """The variants, with their inputs on the GPU: (name, ModSpec), causal as a mod last."""
    import cutlass.cute as cute
    import torch

    from cute_flash import mods

    gen = torch.Generator().manual_seed(0)
    docs = torch.cumsum(torch.rand(batch, seqlen, generator=gen) < 4 / seqlen, 1).to(torch.int32).cuda()

    @cute.jit
    def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return operator.ge(q_idx, kv_idx)

    return [
        ("document", mods.document_mask(docs)),
        ("prefix_lm", mods.prefix_lm(torch.full((batch,), seqlen // 4, dtype=torch.int32).cuda())),
        ("window_sinks", mods.sliding_window_with_sinks(1024, 4)),
        ("relative_bias", mods.relative_bias(torch.randn(nheads, 2 * 128 + 1, generator=gen).cuda())),
        ("alibi", mods.alibi(torch.rand(nheads, generator=gen).cuda())),
        ("softcap", mods.softcap(30.0)),
        ("causal_mod", mods.ModSpec(mask_mod=causal, ref_mask_mod=lambda b, h, q, k: q >= k)),
    ]


def _flex(spec, batch, nheads, seqlen):
    """FlexAttention on (b, s, h, d) tensors with the variant's twins, compiled. Dynamo is reset
    first: every variant recompiles `flex_attention`, and past dynamo's recompile limit (8) it
    runs the unfused eager fallback, 12 TFLOP/s on an H100 (docs/tuning/mods.md)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention)
    block_mask = None
    if spec.ref_mask_mod is not None:
        block_mask = create_block_mask(spec.ref_mask_mod, batch, None, seqlen, seqlen, device="cuda")
    score_mod = spec.ref_score_mod

    def run(q, k, v):
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                        block_mask=block_mask).transpose(1, 2)
    return run


def _fa4(spec, block_mask=None):
    """flash-attn-4 with the variant's mods and, for a mask, the same block mask as ours (its
    forward lists from the BlockMask's key lists, its backward's from the query lists), or None
    when flash-attn-4 is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except ImportError:
        return None
    sparse = {}
    if block_mask is not None:
        m, size = block_mask, tuple(block_mask.BLOCK_SIZE)
        sparse = dict(block_sparse_tensors=BlockSparseTensorsTorch(
                          m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices, block_size=size),
                      block_sparse_tensors_bwd=BlockSparseTensorsTorch(
                          m.q_num_blocks, m.q_indices, m.full_q_num_blocks, m.full_q_indices, block_size=size))
    aux = list(spec.aux_tensors) or None
    return lambda q, k, v: flash_attn_func(q, k, v, score_mod=spec.score_mod, mask_mod=spec.mask_mod,
                                           aux_tensors=aux, **sparse)[0]


def bench_cell(d: int, seqlen: int, names=None) -> list[dict]:
    """The variants' rows at one head dim and length (`names`: those variants only)."""
    import torch

    from cute_flash import flash_attn_func

    batch, nheads = max(1, TOKENS // seqlen), HIDDEN // d
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    work = 4 * batch * nheads * d * seqlen * seqlen
    rows = []
    for name, spec in _specs(batch, seqlen, nheads):
        if names is not None and name not in names:
            continue
        peers = {"ours": lambda q, k, v, s=spec: flash_attn_func(q, k, v, **s.kwargs())}
        block_mask = None
        if spec.mask_mod is not None:
            peers["nolists"] = peers["ours"]
            block_mask = spec.block_mask(batch, 1, seqlen, seqlen)
            peers["ours"] = lambda q, k, v, s=spec, m=block_mask: flash_attn_func(q, k, v, **s.kwargs(), block_mask=m)
        if name == "causal_mod":
            peers["causal_flag"] = lambda q, k, v: flash_attn_func(q, k, v, causal=True)
        peers["flex"] = _flex(spec, batch, nheads, seqlen)
        fa4 = _fa4(spec, block_mask)
        if fa4 is not None:
            peers["fa4"] = fa4
        row = dict(variant=name, d=d, seqlen=seqlen, batch=batch, nheads=nheads)
        for peer, fn in peers.items():
            row[f"{peer}_fwd"], row[f"{peer}_fwdbwd"] = _rates(fn, leaves, dout, work)
        if hopper_gpu():
            with arch_path("sm80"):
                row["sm80_fwd"], row["sm80_fwdbwd"] = _rates(peers["ours"], leaves, dout, work)
        print(row, flush=True)
        rows.append(row)
    return rows


def _rates(fn, leaves, dout, work):
    """(forward, forward + backward) TFLOP/s of fn on the leaves, None where fn refuses."""
    import torch

    try:
        with torch.no_grad():
            fwd = time_ms(lambda: fn(*(x.detach() for x in leaves)))
    except Exception:  # a peer that does not run this variant (its message is the peer's, not ours)
        return None, None
    both = grad_ms(fn, leaves, dout)
    return work / fwd / 1e9, (3.5 * work / both / 1e9 if both else None)


def run_mods(head_dims=HEAD_DIMS, seqlens=SEQLENS, names=None) -> list[dict]:
    """`bench_cell` at every head dim and length; `names` (None: every variant) picks variants."""
    unknown = set(names or ()) - set(VARIANTS)
    if unknown:
        raise ValueError(f"mods bench: no variant {sorted(unknown)}; the variants: {', '.join(VARIANTS)}")
    return [row for d in head_dims for s in seqlens for row in bench_cell(d, s, names)]


def format_mods(rows) -> str:
    """One table per pass: ours (with the block mask), ours without it, SM80, FlexAttention,
    flash-attn-4, and ours over FlexAttention and over flash-attn-4; the causal mod's row also
    gives the built-in flag's rate."""
    out = []
    for key, title in (("fwd", "forward"), ("fwdbwd", "forward + backward (3.5x)")):
        out += [f"Attention variants as mods, {title}, TFLOP/s (every pair counted):", "",
                "| variant | d | seqlen | ours | no lists | SM80 | FlexAttention | FA4 | built-in flag | ours/Flex "
                "| ours/FA4 |", "|---" * 11 + "|"]
        for r in rows:
            ours, nolists, sm80, flex, fa4, flag = (r.get(f"{p}_{key}") for p in ("ours", "nolists", "sm80", "flex",
                                                                                   "fa4", "causal_flag"))
            cells = [f"{x:.0f}" if x else "-" for x in (ours, nolists, sm80, flex, fa4, flag)]
            ratios = [f"{ours / x:.2f}" if ours and x else "-" for x in (flex, fa4)]
            out.append(f"| {r['variant']} | {r['d']} | {r['seqlen']} | " + " | ".join(cells + ratios) + " |")
        out.append("")
    return "\n".join(out)
