"""The GQA decode fold (flash-attn 2's seqlenq_ngroups_swapped), as layouts over the caller's
tensors: with one query row, the g = heads / heads_k query heads sharing a kv head become g
query rows of that kv head, so one CTA reads each K / V tile once for the whole group. Built in
a kernel's entry from the tensors' own strides: views made on the host with torch (three a
call) cost more host time than the launch (docs/tuning/decode-splits.md, "Host cost of a decode
call", and "Numbers moved out of docstrings")."""
import cutlass.cute as cute


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
