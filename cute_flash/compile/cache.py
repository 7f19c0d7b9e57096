"""Compiled kernels, kept in memory and on disk: one per (kernel config, arch).

A key is everything a kernel specialises on at compile time (a frozen config: traits and
flags) plus the target arch; run-time values (lengths, strides, scales, window sizes) never
enter it, so a model's whole run compiles a handful of kernels once.

On disk (on by default): each compiled kernel is exported as an object file
(`export_to_c`) and loaded back in a fresh process with `cutlass.cute.runtime.load_module`:
about 1 s for the DSL runtime's set-up on the first load of a process, then ~2 ms per
kernel, against ~4 s per compile. Files live in `CUTE_FLASH_CACHE_DIR` (default
`~/.cache/cute_flash`), under a directory named by a fingerprint of the DSL, tvm-ffi and Python
versions and the source of `cute_flash` and `layouts` (any edit starts a fresh directory);
`CUTE_FLASH_CACHE=0` turns the disk cache off. Many processes starting cold at once compile
each kernel once: a file lock per key, the object written to a temporary file and renamed into
place, and an entry that fails to load is deleted and rebuilt.

Every compile logs one INFO line on the `cute_flash` logger (variant, arch, seconds, file);
loads and hits log at DEBUG. `CUTE_FLASH_LOG_LEVEL` sets the level (default INFO).

A workload's own variants: with `CUTE_FLASH_RECORD=FILE`, every key a process uses is added
to FILE (a JSON list, shared by concurrent processes under a file lock: data, never code, so
reading a file from elsewhere runs nothing), and `python -m cute_flash compile --keys FILE`
compiles exactly those, for instance on a CPU build
box for a new release of this package (a new fingerprint). The CI set that `compile` fills by
default is a small part of what a test suite or a model uses (docs/tuning/host.md).
"""
from __future__ import annotations

import functools
import dataclasses
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Hashable

log = logging.getLogger("cute_flash")

_memory: dict[Hashable, object] = {}
_keepalive: dict[Hashable, object] = {}
_lock = threading.Lock()


