"""Feature-flag names and letters every kernel config shares: a variant's name in compile reports
is its traits' name plus one letter per flag ('.' when off)."""
from dataclasses import fields

FLAG_LETTERS = dict(has_left="L", has_right="R", has_alibi="A", has_softcap="S", has_dropout="Z", even_k="K",
                    varlen="V", has_seqused_k="U", paged="P", any_page_size="p", kvcache="C", split="X",
                    has_leftpad="l", has_batch_idx="B", pack_gqa="G", deterministic="D",
                    mods="M", block_sparse="b", learnable_sink="N")
SCORE_FLAGS = ("has_left", "has_right", "has_alibi", "has_softcap", "even_k")
CACHE_FLAGS = ("paged", "split", "has_leftpad", "has_batch_idx", "pack_gqa")


def score_letters(config) -> str:
    """One FLAG_LETTERS letter per `has_*` field of a Hopper config, '.' when off (its name's
    flag part, as `FwdConfig.letters` is the SM80 one's)."""
    return "".join(FLAG_LETTERS[f.name] if getattr(config, f.name) else "." for f in fields(config)
                   if f.name.startswith("has_"))
