"""The named barriers of the Hopper kernels (barrier 0 is the CTA's `bar.sync 0`). A member that
names a range is a base: warpgroup w of the consumers takes base + w."""
from enum import IntEnum


class FwdBarrier(IntEnum):
    SCHEDULER = 1  # 1..3: consumer warpgroup 0's..2's turn to issue GEMMs
    EPILOGUE = 4   # 4..6: consumer warpgroup 0's..2's O tile written to smem (latent tiles: 4, both done with sQ first)
    CLEAR_V = 7    # packed batches: every consumer warpgroup's V rows past seqlen_k zeroed
    SPLIT = 8      # split-KV: the consumer threads' arrival count and merge (SplitKV.sync)
    VOTE = 9       # 9..11: consumer warpgroup 0's..2's vote on speculative P in place


class BwdBarrier(IntEnum):
    DS = 1         # both consumer warpgroups' dS^T is in shared memory
    DQ = 2         # 2, 3: consumer warpgroup 0's / 1's dQ staging run
    KV_DONE = 4    # both consumer warpgroups are done reading sK / sV
    STORE = 5      # 5, 6: consumer warpgroup 0's / 1's dK / dV rows are in shared memory
    CLEAR = 7      # packed batches: both consumer warpgroups' zeroing of the next sequence's rows
    DQ_FULL = 8    # 8, 9: writer warps: consumer warpgroup 0's / 1's dQ run staged for its writer warp
    DQ_EMPTY = 10  # 10, 11: writer warps: the writer warp's bulk add has read the run (`write_dq`)
    DS_FREE = 12   # one dS stage (the 96-key tiles): both consumer warpgroups' dQ wgmmas have read the last one
    P_READY = 13   # 13, 14: the 96-key tiles: consumer warpgroup 0's / 1's P (its 48 keys) is in shared memory
