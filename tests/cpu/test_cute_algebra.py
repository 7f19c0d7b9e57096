"""The CuTe DSL's layout algebra checked on random layouts against plain numpy index arithmetic.

layouts.verify and every recipe rely on these laws (evaluation order, composition, complement,
logical_divide); a DSL release that changed one would silently move every smem address.
Layout functions only run inside a trace, so each case is one @cute.jit call with Constexpr
arguments (~3 ms warm) that returns plain ints.
"""
import math

import cutlass.cute as cute
import numpy as np
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from layouts.verify import in_trace

# no shrinking: a failing DSL trace costs ~1 s, and shrinking one can take minutes
LAWS = settings(max_examples=80, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
MAX_SIZE = 64


def _leaves(t):
    return [x for e in t for x in _leaves(e)] if isinstance(t, tuple) else [t]


def _size(shape) -> int:
    return math.prod(_leaves(shape))


def np_eval(shape, stride, idx):
    """Reference: colexicographic coordinates of the flattened shape, dotted with the strides."""
    idx = np.asarray(idx)
    out = np.zeros_like(idx)
    for extent, s in zip(_leaves(shape), _leaves(stride)):
        out += (idx % extent) * s
        idx = idx // extent
    return out


def _like(shape, leaf):
    """A strategy for a stride tuple nested like `shape`."""
    return st.tuples(*(_like(m, leaf) for m in shape)) if isinstance(shape, tuple) else leaf


def layouts(extents, strides):
    """(shape, stride) of rank 1-3; a mode is an extent or a pair of extents (one nesting level)."""
    mode = st.one_of(extents, st.tuples(extents, extents))
    shapes = st.lists(mode, min_size=1, max_size=3).map(tuple).filter(lambda s: _size(s) <= MAX_SIZE)
    return shapes.flatmap(lambda s: st.tuples(st.just(s), _like(s, strides)))


any_layouts = layouts(st.integers(1, 5), st.integers(0, 12))
# powers of two keep every shape/stride division of composition and logical_divide exact
pow2_layouts = layouts(st.sampled_from([1, 2, 4]), st.integers(0, 9))


@st.composite
def injective_layouts(draw):
    """Flat shape, strides increasing in a random mode order with optional gaps; returns also the
    span (largest stride * extent), which the cotarget of complement must be a multiple of."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    stride, span = [0] * len(shape), 1
    for k in draw(st.permutations(range(len(shape)))):
        span *= draw(st.sampled_from([1, 2]))
        stride[k] = span
        span *= shape[k]
    return tuple(shape), tuple(stride), span


@st.composite
def bit_field_layouts(draw):
    """Power-of-two layouts whose modes either broadcast (stride 0) or own disjoint bit fields of
    the index (a random order, optional gaps): A(B(i)) then needs no carry between A's modes,
    which is what composition's mode-by-mode construction assumes."""
    shape = draw(layouts(st.sampled_from([1, 2, 4]), st.just(0)))[0]
    leaves = _leaves(shape)
    strides, bit = [0] * len(leaves), 0
    for k in draw(st.permutations(range(len(leaves)))):
        if draw(st.integers(0, 4)) == 0:
            continue  # broadcast mode
        bit += draw(st.integers(0, 1))
        strides[k] = 1 << bit
        bit += leaves[k].bit_length() - 1
    return shape, _nest(shape, iter(strides))


def _nest(shape, flat):
    """`flat` values nested like `shape`."""
    return tuple(_nest(m, flat) for m in shape) if isinstance(shape, tuple) else next(flat)


def _values(layout):
    return [int(layout(i)) for i in range(cute.size(layout))]


def _evaluate(shape, stride):
    layout = cute.make_layout(shape, stride=stride)
    sizes = [cute.size(m) for m in shape]
    natural = [tuple((i // math.prod(sizes[:k])) % sizes[k] for k in range(len(sizes)))
               for i in range(cute.size(layout))]
    return _values(layout), [int(layout(c)) for c in natural], [int(cute.crd2idx(c, layout)) for c in natural]


def _compose(a, b):
    return _values(cute.composition(cute.make_layout(a[0], stride=a[1]), cute.make_layout(b[0], stride=b[1])))


def _complement(shape, stride, cotarget):
    return _values(cute.complement(cute.make_layout(shape, stride=stride), cotarget))


def _divide(shape, stride, tiler):
    if isinstance(tiler, list):  # a strided tile s:d, given as [s, d]
        tiler = cute.make_layout(tiler[0], stride=tiler[1])
    divided = cute.logical_divide(cute.make_layout(shape, stride=stride), tiler)
    return _values(divided), divided.shape


@given(any_layouts)
@LAWS
def test_layout_is_colexicographic_dot_product(layout):
    shape, stride = layout
    flat, natural, crd2idx = in_trace(_evaluate, shape, stride)
    want = np_eval(shape, stride, np.arange(_size(shape))).tolist()
    assert flat == want
    assert natural == want  # (c0, c1, c2) with c_k the colexicographic digits over the top modes
    assert crd2idx == want


@given(pow2_layouts, bit_field_layouts(), st.integers(0, 9))
@LAWS
def test_composition_is_function_composition(a, b, extra_stride):
    """composition(A, B)(i) == A(B(i)) for every i in B's domain; A gets one more mode, if need
    be, so that B's image lies in A's domain."""
    image_b = np_eval(*b, np.arange(_size(b[0])))
    grow = -(-(int(image_b.max()) + 1) // _size(a[0]))
    if grow > 1:
        a = (a[0] + (1 << (grow - 1).bit_length(),), a[1] + (extra_stride,))
    got = in_trace(_compose, a, b)
    assert got == np_eval(*a, image_b).tolist()


@given(injective_layouts(), st.integers(1, 3))
@LAWS
def test_complement_fills_the_codomain(layout, multiple):
    """R = complement(A, M), M a multiple of A's span: R is injective, its image meets A's only
    at 0, and A(i) + R(j) hits every offset of [0, M) exactly once."""
    shape, stride, span = layout
    cotarget = span * multiple
    r = np.array(in_trace(_complement, shape, stride, cotarget))
    image_a = np_eval(shape, stride, np.arange(_size(shape)))
    assert len(set(r.tolist())) == r.size
    assert set(r.tolist()) & set(image_a.tolist()) == {0}
    assert np.array_equal(np.sort((image_a[:, None] + r[None, :]).ravel()), np.arange(cotarget))


@given(pow2_layouts, st.data())
@LAWS
def test_logical_divide_keeps_the_function(layout, data):
    """logical_divide(A, tiler) reorganises A as (tile, rest): with a whole-layout tile t, or a
    tile t_k per mode, index i still maps to A(i); with a strided tile s:d, index
    t + s*(r0 + d*r1) maps to A(t*d + r0 + s*d*r1) (rest = complement (d, N/(s*d)):(1, s*d))."""
    shape, stride = layout
    n = _size(shape)
    powers = [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]
    kind = data.draw(st.sampled_from(["whole", "by-mode", "strided"]))
    if kind == "whole":
        tile = data.draw(st.sampled_from(powers))
        values, divided = in_trace(_divide, shape, stride, tile)
        assert [_size(m) for m in divided] == [tile, n // tile]
        perm = np.arange(n)
    elif kind == "by-mode":
        sizes = [_size(m) for m in shape]
        tiles = tuple(data.draw(st.sampled_from([1 << k for k in range(s.bit_length()) if s % (1 << k) == 0]))
                      for s in sizes)
        values, divided = in_trace(_divide, shape, stride, tiles)
        assert [[_size(m[0]), _size(m[1])] for m in divided] == [[t, s // t] for t, s in zip(tiles, sizes)]
        perm = np.arange(n)
    else:
        s = data.draw(st.sampled_from(powers))
        d = data.draw(st.sampled_from([p for p in powers if n % (s * p) == 0]))
        values, divided = in_trace(_divide, shape, stride, [s, d])
        i = np.arange(n)
        t, r0, r1 = i % s, (i // s) % d, i // (s * d)
        perm = t * d + r0 + s * d * r1
        assert [_size(m) for m in divided] == [s, n // s]
    assert values == np_eval(shape, stride, perm).tolist()
