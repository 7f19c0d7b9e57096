"""Philox4x32-7 on the GPU for attention dropout: the rounds and the element -> counter map of
`layouts/philox.py`, run on the DSL's 32-bit integers, and `Dropout`, which applies the mask
to a P tile in registers. Device code only."""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from layouts import philox


class DslOps:
    """philox4x32's integer operations on cutlass.Uint32 values: the high word of a product
    through a 64-bit multiply (mul.wide.u32), the rest wrapping 32-bit arithmetic."""

    @staticmethod
    def mulhilo(a, b):
        prod = cutlass.Uint64(a) * cutlass.Uint64(b)
        return cutlass.Uint32(prod >> 32), cutlass.Uint32(prod)

    @staticmethod
    def add(a, b):
        return a + b

    @staticmethod
    def xor(a, b):
        return a ^ b

    @staticmethod
    def const(x):
        return cutlass.Uint32(x)


@cute.jit
def counter_words(key_lo: cutlass.Uint32, key_hi: cutlass.Uint32, offset_lo: cutlass.Uint32, bh, c0, c1):
    """The four Philox words of counter (c0, c1, bh, offset_lo) under the key: the words of
    the 8 elements whose `philox.counter_of` is (c0, c1) in head row bh."""
    return philox.philox4x32((cutlass.Uint32(c0), cutlass.Uint32(c1), cutlass.Uint32(bh), offset_lo),
                             (key_lo, key_hi), DslOps)


@cute.jit
def dropout_words(key_lo: cutlass.Uint32, key_hi: cutlass.Uint32, offset_lo: cutlass.Uint32, bh, i, j):
    """The four Philox words of element (row i, column j) of head row bh (batch * heads + head):
    the words of all 8 elements that share its counter (`philox.counter_of`)."""
    c0, c1, _ = philox.counter_of(i, j)
    return counter_words(key_lo, key_hi, offset_lo, bh, c0, c1)


# philox.KEEP_MASK in both 16-bit halves: what the packed compares read of a word
BOTH_KEEP_MASKS = f"{philox.KEEP_MASK * 0x10001:#010x}"


