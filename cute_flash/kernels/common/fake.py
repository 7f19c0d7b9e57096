"""Compiling without real tensors or a GPU: the placeholder tensors and stream each kernel's
`fake_args` builds."""
import cutlass.cute as cute


def fake_tensor(dtype, rank: int, stride_divisibility: int = 1, assumed_align: int = 4, last_extent=None):
    """A rank-`rank` tensor with dynamic extents (the last one static when `last_extent` is
    given), a unit last stride, and other strides the compiler may take as multiples of
    `stride_divisibility` elements."""
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (last_extent or cute.sym_int(),)
    stride = tuple(cute.sym_int64(divisibility=stride_divisibility) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, assumed_align=assumed_align)


def fake_stream():
    """The caller's stream at call time: torch's current stream."""
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)
