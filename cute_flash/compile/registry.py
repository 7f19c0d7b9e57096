"""Compiling any kernel config, without knowing its type.

A config's class lives in its kernel's module (`cute_flash.kernels.sm80.fwd`,
`cute_flash.kernels.sm90.bwd`, ...), and that module defines `entry(config)`, the jit function
the config compiles, and `fake_args(config)`, placeholders in that function's parameter order.
A compile needs no GPU and no real tensors: the placeholders carry dtypes, ranks, the stride
divisibility the launcher guarantees, and a stream taken from the caller (torch's current
stream) at call time.
"""
from __future__ import annotations

import importlib

import cutlass.cute as cute

from cute_flash.compile.cache import get_or_compile
from layouts.traits import sm_name


def kernel_module(config):
    """The module that owns `config`'s class: its kernel, `entry` and `fake_args`."""
    module = importlib.import_module(type(config).__module__)
    if not (hasattr(module, "entry") and hasattr(module, "fake_args")):
        raise TypeError(f"no kernel compiles a {type(config).__name__}")
    return module


def arch_option(arch: int | None) -> str:
    return "" if arch is None else f"--gpu-arch={sm_name(arch)}"


def compile_tvm_ffi(entry, args, arch: int | None = None, extra_options: str = ""):
    """cute.compile with a TVM-FFI entry. arch=None targets the current GPU; an explicit arch
    (80, 90) needs no GPU (nothing is launched)."""
    options = f"--enable-tvm-ffi {arch_option(arch)} {extra_options}".strip()
    return cute.compile(entry, *args, options=options)


def build(config, arch: int | None = None, extra_options: str = ""):
    """Compile `config` for `arch`: its module's entry traced on its module's fake arguments."""
    module = kernel_module(config)
    return compile_tvm_ffi(module.entry(config), module.fake_args(config), arch, extra_options)


def cached(config, arch: int):
    """The TVM-FFI function of `config` on `arch`, from the compile cache (memory, then disk)
    or compiled; None where no GPU can load it."""
    return get_or_compile((config, arch), lambda: build(config, arch))
