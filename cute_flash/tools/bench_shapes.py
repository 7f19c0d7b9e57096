"""`python -m cute_flash bench --sections shapes`: the model shapes of issue "Attention shapes of
today's models", each beside what it is held to, in one run:

- MLA's v head dim (q / k 192, v 128): forward, forward + backward and backward alone (the
  two timings' difference) TFLOP/s, ours against cuDNN (through SDPA) and flash-attn-4 where
  they take the shape;
- learnable sinks: ours with a sink over ours without, forward and forward + backward (the bar:
  at most 3% slower), and flash-attn-4 with its sink;
- packed queries in the KV-cache call (64 sequences, 1-16 new tokens each, 4k-32k cached): GB/s
  of K / V read over our plain decode on the same caches (the bar: 0.9); and that decode with a
  sink over without one (the sinks' bar again: the KV-cache call folds the sink in after the
  kernels).

FLOPs count the visible pairs: 2 * (d_qk + d_v) per pair and head forward, 3.5x that forward +
backward, 2.5x the backward (the other sections' convention).
"""
from __future__ import annotations

from cute_flash.tools.peers import grad_ms, graph_time_ms, time_ms, visible_pairs

MLA_CELLS = ((4096, True), (4096, False), (16384, True))  # (seqlen, causal), 16k tokens, 128 heads' worth
SINK_CELLS = ((4096, True), (16384, True), (4096, False))
VARLEN_CACHES = (4096, 32768)


