"""Helpers both Hopper kernels share around their TMA loads and mbarrier pipelines."""
import cutlass.cute as cute
from cutlass import pipeline


def use_state(n, stages: int, producer: bool) -> pipeline.PipelineState:
    """The pipeline state of the n-th stage use (n from 0): stage n % stages, its phase bit
    flipping each round (a producer's starts flipped). Computed from n rather than carried
    through the loop by `advance()`: a state object rebound in a helper is not a loop variable
    the DSL can carry. n >= 0, so a power-of-two depth takes a mask and a shift: the signed %
    and // had cost 8 instructions per warp and key block (d 128: 499 -> 491, SASS)."""
    if stages & (stages - 1) == 0:
        index, phase = n & (stages - 1), (n >> (stages.bit_length() - 1)) & 1
    else:
        index, phase = n % stages, (n // stages) % 2
    return pipeline.PipelineState(stages, n, index, phase ^ (1 if producer else 0))


def seq_first(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, d) as (seqlen, d, heads, batch), packed (total, heads, d) as
    (total, d, heads): a TMA box is a (rows, d) tile and the trailing modes are coordinates."""
    modes = [1, 3, 2, 0] if cute.rank(t) == 4 else [0, 2, 1]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def tma_rows(tma_mX: cute.Tensor, start, bidh, bidb) -> cute.Tensor:
    """(rows, d) TMA coordinates of one head of one sequence: dense (rows, d, heads, batch)
    indexed, packed (total, d, heads) shifted to the sequence's first row `start`."""
    if start is None:
        return tma_mX[None, None, bidh, bidb]
    return cute.domain_offset((start, 0), tma_mX[None, None, bidh])
