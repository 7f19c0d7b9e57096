"""cute-flash under flash-attn's module names, for code that imports flash-attn itself.

    from cute_flash.integrations.flash_attn import install
    install()                       # before the client is imported
    import ring_flash_attn          # its `from flash_attn.flash_attn_interface import ...` finds us
                                    # (under transformers 5: `import_ring_flash_attn()`, below)

`install` puts a `flash_attn` package in `sys.modules` whose `flash_attn_interface` is
`cute_flash.flash_attn_interface` (flash-attn 2.8.3's public functions and its private forwards
and backwards, same names, signatures and return values) and whose top level holds the public
functions, as flash-attn's does. Nothing on disk changes and nothing else is imported in its
place: a client importing anything else of flash-attn (`flash_attn.bert_padding`, its CUDA
extension) gets an ImportError.
"""
from __future__ import annotations

import importlib
import sys
import types

VERSION = "2.8.3"  # the flash-attn API served


def install(replace: bool = False) -> types.ModuleType:
    """Serve `flash_attn` and `flash_attn.flash_attn_interface` from cute_flash in this process;
    returns the `flash_attn` module. A real flash-attn already imported stays, with a
    RuntimeError, unless `replace`; installing twice returns the first install's module."""
    current = sys.modules.get("flash_attn")
    if current is not None:
        if getattr(current, "__cute_flash__", False):
            return current
        if not replace:
            raise RuntimeError("flash_attn is already imported (flash-attn itself); call install() before anything "
                               "imports it, or install(replace=True) to take its place from now on")
    from cute_flash import flash_attn_interface

    module = types.ModuleType("flash_attn", "flash-attn's module names, served by cute_flash "
                                            "(cute_flash.integrations.flash_attn.install)")
    module.__path__ = []  # a package: its submodule is found in sys.modules
    module.__version__ = VERSION
    module.__cute_flash__ = True
    module.flash_attn_interface = flash_attn_interface
    for name in flash_attn_interface.__all__:
        if not name.startswith("_"):
            setattr(module, name, getattr(flash_attn_interface, name))
    sys.modules["flash_attn"] = module
    sys.modules["flash_attn.flash_attn_interface"] = flash_attn_interface
    return module


def import_ring_flash_attn():
    """`ring_flash_attn`, imported after `install()`. ring-flash-attn 0.1.8's package import also
    runs its transformers adapter, which needs transformers and a name transformers 5 no longer
    has there (`is_flash_attn_greater_or_equal_2_10` in `transformers.modeling_flash_attention_utils`),
    so without transformers or under transformers 5 it fails, with or without cute-flash. There
    the adapter is replaced by a module whose two functions raise NotImplementedError; the
    attention functions are ring-flash-attn's own, unchanged."""
    install()
    try:
        hf_utils = importlib.import_module("transformers.modeling_flash_attention_utils")
    except ImportError:
        hf_utils = None
    if not hasattr(hf_utils, "is_flash_attn_greater_or_equal_2_10") and "ring_flash_attn.adapters" not in sys.modules:
        sys.modules["ring_flash_attn.adapters"] = _unavailable_adapter()
    return importlib.import_module("ring_flash_attn")


def _unavailable_adapter() -> types.ModuleType:
    adapter = types.ModuleType("ring_flash_attn.adapters", "ring-flash-attn's transformers adapter, which does not "
                                                           "import here")

    def unavailable(*args, **kwargs):
        raise NotImplementedError("ring-flash-attn 0.1.8's transformers adapter needs transformers 4 (up to 4.57)")

    adapter.substitute_hf_flash_attn = adapter.update_ring_flash_attn_params = unavailable
    return adapter
