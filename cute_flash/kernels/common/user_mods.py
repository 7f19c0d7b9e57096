"""Attention variants written in Python: a `score_mod` that rewrites each scaled score and a
`mask_mod` that hides scores, with flash-attn-4's callable conventions, compiled into the kernel
as part of its variant.

    score_mod(score, b_idx, h_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=) -> score
    mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> keep (Boolean)
    score_mod_bwd(grad, score, b_idx, h_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)
        -> grad times d score_mod / d score (the backward: the gradient of the mod's input)

Every argument but the last two is a TensorSSA of one element: the score (Float32, already
times the softmax scale; the softmax then takes the result as it is), the sequence index, the
query head, and the query and key positions counted from the sequence's first row.
`seqlen_info` has `seqlen_q`, `seqlen_k`, `offset_q`, `offset_k` (where the sequence starts in
a packed batch, 0 otherwise); `aux_tensors` is the caller's list of tensors, as cute tensors.
A mod is traced with the kernel: plain Python around DSL operations (`cute.where`, `operator`
comparisons, `cute.math`), which the DSL compiles.

A variant's compile key holds each mod's `UserMod`: its name and a digest of its code (and what
its code reads: constants, closures, the globals it names), so the persistent compile cache
finds the kernel again in another process, and a changed mod compiles anew.
"""
from __future__ import annotations

import hashlib
import inspect
import types
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.fake import fake_tensor

_SIMPLE = (int, float, bool, str, bytes, type(None))


def _feed(digest, obj, seen: set):
    """Mix `obj` into `digest`: functions by their source (their code where it has none),
    defaults, closures and the globals their code names; code objects by bytecode and constants;
    plain values by repr."""
    if id(obj) in seen:
        return
    if isinstance(obj, (types.FunctionType, types.CodeType)) or hasattr(obj, "__wrapped__"):
        seen.add(id(obj))
    base = inspect.unwrap(obj) if callable(obj) and not isinstance(obj, type) else obj
    if isinstance(base, types.FunctionType):
        digest.update(base.__qualname__.encode())
        try:  # the source: the DSL swaps a jit function's __code__ for its rewritten one on first use
            digest.update(inspect.getsource(base).encode())
        except (OSError, TypeError):
            _feed(digest, base.__code__, seen)
        for value in base.__defaults__ or ():
            _feed(digest, value, seen)
        for cell in base.__closure__ or ():
            _feed(digest, cell.cell_contents, seen)
        for name in base.__code__.co_names:
            if name in base.__globals__:
                value = base.__globals__[name]
                if isinstance(value, (types.FunctionType, *_SIMPLE)) or hasattr(value, "__wrapped__"):
                    digest.update(name.encode())
                    _feed(digest, value, seen)
    elif isinstance(base, types.CodeType):
        digest.update(base.co_code)
        digest.update(repr(base.co_names).encode())
        for const in base.co_consts:
            _feed(digest, const, seen)
    elif isinstance(base, (tuple, list)):
        for item in base:
            _feed(digest, item, seen)
    elif isinstance(base, _SIMPLE):
        digest.update(repr(base).encode())
    else:
        digest.update(type(base).__qualname__.encode())


def code_digest(fn) -> str:
    """A stable digest of `fn`: the same in every process for the same code and captured values.
    Kept on the function from its first computation: once the DSL has traced a jit function, its
    code (and the globals that code names) is the DSL's rewrite."""
    base = inspect.unwrap(fn)
    known = getattr(base, "__cute_flash_digest__", None)
    if known is None:
        digest = hashlib.sha256()
        _feed(digest, fn, set())
        known = digest.hexdigest()[:16]
        try:
            base.__cute_flash_digest__ = known
        except AttributeError:  # a callable that takes no attributes: computed each time
            pass
    return known


@dataclass(frozen=True)
class UserMod:
    """One Python-written modifier in a compile key: compared and printed by name and digest."""
    name: str
    digest: str
    fn: object = field(compare=False, repr=False)

    @staticmethod
    def of(fn) -> "UserMod | None":
        if fn is None:
            return None
        return UserMod(getattr(inspect.unwrap(fn), "__qualname__", type(fn).__name__), code_digest(fn), fn)