@dsl_user_op
def keep_pair(word, threshold2, x_lo, x_hi, *, loc=None, ip=None):
    """sm_90: (x_lo, x_hi) with each zeroed where its half of `word` drops it: both halves'
    low 14 bits compared with the threshold pair (threshold * 0x10001) by one bf16x2 compare
    (HSETP2). A 14-bit pattern is a finite, non-negative bfloat16 (subnormals included), whose
    float order is its integer order (`philox.KEEP_BITS`). PTX's p takes the low halves'
    compare, q the high (tests/gpu/test_dropout_gpu.py checks the mask bit for bit on the GPU)."""
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [cutlass.Uint32(word).ir_value(loc=loc, ip=ip), cutlass.Uint32(threshold2).ir_value(loc=loc, ip=ip),
         cutlass.Float32(x_lo).ir_value(loc=loc, ip=ip), cutlass.Float32(x_hi).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .pred p, q; .reg .b32 v; and.b32 v, $2, {BOTH_KEEP_MASKS}; setp.lt.bf16x2 p|q, v, $3; "
        "selp.f32 $0, $4, 0f00000000, p; selp.f32 $1, $5, 0f00000000, q; }",
        "=f,=f,r,r,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
    return (cutlass.Float32(llvm.extractvalue(T.f32(), out, [0], loc=loc, ip=ip)),
            cutlass.Float32(llvm.extractvalue(T.f32(), out, [1], loc=loc, ip=ip)))


@dsl_user_op
def keep_halves(word, threshold2, *, loc=None, ip=None) -> cutlass.Uint32:
    """sm_90: 0xFFFF in each 16-bit half of `word` whose low 14 bits are below the threshold, 0
    in the others: one bf16x2 compare to a mask (HSET2), as `keep_pair`."""
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [cutlass.Uint32(word).ir_value(loc=loc, ip=ip), cutlass.Uint32(threshold2).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b32 v; and.b32 v, $1, {BOTH_KEEP_MASKS}; set.lt.u32.bf16x2 $0, v, $2; }}", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dataclass(frozen=True)
class Dropout:
    """One CTA's dropout: the Philox key and offset, the keep threshold (a word's low 14 bits
    below it keep its element; `threshold2`, the threshold in both halves) and the CTA's head row
    bh = batch * heads + head. packed (sm_90 kernels): a word's two decisions by one bf16x2
    compare (`keep_pair`) instead of an integer compare each."""
    key_lo: object
    key_hi: object
    offset_lo: object
    threshold: object
    threshold2: object
    bh: object
    packed: bool = False

    @staticmethod
    def load(mRng: cute.Tensor, bidb, bidh, heads, packed: bool = False) -> "Dropout":
        """mRng (4,) uint32: key_lo, key_hi, offset_lo, threshold (`cute_flash/dropout.py`);
        the CTA's head row bh = batch * heads + head, the counter's third word."""
        threshold = mRng[3]
        return Dropout(mRng[0], mRng[1], mRng[2], threshold, threshold * cutlass.Uint32(0x10001),
                       bidb * heads + bidh, packed)

    @cute.jit
    def scale(self) -> cutlass.Float32:
        """1 / P(keep) = 2^14 / threshold: what the kept values are multiplied by (applied to O
        once at the end), exact for the quantized keep probability."""
        return cutlass.Float32(philox.KEEP_RANGE) / cutlass.Float32(self.threshold)

    @cute.jit
    def keeps(self, word, half: cutlass.Constexpr):
        """Whether the low 14 bits of 16-bit half `half` (0: low) of a Philox word are below the
        threshold (at most 2^14, so the shifted one fits)."""
        if cutlass.const_expr(half == 1):
            return (word & cutlass.Uint32(philox.KEEP_MASK << 16)) < (self.threshold << 16)
        return (word & cutlass.Uint32(philox.KEEP_MASK)) < self.threshold

    @cute.jit
    def drops(self, word, half: cutlass.Constexpr):
        """not `keeps(word, half)`."""
        if cutlass.const_expr(half == 1):
            return (word & cutlass.Uint32(philox.KEEP_MASK << 16)) >= (self.threshold << 16)
        return (word & cutlass.Uint32(philox.KEEP_MASK)) >= self.threshold

    @cute.jit
    def atom_keeps(self, i, j):
        """The keep decisions of an mma.sync m16n8 accumulator atom whose value 0 is element
        (i, j) (i mod 16 < 8, j even): values v = 0..3 at (i + 8 (v // 2), j + v % 2) share one
        Philox call; the word pair they take depends on (j div 8) mod 2, which the backward's
        warp grid fixes per warp but not at compile time (layouts/verify_dropout.py,
        `atom_checks`). Returns 4 Booleans."""
        words = dropout_words(self.key_lo, self.key_hi, self.offset_lo, self.bh, i, j)
        odd = cutlass.Uint32(0) - cutlass.Uint32((j // 8) % 2)  # all ones when the right 8 columns
        keeps = []
        for v in cutlass.range_constexpr(4):
            lo, hi = words[2 * (v // 2)], words[2 * (v // 2) + 1]
            keeps.append(self.keeps(lo ^ ((lo ^ hi) & odd), v % 2))
        return keeps

    @cute.jit
    def apply(self, tiled_mma: cute.TiledMma, acc_s: cute.Tensor, groups, thread, row0, col0,
              tile_mn: cutlass.Constexpr, calls_first: cutlass.Constexpr):
        """Zero the dropped values of thread `thread`'s part of a P tile whose element (r, c) is
        (row0 + r, col0 + c) of the head; groups: its accumulator's value groups (`sm80_groups`
        for mma.sync, `wgmma_groups`), one Philox call each. A group's counter is the thread's
        first one plus compile-time steps: its first value sits a multiple of 16 rows and columns
        past the thread's first value, read off thread 0's static coordinates
        (layouts/verify_dropout.py proves this for every shipped tile), so each call's c0 / c1
        cost an add instead of `counter_of`'s divisions. calls_first: every call before the
        first select (the Hopper forward, faster than a call and its selects at a time: ptxas
        overlaps the independent calls; docs/tuning/dropout.md, Dropout, run 4), else group by
        group (the SM80 forward: on sm_90 calls first gained at d 128 and lost at d 64, and it was
        not measured on the GPUs that run that kernel; Dropout, after run 5)."""
        ident = cute.make_identity_tensor(tile_mn)
        tScS = tiled_mma.get_slice(thread).partition_C(ident)  # (MMA, MMA_M, MMA_N)
        tScS_0 = tiled_mma.get_slice(0).partition_C(ident)  # (MMA, MMA_M, MMA_N), static coordinates
        base = tScS[0]
        c0_base, c1_base, _ = philox.counter_of(row0 + base[0], col0 + base[1])
        words = []
        for g in cutlass.range_constexpr(len(groups)):
            step = tuple(int(a) - int(b) for a, b in zip(tScS_0[groups[g][0]], tScS_0[0]))
            assert step[0] % 16 == 0 and step[1] % 16 == 0, f"value group {groups[g][0]} at {step}"
            words.append(counter_words(self.key_lo, self.key_hi, self.offset_lo, self.bh,
                                       c0_base + 4 * (step[1] // 16), c1_base + 8 * (step[0] // 16)))
            if cutlass.const_expr(not calls_first):
                self.drop_group(acc_s, groups[g][1], words[g])
        if cutlass.const_expr(calls_first):
            for g in cutlass.range_constexpr(len(groups)):
                self.drop_group(acc_s, groups[g][1], words[g])

    @cute.jit
    def drop_group(self, acc_s: cute.Tensor, members, words):
        """Zero the members (value, 16-bit word) of one group that its call's words drop;
        packed: the two members of each 32-bit word at once (`keep_pair`)."""
        if cutlass.const_expr(self.packed):
            halves = word_halves(members)
            for q in cutlass.range_constexpr(4):
                lo, hi = halves[q]
                acc_s[lo], acc_s[hi] = keep_pair(words[q], self.threshold2, acc_s[lo], acc_s[hi])
        else:
            for e in cutlass.range_constexpr(len(members)):
                value, s = members[e]
                if self.drops(words[s // 2], s % 2):
                    acc_s[value] = cutlass.Float32(0.0)

    @cute.jit
    def pair_keep_bits(self, tiled_mma: cute.TiledMma, thread, row0, col0, tile_kq: cutlass.Constexpr):
        """The keep decisions of thread `thread`'s part of a wgmma S^T tile (keys, queries: the
        Hopper backward's) whose element (r, c) is (query row0 + c, key col0 + r) of the head,
        values ((c, r, k), 0, 0): a list of uint32, bit 16 c + 4 (k div 2 mod 4) + 2 (k mod 2) + r
        of entry k div 8 keeping value ((c, r, k), 0, 0) (`keep_bit`). No thread holds a whole
        Philox group here, but lanes t and t ^ 4 hold the two halves of each of their groups'
        words (layouts/verify_dropout.py:pair_exchange): each makes the calls of the groups at its
        own key parity c = jpar (one call per 8 values, as the forward), decides both halves of
        each word with one bf16x2 compare (`keep_halves`), gathering low halves' decisions in
        bits 0..15 and high halves' in 16..31, and trades them with its partner by one shuffle
        and one byte permute per 4 calls: about 3 instructions a word, where integer compares,
        selects and ors had taken about 6.5 (SASS, docs/tuning/dropout.md, Dropout, run 7)."""
        ident = cute.make_identity_tensor(tile_kq)
        tScS = tiled_mma.get_slice(thread).partition_C(ident)  # (MMA, MMA_M, MMA_N): (key, query)
        first = tScS[0]
        c0, c1, _ = philox.counter_of(row0 + first[1], col0 + first[0])
        jpar = cutlass.Uint32(first[0] % 2)  # col0 is even
        # this thread's values all take half jpar of their words: its own calls' (c = jpar) from
        # `mine`, the others' (c != jpar) from its partner's; each entry holds c = 0 in its low
        # 16 bits, c = 1 in its high: bytes (0, 1, 4, 5) of (mine, theirs) for jpar 0, (6, 7, 2, 3)
        select = cutlass.Uint32(0x5410) ^ ((cutlass.Uint32(0) - jpar) & cutlass.Uint32(0x5410 ^ 0x3276))
        calls = cute.size(tScS.shape[0][2]) // 2
        bits = []
        for reg in cutlass.range_constexpr((calls + 3) // 4):
            mine = cutlass.Uint32(0)
            for kd in cutlass.range_constexpr(4 * reg, min(4 * reg + 4, calls)):
                words = counter_words(self.key_lo, self.key_hi, self.offset_lo, self.bh, c0, c1 + 8 * kd + jpar)
                for kk in cutlass.range_constexpr(2):
                    for r in cutlass.range_constexpr(2):
                        both = cutlass.Uint32(0x00010001 << (4 * (kd % 4) + 2 * kk + r))
                        mine = mine | (keep_halves(words[2 * kk + r], self.threshold2) & both)
            theirs = cutlass.Uint32(cute.arch.shuffle_sync_bfly(mine, offset=4))
            bits.append(cutlass.Uint32(cute.arch.prmt(mine, theirs, select)))
        return bits


def word_halves(members) -> list:
    """A Philox group's members (value, 16-bit word s) as (low half's value, high half's value)
    of 32-bit words 0..3."""
    by_word = {s: value for value, s in members}
    return [(by_word[2 * q], by_word[2 * q + 1]) for q in range(4)]


def keep_bit(bits, c: int, r: int, k: int):
    """Whether `Dropout.pair_keep_bits` keeps value ((c, r, k), 0, 0) (compile-time c, r, k)."""
    return (bits[k // 8] >> (16 * c + 4 * ((k // 2) % 4) + 2 * (k % 2) + r)) & cutlass.Uint32(1) != cutlass.Uint32(0)


def sm80_groups(shape) -> list:
    """The Philox value groups of a ((2, 2), MMA_M, MMA_N) mma.sync accumulator: per group its
    first value and its members (value, 16-bit word): (0, m, 2t) .. (3, m, 2t + 1), value
    (v, m, 2t + n2) taking word 4 (v // 2) + 2 n2 + v % 2."""
    mm, nn = _extent(shape[1]), _extent(shape[2])
    return [((0, m, 2 * t), [((v, m, 2 * t + n2), 4 * (v // 2) + 2 * n2 + v % 2) for n2 in range(2)
                             for v in range(4)]) for m in range(mm) for t in range(nn // 2)]


def wgmma_groups(shape) -> list:
    """The same for a ((2, 2, N / 8), MMA_M, MMA_N) wgmma accumulator: ((0, 0, 2t), m, n) ..
    ((1, 1, 2t + 1), m, n), value ((c, r, 2t + k), m, n) taking word 4 r + 2 k + c."""
    kk, mm, nn = _extent(shape[0][2]), _extent(shape[1]), _extent(shape[2])
    return [(((0, 0, 2 * t), m, n), [(((c, r, 2 * t + k), m, n), 4 * r + 2 * k + c) for k in range(2)
                                     for r in range(2) for c in range(2)])
            for n in range(nn) for m in range(mm) for t in range(kk // 2)]


def _extent(mode) -> int:
    return int(cute.size(mode))
