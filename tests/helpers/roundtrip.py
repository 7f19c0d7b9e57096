"""A data-movement-only kernel: gmem -> swizzled smem (cp.async) -> registers (ldmatrix) -> gmem.

It runs the forward kernel's recipes from `layouts/` on their own. The registers are written
back through the TiledMMA's partition of the output tile, so `out == in` bit for bit holds only
if the swizzled smem layout, the cp.async partition, the ldmatrix partition and the MMA fragment
all agree on where every element lives. Operand "A" is Q's path, "B" K's path, "Bt" V's path
through the transposed ldmatrix.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from layouts import copy as lcopy
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.traits import FwdTraits, element_type

OPERANDS = ("A", "B", "Bt")


class TileRoundTrip:
    def __init__(self, traits: FwdTraits, operand: str):
        if operand not in OPERANDS:
            raise ValueError(f"operand must be one of {OPERANDS}, got {operand!r}")
        self.t = traits
        self.operand = operand
        self.rows = traits.block_m if operand == "A" else traits.block_n

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        t = self.t
        s_layout = lsmem.smem_layout_q(t) if cutlass.const_expr(self.operand == "A") else lsmem.smem_layout_kv(t)

        @cute.struct
        class SharedStorage:
            sX: cute.struct.Align[cute.struct.MemRange[element_type(t), cute.cosize(s_layout)], 1024]

        self.kernel(mX, mY, s_layout, lcopy.gmem_tiled_copy_qkv(t), lmma.tiled_mma(t), SharedStorage).launch(
            grid=(cute.ceil_div(mX.shape[0], self.rows), 1, 1),
            block=[t.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, s_layout: cute.ComposedLayout,
               gmem_tiled_copy: cute.TiledCopy, tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        t = self.t
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        gX = cute.local_tile(mX, (self.rows, t.head_dim), (bid, 0))  # (rows, d)
        gY = cute.local_tile(mY, (self.rows, t.head_dim), (bid, 0))
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sX = storage.sX.get_tensor(s_layout)

        thr_copy = gmem_tiled_copy.get_slice(tidx)
        cute.copy(gmem_tiled_copy, thr_copy.partition_S(gX), thr_copy.partition_D(sX))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        thr_mma = tiled_mma.get_slice(tidx)
        if cutlass.const_expr(self.operand == "A"):
            smem_copy = lcopy.smem_tiled_copy_q(t, tiled_mma)
            src, dst = sX, gY
            frag = thr_mma.make_fragment_A(thr_mma.partition_A(src))
            out = thr_mma.partition_A(dst)
        else:
            smem_copy = lcopy.smem_tiled_copy_k(t, tiled_mma)
            src, dst = sX, gY
            if cutlass.const_expr(self.operand == "Bt"):
                smem_copy = lcopy.smem_tiled_copy_vt(t, tiled_mma)
                src, dst = lsmem.transposed_view(sX), lsmem.transposed_view(gY)
            frag = thr_mma.make_fragment_B(thr_mma.partition_B(src))
            out = thr_mma.partition_B(dst)
        smem_thr_copy = smem_copy.get_slice(tidx)
        cute.copy(smem_copy, smem_thr_copy.partition_S(src), smem_thr_copy.retile(frag))
        cute.autovec_copy(frag, out)


def roundtrip(x, traits: FwdTraits, operand: str):
    """Run the round trip on a CUDA tensor x (rows, traits.head_dim), rows a multiple of the
    operand's tile rows, passed to the kernel through DLPack. Returns the copy."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    y = torch.full_like(x, float("nan"))
    args = (from_dlpack(x, assumed_align=16), from_dlpack(y, assumed_align=16),
            cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    kernel = cute.compile(TileRoundTrip(traits, operand), *args)
    kernel(*args)
    return y
