"""The `mla_decode` bench section: MLA decode (q and the latent cache 576 wide, V the cache's
first 512 columns, one KV head) in GB/s of the cache read once, ours over pages of 64 rows and a
contiguous cache, beside torch SDPA's efficient-attention and cuDNN backends on the contiguous
cache (V passed as the view, the KV head broadcast to every query head), in the same run."""
from __future__ import annotations

from cute_flash.tools.peers import time_ms

MLA_CELLS = ((64, 128, 4096), (64, 128, 16384), (128, 128, 8192), (64, 16, 16384), (128, 16, 16384))  # (b, h, L)
PAGE = 64
SDPA_BACKENDS = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _sdpa_ms(backend: str, q, k, v, scale):
    """SDPA on one backend (its KV head shared by every query head), or None where it refuses
    the shape."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h = q.shape[2]
    # the KV head broadcast to every query head with a zero stride (enable_gqa found no efficient kernel; the
    # math backend copies K and V per head, tens of GB here, so it is not a column)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = (x.expand(-1, h, -1, -1) for x in (kt, vt))
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            def run():
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale)
            run()
            return time_ms(run)
    except RuntimeError:
        return None


def run_mla_decode(cells=MLA_CELLS) -> list[dict]:
    import torch

    from cute_flash import flash_attn_with_kvcache

    rows = []
    for b, h, cache in cells:
        kv = torch.randn(b, cache, 1, 576, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, 1, h, 576, device="cuda", dtype=torch.bfloat16)
        nbytes = kv.numel() * kv.element_size()
        seqlens = torch.full((b,), cache, dtype=torch.int32, device="cuda")
        pages = kv.view(b * cache // PAGE, PAGE, 1, 576)
        order = torch.randperm(pages.shape[0], device="cuda")
        pages = pages[order].contiguous()
        table = torch.argsort(order).to(torch.int32).view(b, cache // PAGE)
        scale = 192 ** -0.5
        v, v_pages = kv[..., :512], pages[..., :512]  # V: the cache's first 512 columns, a view
        ours = {
            "paged": time_ms(lambda: flash_attn_with_kvcache(q, pages, v_pages, cache_seqlens=seqlens,
                                                             block_table=table, softmax_scale=scale)),
            "contiguous": time_ms(lambda: flash_attn_with_kvcache(q, kv, v, cache_seqlens=seqlens,
                                                                  softmax_scale=scale)),
        }
        peers = {name: _sdpa_ms(name, q, kv, v, scale) for name in SDPA_BACKENDS}
        row = dict(batch=b, heads=h, cache=cache, **{k: nbytes / ms / 1e6 for k, ms in ours.items()},
                   **{k: (None if ms is None else nbytes / ms / 1e6) for k, ms in peers.items()})
        best = max((row[k] for k in SDPA_BACKENDS if row[k] is not None), default=None)
        row["paged_vs_best"] = None if best is None else row["paged"] / best
        rows.append(row)
        print(row, flush=True)
        del kv, q, pages, v, v_pages
        torch.cuda.empty_cache()
    return rows


def format_mla_decode(rows: list[dict]) -> str:
    def cell(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)

    lines = ["MLA decode (q / cache 576, V its first 512 columns, one KV head, bf16): GB/s of the cache read once",
             "",
             "| batch | heads | cache | ours, pages of 64 | ours, contiguous | SDPA efficient | SDPA cuDNN "
             "| ours paged / best SDPA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['heads']} | {r['cache']} | {cell(r['paged'])} | {cell(r['contiguous'])} "
                     f"| {cell(r['EFFICIENT_ATTENTION'])} | {cell(r['CUDNN_ATTENTION'])} "
                     f"| {cell(r['paged_vs_best'], '{:.2f}')} |")
    return "\n".join(lines)