@dataclass(frozen=True)
class UserMods:
    """A variant's Python-written modifiers and the aux tensors they read ((dtype name, rank) each:
    what their placeholders need)."""
    score_mod: UserMod | None = None
    mask_mod: UserMod | None = None
    aux: tuple = ()
    score_mod_bwd: UserMod | None = None  # backward kernels only

    def fake_aux(self):
        """Placeholders for the aux tensors (a list, or None without any)."""
        if not self.aux:
            return None
        return [fake_tensor(AUX_DTYPES[dtype], rank) for dtype, rank in self.aux]


AUX_DTYPES = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16,
              "int32": cutlass.Int32}


def check_mods(mods: "UserMods | None", kvcache: bool, has_softcap: bool, has_alibi: bool, backward: bool = False):
    """Refuse a config the mods do not compose with: KV caches (not wired), softcap or ALiBi
    beside a score_mod (each rescales the score the mod would see; write them as mods), and in a
    backward a score_mod without its score_mod_bwd (in a forward, a score_mod_bwd)."""
    if mods is None:
        return
    if backward and (mods.score_mod is None) != (mods.score_mod_bwd is None):
        raise ValueError("a backward with a score_mod takes its score_mod_bwd, and only then")
    if not backward and mods.score_mod_bwd is not None:
        raise ValueError("score_mod_bwd belongs to the backward's variant")
    if kvcache:
        raise ValueError("score_mod / mask_mod are not available on the KV-cache entry")
    if mods.score_mod is not None and (has_softcap or has_alibi):
        raise ValueError("softcap and ALiBi do not compose with a score_mod (write them into the mod)")


@dataclass(frozen=True)
class ModSeqInfo:
    """`seqlen_info` as a mod sees it (flash-attn-4's names)."""
    seqlen_q: object
    seqlen_k: object
    offset_q: object
    offset_k: object


SIGNATURES = {
    "score_mod": "score_mod(score, b_idx, h_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=) -> a one-element "
                 "Float32 TensorSSA",
    "mask_mod": "mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors) -> a one-element Boolean TensorSSA",
    "score_mod_bwd": "score_mod_bwd(grad, score, b_idx, h_idx, q_idx=, kv_idx=, seqlen_info=, aux_tensors=) -> a "
                     "one-element Float32 TensorSSA",
}


class ModError(TypeError):
    """A Python-written mod that does not trace, or returns what the kernel cannot take."""


def call_mod(mod: UserMod, kind: str, *args, **kwargs):
    """mod.fn(*args, **kwargs) while the kernel is traced (plain Python, run at trace time, so
    before any launch): an exception from the mod comes back naming the mod, the signature it
    must have and the DSL's message; a result other than a one-element TensorSSA of the kind's
    type is refused."""
    try:
        out = mod.fn(*args, **kwargs)
    except Exception as exc:
        raise ModError(f"{kind} {mod.name!r} failed to trace ({type(exc).__name__}: {exc}); a {kind} must be "
                       f"{SIGNATURES[kind]}") from exc
    want = cutlass.Boolean if kind == "mask_mod" else cutlass.Float32
    if not isinstance(out, cute.TensorSSA) or cute.size(out.shape) != 1 or out.dtype != want:
        got = f"a TensorSSA of {out.dtype.__name__} (shape {out.shape})" if isinstance(out, cute.TensorSSA) \
            else f"a {type(out).__name__}"
        raise ModError(f"{kind} {mod.name!r} returned {got}; a {kind} must be {SIGNATURES[kind]}")
    return out


def _ssa(value, dtype):
    """A TensorSSA of one element."""
    vec = cute.make_rmem_tensor(1, dtype)
    vec[0] = value
    return vec.load()


