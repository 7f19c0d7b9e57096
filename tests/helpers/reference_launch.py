"""A stand-in for `cute_flash.launch` on the CPU, computing what the kernels compute with
`cute_flash.reference`: the forwards' (out, lse), and the backward the kernels run, from the
(out, lse) they are given (P = exp(S - lse), D = rowsum(dO * O), dS = P * (dP - D)), not from
autograd. So the API above the kernels (options, autograd, sinks) runs whole on the CPU.
No softcap or dropout in the backward (`flash_bwd` refuses them)."""
from __future__ import annotations

import sys
import types

import torch

from cute_flash.reference import apply_rotary_ref, attention_kvcache_ref, attention_ref, attention_varlen_ref


def _forward_options(kw):
    return dict(softmax_scale=kw["softmax_scale"], causal=kw["causal"], window_size=kw["window_size"],
                softcap=kw["softcap"], alibi_slopes=kw["alibi_slopes"], learnable_sink=kw.get("learnable_sink"))


def _grads(dout, q, k, v, out, lse, kw):
    """One sequence's gradients, (b, s, heads, d) layouts, by the kernels' formulas in float64."""
    assert kw["softcap"] == 0.0 and kw.get("dropout") is None
    o = _forward_options(kw)
    _, lse_ref, probs = attention_ref(q.double(), k.double(), v.double(), return_probs=True, **o)
    lse_ref = lse_ref.double().masked_fill(lse_ref == float("inf"), 0.0)
    given = lse.double().masked_fill(lse == float("inf"), 0.0)
    p = probs.double() * torch.exp(lse_ref - given).unsqueeze(-1)  # exp(S - lse) with the given lse
    group = q.shape[2] // k.shape[2]
    k_rep, v_rep = (x.double().repeat_interleave(group, dim=2) for x in (k, v))
    do = dout.double()
    d = (do * out.double()).sum(-1).permute(0, 2, 1)  # (b, h, sq)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v_rep)
    ds = p * (dp - d.unsqueeze(-1))
    scale = o["softmax_scale"]
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_rep) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    b, sk, hk, _ = k.shape
    dk, dv = (x.view(b, sk, hk, group, x.shape[-1]).sum(3) for x in (dk, dv))
    return dq, dk, dv, d.float()


def _rotated(x, rotary, pos):
    """Rows x (heads, d) rotated at position `pos` (clamped into the tables) when `rotary` is
    (cos, sin, interleaved): `apply_rotary_ref` on one token."""
    if rotary is None:
        return x
    cos, sin, interleaved = rotary
    pos = min(max(pos, 0), cos.shape[0] - 1)
    return apply_rotary_ref(x[None, None], cos, sin, seqlen_offsets=pos, interleaved=interleaved)[0, 0]


def _write(dest, value, like):
    value = value.to(like.dtype)
    return value if dest is None else dest.copy_(value)


