"""The compile cache on disk, on the CPU (kernels compiled for sm_90a and loaded back, never
run): a fresh process loads instead of compiling, a corrupt entry is rebuilt, the cache can be
switched off, and 8 processes starting together on an empty cache compile each variant once."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_flash.compile import cache as compile_cache
from cute_flash.compile.registry import cached
from cute_flash.kernels.sm80.append import AppendConfig

PLAIN = AppendConfig("fp16", False, False, False, False, False)
ROTARY = AppendConfig("bf16", True, False, True, False, True)
ROOT = Path(__file__).resolve().parents[2]  # the repository


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUTE_FLASH_CACHE", raising=False)
    compile_cache.clear_memory()
    yield tmp_path
    compile_cache.clear_memory()


def _compiles(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled ")]


def test_a_compiled_kernel_is_stored_and_loaded_back(cache_dir, caplog):
    caplog.set_level("DEBUG", logger="cute_flash")
    cached(PLAIN, 90)
    path = compile_cache.entry_path((PLAIN, 90))
    assert path.exists() and path.parent.parent == cache_dir
    assert len(_compiles(caplog)) == 1 and PLAIN.name in _compiles(caplog)[0]

    compile_cache.clear_memory()  # as a fresh process would: nothing in memory
    fn = cached(PLAIN, 90)
    assert len(_compiles(caplog)) == 1  # loaded, not compiled again
    assert type(fn).__name__ == "Function" and callable(fn)
    assert any(r.getMessage().startswith("loaded ") for r in caplog.records)


def test_a_corrupt_entry_is_rebuilt(cache_dir, caplog):
    caplog.set_level("INFO", logger="cute_flash")
    cached(PLAIN, 90)
    path = compile_cache.entry_path((PLAIN, 90))
    path.write_bytes(b"not an object file")
    compile_cache.clear_memory()
    cached(PLAIN, 90)
    assert any("failed to load" in r.getMessage() for r in caplog.records)
    assert len(_compiles(caplog)) == 2 and path.stat().st_size > 1000
    compile_cache.clear_memory()
    assert callable(cached(PLAIN, 90))  # the rebuilt entry loads


def test_the_disk_cache_can_be_switched_off(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("CUTE_FLASH_CACHE", "0")
    caplog.set_level("INFO", logger="cute_flash")
    cached(PLAIN, 90)
    assert not list(cache_dir.rglob("*.o")) and "disk cache off" in _compiles(caplog)[0]


def test_keys_and_fingerprint_name_their_inputs(cache_dir):
    a, b = compile_cache.entry_path((PLAIN, 90)), compile_cache.entry_path((PLAIN, 80))
    assert a != b and a.parent == b.parent  # one directory per fingerprint, one file per key
    assert compile_cache.entry_path((PLAIN, 90)) == a  # stable
    assert len(compile_cache.fingerprint()) == 16


def test_a_package_without_metadata_is_versioned_by_its_module(monkeypatch):
    """A DSL or tvm-ffi copy on the path without its wheel's dist-info (a bundle unpacked
    alone) keys the cache by its module's __version__ instead of stopping every compile at
    `PackageNotFoundError` (the tenth session's first GPU call)."""
    import types
    from importlib import metadata

    def no_metadata(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", no_metadata)
    monkeypatch.setitem(sys.modules, "tvm_ffi", types.SimpleNamespace(__version__="9.9"))
    assert compile_cache._version("apache-tvm-ffi", "tvm_ffi") == "tvm_ffi 9.9"
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # not importable
    assert compile_cache._version("apache-tvm-ffi", "tvm_ffi") == "absent"


FINGERPRINT = "from cute_flash.compile import cache; print(cache.fingerprint())"


def _fingerprint_of(tree: Path, **env) -> str:
    """The fingerprint a fresh process computes for a copy of the package at `tree`."""
    run = subprocess.run([sys.executable, "-c", FINGERPRINT], cwd=tree, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tree), **env), check=True)
    return run.stdout.strip()


def test_the_fingerprint_changes_with_a_source_file_and_a_version(tmp_path):
    """Any edit of a kernel's source, or another DSL version, starts a fresh cache directory."""
    import shutil
    from importlib import metadata

    tree = tmp_path / "tree"
    for package in ("cute_flash", "layouts"):
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = _fingerprint_of(tree)
    assert before == _fingerprint_of(tree)  # stable across processes
    smem = tree / "layouts" / "smem.py"
    smem.write_text(smem.read_text() + "\n# an edit\n")
    edited = _fingerprint_of(tree)
    assert edited != before

    # another DSL version: a stand-in distribution metadata shadowing the installed one
    real = metadata.version("nvidia-cutlass-dsl")
    dist = tree / f"nvidia_cutlass_dsl-{real}.post999.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-cutlass-dsl\nVersion: {real}.post999\n")
    assert _fingerprint_of(tree) not in (before, edited)