@dataclass(frozen=True)
class ModCall:
    """The modifiers of one CTA: the compiled mods, its sequence and head, the aux tensors, and
    the score's scale (what turns Q K^T into the score a score_mod sees)."""
    mods: UserMods
    bidb: object
    bidh: object
    seqlen_info: ModSeqInfo
    aux_tensors: object
    scale: object

    @staticmethod
    def make(mods: UserMods, bidb, bidh, seq, aux_tensors, scale) -> "ModCall":
        """The modifiers of sequence bidb (a `SeqInfo`), head bidh; scale: the softmax scale
        (the launcher hands it over as the score premultiplier when there is a score_mod)."""
        offset_q = 0 if cutlass.const_expr(seq.sum_s_q is None) else seq.sum_s_q
        offset_k = 0 if cutlass.const_expr(seq.sum_s_k is None) else seq.sum_s_k
        return ModCall(mods, bidb, bidh, ModSeqInfo(seq.seqlen_q, seq.seqlen_k, offset_q, offset_k), aux_tensors,
                       scale)

    def positions(self, tile_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0):
        """(r, c, q_idx, kv_idx) of each element of a (rows, cols) register tile at (row0, col0)
        (tScS_mn: each one's (row, col) in the tile), the indices as one-element SSAs. Rows and
        columns past the sequence (masked, or never stored) come as its last query / key, so a
        mod's reads of aux tensors stay where real positions lead. Plain Python: the loops unroll
        while the kernel is traced."""
        last_q, last_k = self.seqlen_info.seqlen_q - 1, self.seqlen_info.seqlen_k - 1
        for r in range(cute.size(tile_mn.shape[0])):  # static extents (range_constexpr is for jit functions)
            q = _ssa(cutlass.min(row0 + tScS_mn[r, 0][0], last_q), cutlass.Int32)
            for c in range(cute.size(tile_mn.shape[1])):
                yield r, c, q, _ssa(cutlass.min(col0 + tScS_mn[0, c][1], last_k), cutlass.Int32)

    def common_args(self):
        """The batch and head SSAs and the aux tensors, every mod's arguments beside the positions."""
        aux = self.aux_tensors if self.aux_tensors is not None else []
        return _ssa(self.bidb, cutlass.Int32), _ssa(self.bidh, cutlass.Int32), aux

    @cute.jit
    def apply(self, acc_s_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0, with_mask: cutlass.Constexpr = True):
        """Rewrite each score of the (rows, cols) tile (score_mod: from scale * S) and hide those
        mask_mod drops (-inf), at the `positions` tScS_mn gives; with_mask False: the mask_mod
        keeps the whole tile (a block-sparse full block) and is not called."""
        b, h, aux = self.common_args()
        for r, c, q, k in self.positions(acc_s_mn, tScS_mn, row0, col0):
            if cutlass.const_expr(self.mods.score_mod is not None):
                score = _ssa(acc_s_mn[r, c] * self.scale, cutlass.Float32)
                acc_s_mn[r, c] = call_mod(self.mods.score_mod, "score_mod", score, b, h, q_idx=q, kv_idx=k,
                                          seqlen_info=self.seqlen_info, aux_tensors=aux)[0]
            if cutlass.const_expr(self.mods.mask_mod is not None and with_mask):
                keep = call_mod(self.mods.mask_mod, "mask_mod", b, h, q, k, self.seqlen_info, aux)
                if not keep[0]:
                    acc_s_mn[r, c] = -cutlass.Float32.inf

    @cute.jit
    def backward(self, acc_ds_mn: cute.Tensor, pre_mn: cute.Tensor, tScS_mn: cute.Tensor, row0, col0):
        """The backward's dS: each gradient of a score_mod's output (acc_ds_mn, in place) through
        score_mod_bwd to its input, given that input (pre_mn: scale * S, kept before `apply`)."""
        b, h, aux = self.common_args()
        for r, c, q, k in self.positions(acc_ds_mn, tScS_mn, row0, col0):
            grad = _ssa(acc_ds_mn[r, c], cutlass.Float32)
            score = _ssa(pre_mn[r, c], cutlass.Float32)
            acc_ds_mn[r, c] = call_mod(self.mods.score_mod_bwd, "score_mod_bwd", grad, score, b, h, q_idx=q,
                                       kv_idx=k, seqlen_info=self.seqlen_info, aux_tensors=aux)[0]
