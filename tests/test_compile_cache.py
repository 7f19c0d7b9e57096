"""The compile cache on disk, on the CPU (kernels compiled for sm_90a and loaded back, never
run): a fresh process loads instead of compiling, a corrupt entry is rebuilt, the cache can be
switched off, and 8 processes starting together on an empty cache compile each variant once."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from cute_flash import compile_cache  # noqa: E402
from cute_flash.kernels.append import AppendConfig  # noqa: E402
from cute_flash.launch.compiled import cached_append  # noqa: E402

PLAIN = AppendConfig("fp16", False, False, False, False, False)
ROTARY = AppendConfig("bf16", True, False, True, False, True)
ROOT = Path(__file__).resolve().parents[1]


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
    cached_append(PLAIN, 90)
    path = compile_cache.entry_path((PLAIN, 90))
    assert path.exists() and path.parent.parent == cache_dir
    assert len(_compiles(caplog)) == 1 and PLAIN.name in _compiles(caplog)[0]

    compile_cache.clear_memory()  # as a fresh process would: nothing in memory
    fn = cached_append(PLAIN, 90)
    assert len(_compiles(caplog)) == 1  # loaded, not compiled again
    assert type(fn).__name__ == "Function" and callable(fn)
    assert any(r.getMessage().startswith("loaded ") for r in caplog.records)


def test_a_corrupt_entry_is_rebuilt(cache_dir, caplog):
    caplog.set_level("INFO", logger="cute_flash")
    cached_append(PLAIN, 90)
    path = compile_cache.entry_path((PLAIN, 90))
    path.write_bytes(b"not an object file")
    compile_cache.clear_memory()
    cached_append(PLAIN, 90)
    assert any("failed to load" in r.getMessage() for r in caplog.records)
    assert len(_compiles(caplog)) == 2 and path.stat().st_size > 1000
    compile_cache.clear_memory()
    assert callable(cached_append(PLAIN, 90))  # the rebuilt entry loads


def test_the_disk_cache_can_be_switched_off(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("CUTE_FLASH_CACHE", "0")
    caplog.set_level("INFO", logger="cute_flash")
    cached_append(PLAIN, 90)
    assert not list(cache_dir.rglob("*.o")) and "disk cache off" in _compiles(caplog)[0]


def test_keys_and_fingerprint_name_their_inputs(cache_dir):
    a, b = compile_cache.entry_path((PLAIN, 90)), compile_cache.entry_path((PLAIN, 80))
    assert a != b and a.parent == b.parent  # one directory per fingerprint, one file per key
    assert compile_cache.entry_path((PLAIN, 90)) == a  # stable
    assert len(compile_cache.fingerprint()) == 16


WORKER = textwrap.dedent("""
    import sys
    from cute_flash import compile_cache
    from cute_flash.kernels.append import AppendConfig
    from cute_flash.launch.compiled import cached_append
    for config in (AppendConfig("fp16", False, False, False, False, False),
                   AppendConfig("bf16", True, False, True, False, True)):
        fn = cached_append(config, 90)
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

    record = tmp_path / "keys.pkl"
    monkeypatch.setenv("CUTE_FLASH_RECORD", str(record))
    for config in (PLAIN, ROTARY, PLAIN):
        cached_append(config, 90)
    compile_cache.clear_memory()
    cached_append(ROTARY, 90)  # a second process using a recorded variant adds nothing
    assert compile_cache.read_keys(record) == [(PLAIN, 90), (ROTARY, 90)]

    fresh = tmp_path / "fresh"
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(fresh))
    monkeypatch.delenv("CUTE_FLASH_RECORD")
    compile_cache.clear_memory()
    assert cmd_compile([80], False, 1, str(record)) == 0
    assert sorted(fresh.rglob("*.o")) == sorted(compile_cache.entry_path(k) for k in [(PLAIN, 90), (ROTARY, 90)])
    assert "2 compiled, 0 already cached" in capsys.readouterr().out