def test_a_missing_or_foreign_keys_file_is_a_one_line_error(tmp_path, capsys):
    from cute_flash.__main__ import main

    assert main(["compile", "--keys", str(tmp_path / "nonexistent.json")]) == 2
    assert capsys.readouterr().err.strip().endswith("No such file or directory")
    for text in ("not json", '[{"dataclass": "os:system", "fields": {"command": "true"}}]', "[1]"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert main(["compile", "--keys", str(bad)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "is not a keys file written with CUTE_FLASH_RECORD" in err


WORKER = textwrap.dedent("""
    import sys
    from cute_flash.compile.registry import cached
    from cute_flash.kernels.sm80.append import AppendConfig
    for config in (AppendConfig("fp16", False, False, False, False, False),
                   AppendConfig("bf16", True, False, True, False, True)):
        fn = cached(config, 90)
        # the process that compiled holds a None function (no GPU here); the others loaded one
        print("RESULT", config.name, "none" if fn is None else type(fn).__name__, flush=True)
""")


def test_eight_cold_processes_compile_each_variant_once(tmp_path):
    env = dict(os.environ, CUTE_FLASH_CACHE_DIR=str(tmp_path), CUTE_FLASH_LOG_LEVEL="INFO",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUTE_FLASH_CACHE", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    text = "".join(outs)
    for config in (PLAIN, ROTARY):
        assert text.count(f"compiled {config.name} ") == 1, text  # once across the 8 processes
        results = [line.split()[2] for line in text.splitlines() if line.startswith(f"RESULT {config.name} ")]
        assert len(results) == 8 and results.count("Function") == 7 and results.count("none") == 1, text
    assert len(list(tmp_path.rglob("*.o"))) == 2 and not list(tmp_path.rglob("*.tmp"))


def test_recorded_keys_are_what_compile_keys_builds(cache_dir, monkeypatch, tmp_path, capsys):
    """CUTE_FLASH_RECORD lists each variant a process uses once; `compile --keys` builds exactly
    those into a fresh cache (a build box warming a new release for a workload)."""
    from cute_flash.__main__ import cmd_compile

    record = tmp_path / "keys.json"
    monkeypatch.setenv("CUTE_FLASH_RECORD", str(record))
    for config in (PLAIN, ROTARY, PLAIN):
        cached(config, 90)
    compile_cache.clear_memory()
    cached(ROTARY, 90)  # a second process using a recorded variant adds nothing
    assert compile_cache.read_keys(record) == [(PLAIN, 90), (ROTARY, 90)]
    assert '"dataclass": "cute_flash.kernels.sm80.append:AppendConfig"' in record.read_text()  # data, not a pickle

    fresh = tmp_path / "fresh"
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(fresh))
    monkeypatch.delenv("CUTE_FLASH_RECORD")
    compile_cache.clear_memory()
    assert cmd_compile([80], False, 1, str(record)) == 0
    assert sorted(fresh.rglob("*.o")) == sorted(compile_cache.entry_path(k) for k in [(PLAIN, 90), (ROTARY, 90)])
    assert "2 compiled, 0 already cached" in capsys.readouterr().out


def test_a_mod_is_found_again_by_its_code_and_a_changed_one_compiles(cache_dir, caplog, monkeypatch, tmp_path):
    """A kernel with a Python-written mod (kernels/common/user_mods.py) goes to disk under its
    mod's digest: the same mod, made anew (as in a fresh process), loads it; a mod capturing
    another constant compiles its own. A key holding a mod is left out of a CUTE_FLASH_RECORD
    keys file (its code is not data), and the call goes on."""
    import cutlass.cute as cute

    from cute_flash.kernels.common.user_mods import UserMod, UserMods
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from layouts.traits import choose_fwd_traits

    def scaled(factor):
        @cute.jit
        def mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
            return score * factor
        return mod

    def config(factor):
        return FwdConfig(choose_fwd_traits(64, "bf16", 80), mods=UserMods(UserMod.of(scaled(factor))))

    caplog.set_level("DEBUG", logger="cute_flash")
    monkeypatch.setenv("CUTE_FLASH_RECORD", str(tmp_path / "keys.json"))
    cached(config(0.5), 90)
    compile_cache.clear_memory()
    cached(config(0.5), 90)
    assert len(_compiles(caplog)) == 1 and any(r.getMessage().startswith("loaded ") for r in caplog.records)
    cached(config(0.25), 90)
    assert len(_compiles(caplog)) == 2
    assert not (tmp_path / "keys.json").exists()
