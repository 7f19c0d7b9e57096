"""The GQA decode fold (flash-attn 2's seqlenq_ngroups_swapped), as layouts over the caller's
tensors: with one query row, the g = heads / heads_k query heads sharing a kv head become g
query rows of that kv head, so one CTA reads each K / V tile once for the whole group. Built in
a kernel's entry from the tensors' own strides: views made on the host with torch (three a
call) cost more host time than the launch (docs/tuning/decode-splits.md, "Host cost of a decode
call", and "Numbers moved out of docstrings").

A folded tile's rows are several query heads', so a per-head value (a learnable sink) is read
per row (`row_sinks`)."""
import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.constants import LOG2E


@cute.jit
def fold_heads(t: cute.Tensor, g):
    """(batch, 1, heads, d) as (batch, g, heads / g, d): head kh * g + j at (j, kh)."""
    return cute.make_tensor(t.iterator, cute.make_layout(
        (t.shape[0], g, t.shape[2] // g, t.shape[3]), stride=(t.stride[0], t.stride[2], t.stride[2] * g, 1)))


@cute.jit
def fold_lse(t: cute.Tensor, g):
    """The LSE (batch, heads, 1) as (batch, heads / g, g), the folded rows' order."""
    return cute.make_tensor(t.iterator, cute.make_layout(
        (t.shape[0], t.shape[1] // g, g), stride=(t.stride[0], t.stride[1] * g, t.stride[1])))


@cute.jit
def row_sinks(mSink: cute.Tensor, tOcO_mn: cute.Tensor, rows: cute.Layout, row0, kv_head, group, carries):
    """A KV-cache tile's learnable sink logit times log2 e for each of the thread's accumulator
    rows, in `rows` (the LSE's register layout; `OnlineSoftmax.finalize` takes it): tile row r
    (row0 + its (row, col) coordinate in tOcO_mn) of kv head kh is query head kh g + r % g for a
    tile folded by `group` g (the GQA fold's rows are its g heads, the query fold's repeat them;
    g 1 unfolded). -inf, no sink, where `carries` is false: of a split tile's partials only the
    first carries it, and the exact merge spreads it over the row."""
    sinks = cute.make_rmem_tensor(rows, cutlass.Float32)
    for r in cutlass.range_constexpr(cute.size(sinks)):
        head = kv_head * group + (row0 + tOcO_mn[r, 0][0]) % group
        sinks[r] = mSink[head] * LOG2E if carries else -cutlass.Float32.inf
    return sinks
