"""The packed-batch dQaccum tiling of kernels/dq_accum.py, on the CPU: sequence b's tiles start
at cu_seqlens_q[b] // block_m + b, so no tile holds rows of two sequences, and the launcher's
buffer of total_q // block_m + batch + 1 tiles holds them all."""
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=12), block_m=st.sampled_from([64, 128]))
def test_sequences_get_disjoint_tiles_inside_the_buffer(lengths, block_m):
    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    total = sum(lengths)
    taken = set()
    for b, (start, n) in enumerate(zip(starts, lengths)):
        first = start // block_m + b  # kernels/dq_accum.py: first_tile
        tiles = set(range(first, first + -(-n // block_m)))
        assert not tiles & taken, f"sequence {b} shares a tile"
        taken |= tiles
    assert all(t < total // block_m + len(lengths) + 1 for t in taken)
