"""dQaccum's order inside a query tile's chunk of fp32 values: where value i of thread tidx
of the dQ GEMM goes (`chunk_index`: a contiguous run per group of threads, a warp, or a
warpgroup in the Hopper backward; `vec` consecutive floats an add), and the same as one layout
a thread stores through (`run_layout`). The kernels (kernels/common/dq_accum.py) add and read back in
this order; layouts/verify_hopper.py checks it against the Hopper dQ partition."""
import cutlass
import cutlass.cute as cute

HOPPER_VEC = 4  # the Hopper backward's runs: a warpgroup's, in 16-byte vectors


def chunk_index(i, tidx, per_thread: cutlass.Constexpr, vec: cutlass.Constexpr, group: cutlass.Constexpr = 32):
    """Where value i (of `per_thread`) of thread tidx lives in a chunk (plain ints work too):
    a run per `group` threads (a warp; a warpgroup in the Hopper backward)."""
    return ((tidx // group) * per_thread + (i // vec) * vec) * group + (tidx % group) * vec + i % vec


def run_layout(per_thread: int, vec: int, group: int):
    """(vec, per_thread // vec) -> where a thread's values sit from its first one: `vec`
    contiguous, then the next vector a whole group of threads' vectors further (chunk_index's
    order, as one layout a thread stores through)."""
    return cute.make_layout((vec, per_thread // vec), stride=(1, group * vec))
