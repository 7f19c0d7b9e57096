"""dQaccum's layout (kernels/common/dq_accum.py), on the CPU: the packed-batch tiling (sequence b's
tiles start at cu_seqlens_q[b] // block_m + b, so no tile holds rows of two sequences, and the
launcher's buffer of total_q // block_m + batch + 1 tiles holds them all) and the warp order
of the values inside a chunk."""
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=12), block_m=st.sampled_from([64, 128]))
def test_sequences_get_disjoint_tiles_inside_the_buffer(lengths, block_m):
    """The kernels' first_tile (plain ints work) and the launcher's buffer size, as they run."""
    from cute_flash.kernels.common.dq_accum import first_tile
    from cute_flash.kernels.common.seq_info import SeqInfo
    from cute_flash.launch.backward import varlen_dq_tiles

    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    buffer = varlen_dq_tiles(sum(lengths), len(lengths), block_m)
    taken = set()
    for b, (start, n) in enumerate(zip(starts, lengths)):
        first = first_tile(SeqInfo(n, 1, start, None, 0), b, block_m)
        tiles = set(range(first, first + -(-n // block_m)))  # the tiles sequence b's rows fill
        assert not tiles & taken, f"sequence {b} shares a tile"
        taken |= tiles
    assert all(0 <= t < buffer for t in taken)
    assert first_tile(SeqInfo(5, 1, None, None, 0), 3, block_m) == 0  # dense: a tile mode per sequence


@settings(max_examples=200, deadline=None)
@given(warps=st.sampled_from([4, 8]), per_thread=st.sampled_from([4, 8, 16, 32, 64]), vec=st.sampled_from([1, 4]))
def test_chunk_index_is_a_bijection_with_coalesced_adds_and_contiguous_warp_runs(warps, per_thread, vec):
    """kernels/common/dq_accum.py's warp order: every (thread, value) gets its own float of the chunk;
    the j-th add of a warp covers 32 * vec consecutive floats (whole lines), and a warp's values
    fill one contiguous run (what one bulk reduce per warp needs)."""
    from layouts.dq import chunk_index

    size = warps * 32 * per_thread
    seen = {}
    for tidx in range(warps * 32):
        for i in range(per_thread):
            at = chunk_index(i, tidx, per_thread, vec)
            assert 0 <= at < size and at not in seen
            seen[at] = (tidx, i)
    for w in range(warps):
        run = {chunk_index(i, w * 32 + lane, per_thread, vec) for lane in range(32) for i in range(per_thread)}
        assert run == set(range(w * 32 * per_thread, (w + 1) * 32 * per_thread))
        for j in range(per_thread // vec):
            add = sorted(chunk_index(j * vec + u, w * 32 + lane, per_thread, vec)
                         for lane in range(32) for u in range(vec))
            assert add == list(range(add[0], add[0] + 32 * vec)) and add[0] % (32 * vec) == 0
