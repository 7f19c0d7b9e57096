"""`python -m cute_flash traincheck [--packed]`: a small causal transformer (2 blocks) trained
for 200 steps on fixed random tokens, with cute-flash attention and with
`F.scaled_dot_product_attention` through its FLASH backend (flash-attn 2's C++ kernels), from the
same initial weights and batches; and, as the yardstick, with SDPA's EFFICIENT backend. Rounding
differences grow along a training run, so two correct kernels do not give identical curves: ours
should stay as close to FLASH as another correct kernel (EFFICIENT) does. Both maximum relative
differences are printed.

`packed`: each step's tokens are one packed row of documents of random lengths (sequence
packing, as fine-tuning runs it): ours through `flash_attn_varlen_func` on `cu_seqlens`, SDPA
causal on each document alone."""
from __future__ import annotations

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, attention):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.attention = heads, kv_heads, dim // heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cu_seqlens):
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, k, v = q.view(b, s, self.heads, d), k.view(b, s, self.kv_heads, d), v.view(b, s, self.kv_heads, d)
        x = x + self.proj(self.attention(q, k, v, cu_seqlens).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


def cute_flash_attention(q, k, v, cu_seqlens):
    """Causal attention of (b, s, h, d) rows; with `cu_seqlens` (b 1) each document alone."""
    from cute_flash import flash_attn_func, flash_attn_varlen_func

    if cu_seqlens is None:
        return flash_attn_func(q, k, v, causal=True)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens, cu_seqlens, longest, longest, causal=True)[None]


def sdpa_attention(backend):
    from torch.nn.attention import sdpa_kernel

    def causal(q, k, v):
        with sdpa_kernel(backend):
            out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    def attention(q, k, v, cu_seqlens):
        if cu_seqlens is None:
            return causal(q, k, v)
        edges = cu_seqlens.tolist()
        return torch.cat([causal(q[:, a:e], k[:, a:e], v[:, a:e]) for a, e in zip(edges, edges[1:])], dim=1)

    return attention


def documents(tokens: int, count: int, generator) -> torch.Tensor:
    """cu_seqlens (count + 1,) int32 of `count` documents of random lengths (at least 1) that
    fill `tokens`."""
    cuts = torch.randperm(tokens - 1, device=generator.device, generator=generator)[:count - 1] + 1
    edges = torch.cat([cuts.new_tensor([0]), cuts.sort().values, cuts.new_tensor([tokens])])
    return edges.to(torch.int32)


def train(attention, steps=200, vocab=512, dim=256, seqlen=256, batch=8, seed=0, packed=False):
    """Loss per step; weights and batches depend on `seed` only (bf16 autocast, AdamW). `packed`:
    a step's batch x seqlen tokens as one row of 24 documents."""
    torch.manual_seed(seed)
    embed = nn.Embedding(vocab, dim)
    blocks = nn.ModuleList(Block(dim, 4, 4, attention) for _ in range(2))
    head = nn.Linear(dim, vocab)
    model = nn.ModuleDict(dict(embed=embed, blocks=blocks, head=head)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    data = torch.randint(0, vocab, (4, batch, seqlen + 1), device="cuda", generator=gen)
    cu = [documents(batch * seqlen, 24, gen) if packed else None for _ in data]
    losses = []
    for step in range(steps):
        tokens = data[step % len(data)]
        inputs = tokens[:, :-1].reshape(1, -1) if packed else tokens[:, :-1]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = model["embed"](inputs)
            for block in model["blocks"]:
                x = block(x, cu[step % len(data)])
            logits = model["head"](x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def compare(steps=200, packed=False):
    """Loss curves {"cute-flash", "FLASH", "EFFICIENT"} and the max relative differences of ours
    and of EFFICIENT to FLASH."""
    from torch.nn.attention import SDPBackend

    curves = {"cute-flash": train(cute_flash_attention, steps, packed=packed),
              "FLASH": train(sdpa_attention(SDPBackend.FLASH_ATTENTION), steps, packed=packed),
              "EFFICIENT": train(sdpa_attention(SDPBackend.EFFICIENT_ATTENTION), steps, packed=packed)}
    return curves, max_rel(curves["cute-flash"], curves["FLASH"]), max_rel(curves["EFFICIENT"], curves["FLASH"])


def main(packed=False):
    curves, ours, yardstick = compare(packed=packed)
    for step in (0, 49, 99, 149, 199):
        print(f"step {step + 1:3}: " + "  ".join(f"{name} {c[step]:.4f}" for name, c in curves.items()))
    flash = curves["FLASH"]
    print(f"traincheck{' (packed documents)' if packed else ''}: 200 steps, loss {flash[0]:.3f} -> {flash[-1]:.3f} "
          f"(FLASH); max relative difference to "
          f"FLASH: cute-flash {ours:.2e}, EFFICIENT {yardstick:.2e}{'' if math.isfinite(ours) else ' (not finite)'}")
    return ours