def _fa4():
    """flash-attn-4's own `flash_attn_func` (keyword arguments as it takes them), or None."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def _fwd_bwd_ms(fn, leaves, dout):
    """(forward ms without a gradient, as inference calls it, forward + backward ms) of
    fn(*leaves) -> out, or None where it refuses."""
    import torch

    both = grad_ms(fn, leaves, dout)
    if both is None:
        return None
    with torch.no_grad():
        return time_ms(lambda: fn(*leaves)), both


def run_mla(cells=MLA_CELLS, d=192, d_v=128, tokens=16384, nheads=16):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cute_flash import flash_attn_func

    fa4 = _fa4()
    rows = []
    for seqlen, causal in cells:
        b = max(1, tokens // seqlen)
        q, k = (torch.randn(b, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, seqlen, nheads, d_v, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn(b, seqlen, nheads, d_v, device="cuda", dtype=torch.bfloat16)
        flops = 2 * b * nheads * (d + d_v) * visible_pairs(seqlen, seqlen, causal)
        row = dict(d=d, d_v=d_v, seqlen=seqlen, causal=causal, batch=b, nheads=nheads, flops=flops)

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

        peers = {"ours": lambda q, k, v: flash_attn_func(q, k, v, causal=causal), "cudnn": cudnn}
        if fa4 is not None:
            peers["fa4"] = lambda q, k, v: fa4(q, k, v, causal=causal)[0]
        for name, fn in peers.items():
            ms = _fwd_bwd_ms(fn, [x.detach().requires_grad_() for x in (q, k, v)], dout)
            row[f"{name}_fwd"] = flops / ms[0] / 1e9 if ms else None
            row[f"{name}_fwdbwd"] = 3.5 * flops / ms[1] / 1e9 if ms else None
            row[f"{name}_bwd"] = 2.5 * flops / (ms[1] - ms[0]) / 1e9 if ms and ms[1] > ms[0] else None
        rows.append(row)
        print(row, flush=True)
    return rows


def run_sinks(cells=SINK_CELLS, d=128, tokens=16384, nheads=32, nheads_k=8):
    import torch

    from cute_flash import flash_attn_func

    fa4 = _fa4()
    rows = []
    for seqlen, causal in cells:
        b = max(1, tokens // seqlen)
        q, dout = (torch.randn(b, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, seqlen, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sink = torch.randn(nheads, device="cuda", requires_grad=True)
        row = dict(d=d, seqlen=seqlen, causal=causal, batch=b, nheads=nheads, nheads_k=nheads_k)
        calls = {"ours": lambda q, k, v: flash_attn_func(q, k, v, causal=causal),
                 "ours_sink": lambda q, k, v: flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)}
        if fa4 is not None:
            calls["fa4_sink"] = lambda q, k, v: fa4(q, k, v, causal=causal, learnable_sink=sink)[0]
        for name, fn in calls.items():
            ms = _fwd_bwd_ms(fn, [x.detach().requires_grad_() for x in (q, k, v)], dout)
            row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = ms if ms else (None, None)
        rows.append(row)
        print(row, flush=True)
    return rows


def run_varlen_decode(caches=VARLEN_CACHES, batch=64, nheads=32, nheads_k=8, d=128, max_new=16, seed=0):
    """Packed queries of 1..max_new tokens per sequence (drawn), each appending as many keys,
    against plain decode (one query, one appended key) on the same caches; GB/s of K / V read,
    eager and replayed from a CUDA graph (as a serving loop runs decode: the packed call's torch
    calls around the kernel then cost their GPU time alone); and the plain decode's ms with a
    learnable sink and without."""
    import torch

    from cute_flash import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(seed)
    rows = []
    for cache in caches:
        counts = torch.randint(1, max_new + 1, (batch,), generator=g)
        cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32).cuda()
        total = int(counts.sum())
        k_cache, v_cache = (torch.randn(batch, cache, nheads_k, d, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        lens = torch.full((batch,), cache - max_new, dtype=torch.int32, device="cuda")
        q = torch.randn(total, nheads, d, device="cuda", dtype=torch.bfloat16)
        k_new, v_new = (torch.randn(total, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q1 = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16)
        k1, v1 = (torch.randn(batch, 1, nheads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def packed():
            return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True,
                                           cu_seqlens_q=cu, cu_seqlens_k_new=cu, max_seqlen_q=max_new)

        sink = torch.randn(nheads, device="cuda")

        def decode(**sinks):
            return flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=lens, causal=True, **sinks)

        keys_packed = batch * (cache - max_new) + total
        keys_decode = batch * (cache - max_new + 1)
        per_key = 2 * nheads_k * d * 2  # K and V, bf16
        decode_ms = time_ms(decode)
        packed_graph_ms, decode_graph_ms = graph_time_ms(packed), graph_time_ms(decode)
        row = dict(batch=batch, cache=cache, new_tokens=total,
                   packed_gbs=keys_packed * per_key / time_ms(packed) / 1e6,
                   decode_gbs=keys_decode * per_key / decode_ms / 1e6, decode_ms=decode_ms,
                   packed_graph_gbs=keys_packed * per_key / packed_graph_ms / 1e6 if packed_graph_ms else None,
                   decode_graph_gbs=keys_decode * per_key / decode_graph_ms / 1e6 if decode_graph_ms else None,
                   decode_sink_ms=time_ms(lambda: decode(learnable_sink=sink)))
        rows.append(row)
        print(row, flush=True)
    return rows


def _x(value, fmt=".0f"):
    return "-" if value is None else format(value, fmt)


def format_shapes(result: dict) -> str:
    """The three tables, each with the ratio its bar is about."""
    kinds = ("fwd", "fwdbwd", "bwd")
    out = ["MLA (q / k 192, v 128), TFLOP/s (backward alone: forward + backward less the forward):", "",
           "| seqlen | causal | batch x heads | ours fwd | cuDNN fwd | FA4 fwd | ours fwd+bwd | cuDNN fwd+bwd "
           "| FA4 fwd+bwd | ours bwd | cuDNN bwd | FA4 bwd | ours/best fwd | ours/best fwd+bwd | ours/best bwd |",
           "|" + "---|" * 15]
    for r in result.get("mla", []):
        ratios = []
        for key in kinds:
            best = max((x for x in (r.get(f"cudnn_{key}"), r.get(f"fa4_{key}")) if x), default=None)
            ratios.append(r[f"ours_{key}"] / best if best and r.get(f"ours_{key}") else None)
        out.append(f"| {r['seqlen']} | {r['causal']} | {r['batch']}x{r['nheads']} | "
                   + " | ".join(_x(r.get(f"{n}_{k}")) for k in kinds for n in ("ours", "cudnn", "fa4"))
                   + " | " + " | ".join(_x(x, ".3f") for x in ratios) + " |")
    out += ["", "Learnable sinks, ms (ours with a sink over ours without: the bar is 1.03):", "",
            "| seqlen | causal | batch x heads | fwd | fwd, sink | FA4 fwd, sink | sink / none fwd | fwd+bwd "
            "| fwd+bwd, sink | FA4 fwd+bwd, sink | sink / none fwd+bwd |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("sinks", []):
        cells = []
        for key in ("fwd_ms", "fwdbwd_ms"):
            plain, sink, fa4 = r.get(f"ours_{key}"), r.get(f"ours_sink_{key}"), r.get(f"fa4_sink_{key}")
            cells += [_x(plain, ".3f"), _x(sink, ".3f"), _x(fa4, ".3f"),
                      _x(sink / plain if plain and sink else None, ".3f")]
        out.append(f"| {r['seqlen']} | {r['causal']} | {r['batch']}x{r['nheads']} | " + " | ".join(cells) + " |")
    out += ["", "Packed queries in the KV-cache call, GB/s of K / V read (the bar: 0.9 of plain decode), eager "
            "and under CUDA graphs:", "",
            "| sequences | cache | new tokens | packed | plain decode | packed / decode | packed, graph "
            "| plain decode, graph | packed / decode, graph |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("varlen_decode", []):
        packed, decode = r.get("packed_graph_gbs"), r.get("decode_graph_gbs")
        out.append(f"| {r['batch']} | {r['cache']} | {r['new_tokens']} | {r['packed_gbs']:.0f} "
                   f"| {r['decode_gbs']:.0f} | {r['packed_gbs'] / r['decode_gbs']:.3f} | {_x(packed)} | {_x(decode)} "
                   f"| {_x(packed / decode if packed and decode else None, '.3f')} |")
    out += ["", "Learnable sinks in decode (the KV-cache call, one query a sequence), ms (the bar is 1.03):", "",
            "| sequences | cache | decode | decode, sink | sink / none |", "|---|---|---|---|---|"]
    for r in result.get("varlen_decode", []):
        if r.get("decode_sink_ms"):
            out.append(f"| {r['batch']} | {r['cache']} | {r['decode_ms']:.3f} | {r['decode_sink_ms']:.3f} "
                       f"| {r['decode_sink_ms'] / r['decode_ms']:.3f} |")
    return "\n".join(out)


def run_shapes() -> dict:
    return dict(mla=run_mla(), sinks=run_sinks(), varlen_decode=run_varlen_decode())