def _configure_logging():
    """INFO by default, so a call that compiles says so; CUTE_FLASH_LOG_LEVEL overrides it. A
    handler is added only when the application has configured none."""
    log.setLevel(os.environ.get("CUTE_FLASH_LOG_LEVEL", "INFO").upper())
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("cute_flash: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


_configure_logging()


def enabled() -> bool:
    return os.environ.get("CUTE_FLASH_CACHE", "1") != "0"


def cache_root() -> Path:
    return Path(os.environ.get("CUTE_FLASH_CACHE_DIR") or Path.home() / ".cache" / "cute_flash")


# the distributions whose versions key the cache, and the module each installs
VERSIONED = (("nvidia-cutlass-dsl", "cutlass"), ("apache-tvm-ffi", "tvm_ffi"))


def _version(dist: str, module: str) -> str:
    """`dist`'s installed version; where it has no package metadata (a vendored copy on the
    path, as a bundle unpacked without its wheel's dist-info), its module's `__version__`."""
    from importlib import import_module, metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        try:
            return f"{module} {getattr(import_module(module), '__version__', 'unversioned')}"
        except ImportError:
            return "absent"


@functools.lru_cache(maxsize=None)
def fingerprint() -> str:
    """What invalidates every entry: the DSL, tvm-ffi and Python versions and our source."""
    digest = hashlib.sha256()
    for dist, module in VERSIONED:
        digest.update(f"{dist}={_version(dist, module)};".encode())
    digest.update(sys.version.encode())
    root = Path(__file__).resolve().parents[2]  # the folder holding cute_flash/ and layouts/
    for package in (root / "cute_flash", root / "layouts"):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def entry_path(key: Hashable) -> Path:
    """The object file of `key`: keys are frozen dataclasses and plain values, whose repr is
    stable across processes."""
    return cache_root() / fingerprint() / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.o"


def variant_name(key) -> str:
    config, arch = key
    return f"{getattr(config, 'name', config)} sm_{arch}"


def get_or_compile(key: Hashable, build: Callable[[], object]):
    """The TVM-FFI function of `key` (a (config, arch) pair): from memory, else from the disk
    cache, else `build()` (a `cute.compile` result), stored to disk when the cache is on."""
    try:
        return _memory[key]
    except KeyError:
        with _lock:
            if key not in _memory:  # None on a machine without a GPU: compiled, not loadable
                _memory[key] = _load_or_build(key, build)
                _record(key)
            return _memory[key]


def _record(key):
    """Add `key` to the list in CUTE_FLASH_RECORD, if set."""
    path = os.environ.get("CUTE_FLASH_RECORD")
    if not path:
        return
    from filelock import FileLock

    try:
        _encode(key)
    except TypeError:  # a caller's Python-written mod: its code is not data a keys file could hold
        log.debug("%s not recorded in %s: its key holds code", variant_name(key), path)
        return
    with FileLock(f"{path}.lock"):
        keys = read_keys(path) if os.path.exists(path) else []
        if key not in keys:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump([_encode(k) for k in keys + [key]], f, indent=1)
            os.replace(tmp, path)


class KeysFileError(ValueError):
    """A keys file that is missing, unreadable or not one this package wrote."""


def read_keys(path) -> list:
    """The (config, arch) keys recorded in `path`; KeysFileError names what is wrong with it."""
    try:
        with open(path) as f:
            keys = [_decode(k) for k in json.load(f)]
        for key in keys:
            if not (isinstance(key, tuple) and len(key) == 2 and dataclasses.is_dataclass(key[0])
                    and isinstance(key[1], int)):
                raise ValueError(f"{key!r} is not a (config, arch) pair")
        return keys
    except OSError as exc:
        raise KeysFileError(f"cannot read keys file {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise KeysFileError(f"{path} is not a keys file written with CUTE_FLASH_RECORD ({exc})") from None


# The packages whose frozen dataclasses a key may hold: a keys file names classes only there.
_KEY_PACKAGES = ("cute_flash.", "layouts.")


def _encode(value):
    """A key as JSON: dataclasses by module, name and fields; tuples as lists marked as such."""
    if dataclasses.is_dataclass(value):
        cls = type(value)
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a compile key holds a {type(value).__name__}, which a keys file cannot store")


def _decode(value):
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    if isinstance(value, dict):
        module, name = value["dataclass"].split(":")
        if not module.startswith(_KEY_PACKAGES):
            raise ValueError(f"{value['dataclass']} is not a cute_flash config")
        cls = getattr(importlib.import_module(module), name)
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"{value['dataclass']} is not a config dataclass")
        return cls(**{k: _decode(v) for k, v in value["fields"].items()})
    if isinstance(value, list):
        raise ValueError("a bare list")
    return value


def _load_or_build(key, build):
    if not enabled():
        return _build(key, build, None)
    from filelock import FileLock

    path = entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if path.exists():
            try:
                return _load(key, path)
            except Exception as exc:  # a truncated or foreign file: rebuild it
                log.warning("cache entry %s of %s failed to load (%s); rebuilding", path, variant_name(key), exc)
                path.unlink(missing_ok=True)
        return _build(key, build, path)


def _symbol(path: Path) -> str:
    return "cute_flash_" + path.stem


def _load(key, path: Path):
    from cutlass.cute.runtime import load_module

    t0 = time.perf_counter()
    module = load_module(str(path), enable_tvm_ffi=True)
    fn = getattr(module, _symbol(path))
    _keepalive[key] = module
    log.debug("loaded %s from %s in %.3f s", variant_name(key), path, time.perf_counter() - t0)
    return fn


def _build(key, build, path: Path | None):
    t0 = time.perf_counter()
    compiled = build()
    seconds = time.perf_counter() - t0
    _keepalive[key] = compiled
    if path is not None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        compiled.export_to_c(str(tmp), function_name=_symbol(path))
        os.replace(tmp, path)
    log.info("compiled %s in %.1f s%s", variant_name(key), seconds, f" -> {path}" if path else " (disk cache off)")
    # The TVM-FFI function itself, called positionally: it skips the DSL's keyword-argument
    # wrapper (two Python frames per launch, where host time counts). None without a GPU.
    return compiled.__tvm_ffi_object__()


def clear_memory():
    """Forget the in-process kernels (tests: the next lookup goes to disk)."""
    with _lock:
        _memory.clear()
        _keepalive.clear()
