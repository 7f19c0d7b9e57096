"""cute-flash: FlashAttention-2 in the CUTLASS CuTe DSL, a drop-in for flash_attn's Python API.

Importing the package needs only torch; the DSL is imported when a kernel is first launched.
`cute_flash.flash_attn_interface` mirrors `flash_attn.flash_attn_interface`, private forwards
included.
"""
__version__ = "0.1.0"

from cute_flash.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
