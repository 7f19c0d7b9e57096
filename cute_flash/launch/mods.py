"""A call's Python-written score / mask mods on their way to the kernels: their compile-key
part (`UserMods`, kernels/common/user_mods.py) and the aux tensors they read."""
from __future__ import annotations

from dataclasses import dataclass

from cute_flash.kernels.common.user_mods import AUX_DTYPES, UserMod, UserMods
from cute_flash.launch.batch_chunks import chunked


@dataclass(frozen=True)
class ModArgs:
    mods: UserMods      # the forward's
    aux_tensors: tuple  # CUDA tensors, in the order the mods index them
    score_mod_bwd: UserMod | None = None

    @property
    def bwd_mods(self) -> UserMods:
        """The backward's: the forward's mods (to recompute P) and the score_mod's backward."""
        return UserMods(self.mods.score_mod, self.mods.mask_mod, self.mods.aux, self.score_mod_bwd)

    @staticmethod
    def of(mods) -> "ModArgs | None":
        """A launcher's `mods` argument: None, a ModArgs, or the API's (score_mod, mask_mod,
        aux_tensors[, score_mod_bwd])."""
        return mods if mods is None or isinstance(mods, ModArgs) else ModArgs.make(*mods)

    @staticmethod
    def make(score_mod, mask_mod, aux_tensors, score_mod_bwd=None) -> "ModArgs | None":
        if score_mod is None and mask_mod is None:
            return None
        aux = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in aux_tensors or ())  # as the kernels read them
        kinds = tuple((str(t.dtype).removeprefix("torch."), t.dim()) for t in aux)
        for name, _ in kinds:
            if name not in AUX_DTYPES:
                raise ValueError(f"aux_tensors: dtype {name} is not one of {sorted(AUX_DTYPES)}")
        return ModArgs(UserMods(UserMod.of(score_mod), UserMod.of(mask_mod), kinds), aux, UserMod.of(score_mod_bwd))


def mod_flags(mods: ModArgs | None, backward: bool = False) -> tuple:
    """The kernel configs' `mods` field as (name, value) pairs: empty without mods."""
    if mods is None:
        return ()
    return (("mods", mods.bwd_mods if backward else mods.mods),)


def aux_of(mods: ModArgs | None):
    """The kernels' aux_tensors argument: a list, or None."""
    return list(mods.aux_tensors) if mods is not None and mods.aux_tensors else None


def has_score_mod(mods: ModArgs | None) -> bool:
    return mods is not None and mods.mods.score_mod is not None


def refuse_chunked_mods(mods: ModArgs | None, batch: int):
    """A batch past one launch's grid runs in chunks, whose b_idx would count from each chunk's start."""
    if mods is not None and chunked(batch):
        raise ValueError(f"score_mod / mask_mod with {batch} sequences: at most one launch's grid (65535)")


def mods_key(score_mod, mask_mod, score_mod_bwd) -> str:
    """A name of these mods made of their digests (what a compile key holds of them): the same
    code with the same captures gives the same name."""
    return "|".join(f"{role}:{mod.digest if mod is not None else '-'}" for role, mod in (
        ("score", UserMod.of(score_mod)), ("mask", UserMod.of(mask_mod)), ("bwd", UserMod.of(score_mod_bwd))))
