"""One rank of the ring-flash-attn check on the kernels (tests/gpu/test_ring_flash_attn_gpu.py):

    torchrun --nproc_per_node N -m tests.helpers.ring_worker OUT_DIR

Every rank draws the same whole sequence (seeded), runs cute-flash on all of it on its GPU (the
reference: forward and backward), then its shard through ring-flash-attn (ring, zigzag-ring, and
the llama3 all-gather variant over a packed batch), and writes each case's largest errors of its
output and gradient shards against the reference's to OUT_DIR/rank<R>.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from cute_flash import flash_attn_func, flash_attn_varlen_func
from cute_flash.integrations.flash_attn import import_ring_flash_attn

SEQLEN, HEAD_DIM, DTYPE = 4096, 128, torch.bfloat16
LENGTHS = (1000, 2500, 596)  # the llama3 case's packed sequences: they straddle the shards


def inputs(heads, heads_k, shape_prefix, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(*shape_prefix, heads, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g) for _ in range(2))
    k, v = (torch.randn(*shape_prefix, heads_k, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g) for _ in range(2))
    return q, k, v, dout


def grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def shard(x, variant, rank, world, dim):
    """This rank's part of a whole-sequence tensor: contiguous (ring, llama3), or chunks r and
    2w - 1 - r of 2w (zigzag)."""
    if variant == "zigzag":
        chunks = x.chunk(2 * world, dim=dim)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)
    return x.chunk(world, dim=dim)[rank]


def case(ring, variant, causal, heads, heads_k, rank, world):
    if variant == "llama3":
        q, k, v, dout = inputs(heads, heads_k, (SEQLEN,), seed=heads_k)
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        whole = grads(lambda q_, k_, v_: flash_attn_varlen_func(q_, k_, v_, cu, cu, max(LENGTHS), max(LENGTHS),
                                                               causal=causal), q, k, v, dout)
        cu_q, cu_k, max_q, max_k, k_slice = ring.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        local = grads(lambda q_, k_, v_: ring.llama3_flash_attn_varlen_func(
            q_, k_, v_, cu_q, cu_k, max_q, max_k, heads_k_stride=heads_k, local_k_slice=k_slice, causal=causal),
            *(shard(x, variant, rank, world, 0) for x in (q, k, v, dout)))
        dim = 0
    else:
        q, k, v, dout = inputs(heads, heads_k, (1, SEQLEN), seed=heads_k)
        whole = grads(lambda q_, k_, v_: flash_attn_func(q_, k_, v_, causal=causal), q, k, v, dout)
        fn = ring.zigzag_ring_flash_attn_func if variant == "zigzag" else ring.ring_flash_attn_func
        local = grads(lambda q_, k_, v_: fn(q_, k_, v_, causal=causal),
                      *(shard(x, variant, rank, world, 1) for x in (q, k, v, dout)))
        dim = 1
    errors = {}
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), local, whole):
        ref = shard(ref, variant, rank, world, dim).float()
        errors[name] = [(ours.float() - ref).abs().max().item(), ref.abs().max().item()]
    return dict(variant=variant, causal=causal, heads=heads, heads_k=heads_k, errors=errors)


def main(out_dir: str):
    ring = import_ring_flash_attn()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    results = [case(ring, variant, causal, heads, heads_k, rank, world)
               for variant in ("ring", "zigzag", "llama3")
               for causal in ((True,) if variant == "zigzag" else (False, True))  # zigzag is for causal attention
               for heads, heads_k in ((8, 8), (8, 2))]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(world=world, results=results), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