class ReferenceLaunch(types.ModuleType):
    """`cute_flash.launch`'s entry points on CPU tensors."""

    def __init__(self):
        super().__init__("cute_flash.launch")
        self.calls = []
        self.value_dims = []  # v's head dim as each forward got it
        self.backward = self  # the custom ops call `launch.backward.flash_bwd`
        self.fold_queries = True  # `kvcache_query_group` folds GQA groups (no ALiBi), as the Hopper entry may

    def flash_fwd(self, q, k, v, dropout=None, **kw):
        assert dropout is None
        self.calls.append("flash_fwd")
        self.value_dims.append(v.shape[-1])
        return attention_ref(q, k, v, **_forward_options(kw))

    def flash_fwd_varlen(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                         seqused_k, dropout=None, **kw):
        assert dropout is None and block_table is None
        self.calls.append("flash_fwd_varlen")
        self.value_dims.append(v.shape[-1])
        return attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=seqused_k, **_forward_options(kw))

    def flash_fwd_kvcache(self, q, k_cache, v_cache, *, k, v, cache_seqlens, return_lse, folded_q=False, **kw):
        """With `folded_q` q's heads come in the fold's order (`kvcache_query_group`), and out /
        lse go back folded, as the launcher's are."""
        assert k is None and v is None and kw["cache_batch_idx"] is None and kw["rotary_cos"] is None
        self.calls.append("flash_fwd_kvcache")
        b, sq, h, d = q.shape
        g = h // k_cache.shape[2] if folded_q else 1
        q = q.view(b, sq, g, h // g, d).transpose(2, 3).reshape(b, sq, h, d)  # heads kh g + j again
        out, lse, *_ = attention_kvcache_ref(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                             block_table=kw["block_table"], **_forward_options(kw))
        if folded_q:  # (b, sq g, h / g, d) and (b, h / g, sq g): row j + g i of head kh is query i of head kh g + j
            out = out.view(b, sq, h // g, g, d).transpose(2, 3).reshape(b, sq * g, h // g, d)
            lse = lse.view(b, h // g, g, sq).transpose(2, 3).reshape(b, h // g, sq * g)
        return out, lse

    def kvcache_query_group(self, q, k_cache, v_cache, *, alibi_slopes, **kw):
        """The GQA group where `fold_queries` is on and there is no ALiBi (the Hopper entry's rule
        also weighs the tiles), else 1."""
        self.calls.append("kvcache_query_group")
        return q.shape[2] // k_cache.shape[2] if self.fold_queries and alibi_slopes is None else 1

    def pack_kvcache_queries(self, q, q_pad, lengths, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new,
                             cache_seqlens, block_table, rotary, per_row, fold=1):
        """The packing launch's work (kernels/sm80/append_packed.py), sequence by sequence: new
        rows into the caches (rows outside them skipped), the queries into q_pad's last rows of
        each sequence, rotated, their heads in the fold's order (head kh fold + j at j heads_k +
        kh), the rows before them zeroed; lengths written; each packed query's flat row
        returned."""
        self.calls.append("pack_kvcache_queries")
        batch, max_q = q_pad.shape[:2]
        rows = q_pad.view(-1, *q_pad.shape[2:])
        page_size = k_cache.shape[1]
        capacity = page_size if block_table is None else block_table.shape[1] * page_size
        flat = torch.empty(q.shape[0], dtype=torch.int64)
        for b in range(batch):
            start, new = int(cache_seqlens[b]), 0
            if k is not None:
                first, new = int(cu_seqlens_k_new[b]), int(cu_seqlens_k_new[b + 1] - cu_seqlens_k_new[b])
                for j in range(new):
                    pos = start + j
                    if not 0 <= pos < capacity:
                        continue
                    page, row = b, pos
                    if block_table is not None:
                        page, row = int(block_table[b, pos // page_size]), pos % page_size
                        if not 0 <= page < k_cache.shape[0]:
                            continue
                    k_cache[page, row] = _rotated(k[first + j], rotary, pos)
                    v_cache[page, row] = v[first + j]
            lengths[b] = start + new
            first, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])
            rows[b * max_q:b * max_q + max_q - n] = 0  # the filler rows before the queries
            for i in range(n):
                flat[first + i] = b * max_q + max_q - n + i
                row = _rotated(q[first + i], rotary, start + i if per_row else start)
                h, d = row.shape
                rows[flat[first + i]] = row.view(h // fold, fold, d).transpose(0, 1).reshape(h, d)
        return flat

    def flash_bwd(self, dout, q, k, v, out, lse, *, dq=None, dk=None, dv=None, **kw):
        self.calls.append("flash_bwd")
        gq, gk, gv, d = _grads(dout, q, k, v, out, lse, kw)
        return _write(dq, gq, q), _write(dk, gk, k), _write(dv, gv, v), d

    def flash_bwd_varlen(self, dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         seqused_k=None, dq=None, dk=None, dv=None, **kw):
        assert seqused_k is None
        self.calls.append("flash_bwd_varlen")
        gq, gk, gv = torch.zeros_like(q, dtype=torch.float64), torch.zeros_like(k, dtype=torch.float64), \
            torch.zeros_like(v, dtype=torch.float64)
        d = torch.zeros(lse.shape, dtype=torch.float32)
        for i in range(cu_seqlens_q.numel() - 1):
            qs, ks = slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]), slice(cu_seqlens_k[i], cu_seqlens_k[i + 1])
            g = _grads(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], out[None, qs], lse[None, :, qs], kw)
            gq[qs], gk[ks], gv[ks], d[:, qs] = g[0][0], g[1][0], g[2][0], g[3][0]
        return _write(dq, gq, q), _write(dk, gk, k), _write(dv, gv, v), d


def install(monkeypatch) -> ReferenceLaunch:
    """Put a ReferenceLaunch in place of `cute_flash.launch` and let CPU tensors pass the CUDA
    check, for one test."""
    import cute_flash
    from cute_flash import _validate

    launch = ReferenceLaunch()
    monkeypatch.setitem(sys.modules, "cute_flash.launch", launch)
    monkeypatch.setattr(cute_flash, "launch", launch, raising=False)  # `from cute_flash import launch` (ops.py)
    monkeypatch.setattr(_validate, "check_cuda", lambda named: None)
    return launch
