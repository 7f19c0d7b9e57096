"""`python -m cute_flash memcheck --jobs N` on CPU, with stand-ins for compute-sanitizer (runs
its command, prints a clean summary) and nvidia-smi (two GPUs): every collected test runs in
exactly one shard, shards alternate GPUs, and a failing test fails the command."""
import os
import stat

import pytest

from cute_flash.__main__ import cmd_memcheck

TESTS = '''
import os
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("i", range(5))
def test_case(i):
    with open(os.path.join(os.environ["RECORD_DIR"], f"{i}"), "w") as f:
        f.write(os.environ["CUDA_VISIBLE_DEVICES"])
    assert i != int(os.environ.get("FAIL_CASE", "-1"))
'''


def _script(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    # Drop the six sanitizer options, run the command, report like compute-sanitizer.
    _script(bin_dir / "compute-sanitizer",
            'shift 6; "$@"; rc=$?; echo "========= ERROR SUMMARY: 0 errors"; exit $rc\n')
    _script(bin_dir / "nvidia-smi", "echo 0; echo 1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RECORD_DIR", str(record))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "test_cases.py").write_text(TESTS)
    monkeypatch.chdir(tmp_path)  # test ids are relative to the directory the command runs in
    return "test_cases.py", record


def test_jobs_run_each_test_once_over_both_gpus(fake_machine, capsys):
    tests, record = fake_machine
    assert cmd_memcheck(["-q", "-p", "no:cacheprovider", tests], jobs=3) == 0
    out = capsys.readouterr().out
    assert "5 tests in 3 sanitized processes" in out
    assert "3 sanitized processes, 0 errors" in out
    # round-robin: cases 0 and 3 in shard 0 (GPU 0), 1 and 4 in shard 1 (GPU 1), 2 in shard 2 (GPU 0)
    assert {p.name: p.read_text() for p in record.iterdir()} == {"0": "0", "1": "1", "2": "0", "3": "0", "4": "1"}


def test_a_failing_test_fails_the_command(fake_machine, monkeypatch, capsys):
    tests, _ = fake_machine
    monkeypatch.setenv("FAIL_CASE", "4")
    assert cmd_memcheck(["-q", "-p", "no:cacheprovider", tests], jobs=2) == 1
    assert "1 failed" in capsys.readouterr().out
