"""`python -m cute_flash memcheck|racecheck --jobs N` on CPU, with stand-ins for
compute-sanitizer (runs its command, prints the tool's summary) and nvidia-smi (two GPUs): every
collected test runs in exactly one shard, shards alternate GPUs, and a failing test, a finding
or a process without a summary fails the command."""
import os
import stat
import subprocess
import time

import pytest

from cute_flash.tools import sanitize

TESTS = '''
import os
import time

import pytest

pytestmark = pytest.mark.gpu


class AcceleratorError(RuntimeError):
    """Stands for torch's CUDA error."""


@pytest.mark.parametrize("i", range(5))
def test_case(i):
    with open(os.path.join(os.environ["RECORD_DIR"], f"{i}"), "w") as f:
        f.write(os.environ["CUDA_VISIBLE_DEVICES"] + os.environ.get("CUDA_LAUNCH_BLOCKING", ""))
    if os.environ.get("ONE_AT_A_TIME"):  # no other process inside a test meanwhile
        os.mkdir(os.path.join(os.environ["RECORD_DIR"], "running"))
        time.sleep(0.3)
        os.rmdir(os.path.join(os.environ["RECORD_DIR"], "running"))
    if i == int(os.environ.get("FAULT_CASE", "-1")):
        raise AcceleratorError("an illegal memory access was encountered")
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
    # --help: the options it takes (--force-synchronization-limit unless OLD_SANITIZER is set).
    # Drop the sanitizer's options (through --error-exitcode N), run the command, report like
    # compute-sanitizer: the tool's summary with FINDINGS (default 0) findings, none where
    # NO_SUMMARY is set, after the sanitizer's own abort line where ABORT is set (or where the
    # command names every test id in ABORT_WHEN). A tool's canary is not run (it needs a GPU):
    # CANARY_FINDINGS (default 3) findings.
    _script(bin_dir / "compute-sanitizer",
            'case "$1" in --help) echo "  --force-blocking-launches arg"; [ -z "$OLD_SANITIZER" ] && '
            'echo "  --force-synchronization-limit arg"; exit 0;; esac\n'
            'tool=$2; while [ "$1" != --error-exitcode ]; do shift; done; shift 2\n'
            'case "$*" in *tools.canaries*) n=${CANARY_FINDINGS:-3}\n'
            '  if [ "$tool" = racecheck ]; then echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, '
            '0 warnings)"; else echo "========= ERROR SUMMARY: $n errors"; fi; exit 86;; esac\n'
            '[ -n "$HOLD" ] && echo $$ >> "$RECORD_DIR/pids" && sleep "$HOLD"\n'
            '[ -n "$ABORT" ] && echo "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware '
            'exception."\n'
            'if [ -n "$ABORT_WHEN" ]; then hit=1; for t in $ABORT_WHEN; do case "$*" in *"$t"*) ;; *) hit=0;; esac; '
            'done; [ $hit = 1 ] && echo "========= Internal Sanitizer Error: The Sanitizer failed to handle a hardware '
            'exception."; fi\n'
            '"$@"; rc=$?; n=${FINDINGS:-0}; [ -n "$NO_SUMMARY" ] && exit $rc\n'
            'if [ "$tool" = racecheck ]; then\n'
            '  echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, 0 warnings)"\n'
            'else echo "========= ERROR SUMMARY: $n errors"; fi; exit $rc\n')
    # Two GPUs; FREE_MIB (default 81000) free on each; 4321 MiB used by each fake sanitizer that
    # recorded its pid (HOLD)
    _script(bin_dir / "nvidia-smi", 'case "$*" in *memory.free*) echo ${FREE_MIB:-81000};; *compute-apps*) '
                                    '[ -f "$RECORD_DIR/pids" ] && sed "s/$/, 4321/" "$RECORD_DIR/pids";; '
                                    '*) echo 0; echo 1;; esac\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RECORD_DIR", str(record))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the stand-in tests need none: 2 s less a process
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "test_cases.py").write_text(TESTS)
    monkeypatch.chdir(tmp_path)  # test ids are relative to the directory the command runs in
    return "test_cases.py", record


@pytest.mark.parametrize("tool, noun", [("memcheck", "errors"), ("racecheck", "hazards")])
def test_jobs_run_each_test_once_over_both_gpus(fake_machine, capsys, tool, noun):
    tests, record = fake_machine
    assert sanitize.run(tool, ["-q", "-p", "no:cacheprovider", tests], jobs=3) == 0
    out = capsys.readouterr().out
    assert f"{tool}: 5 tests in 3 sanitized processes" in out
    assert f"--tool {tool}" in out
    assert f"3 sanitized processes, 0 {noun}" in out
    # round-robin: cases 0 and 3 in shard 0 (GPU 0), 1 and 4 in shard 1 (GPU 1), 2 in shard 2 (GPU 0)
    assert {p.name: p.read_text() for p in record.iterdir()} == {"0": "0", "1": "1", "2": "0", "3": "0", "4": "1"}


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_a_failing_test_fails_the_command(fake_machine, monkeypatch, capsys, tool):
    tests, _ = fake_machine
    monkeypatch.setenv("FAIL_CASE", "4")
    assert sanitize.run(tool, ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 1
    assert "1 failed" in capsys.readouterr().out


@pytest.mark.parametrize("tool, noun", [("memcheck", "errors"), ("racecheck", "hazards")])
def test_a_finding_fails_the_command(fake_machine, monkeypatch, capsys, tool, noun):
    tests, _ = fake_machine
    monkeypatch.setenv("FINDINGS", "2")
    assert sanitize.run(tool, ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 1
    assert f"2 sanitized processes, 4 {noun}" in capsys.readouterr().out


def test_a_process_without_a_summary_fails_the_command(fake_machine, monkeypatch):
    tests, _ = fake_machine
    monkeypatch.setenv("NO_SUMMARY", "1")
    assert sanitize.run("racecheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 1


@pytest.mark.parametrize("tool, canary, noun", [("memcheck", "overrun", "errors"), ("racecheck", "race", "hazards")])
def test_each_tool_shows_its_canary_first(fake_machine, capsys, tool, canary, noun):
    tests, _ = fake_machine
    assert sanitize.run(tool, ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 0
    out = capsys.readouterr().out
    assert f"{tool} canary ({canary}, {noun} on purpose): 3 reported" in out
    assert f"--kernel-name kns={sanitize.OUR_KERNELS}" in out
    assert out.index("canary") < out.index("sanitized processes")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_a_silent_canary_fails_the_tool_before_any_test(fake_machine, monkeypatch, capsys, tool):
    """A kernel filter that matches none of our kernels would report nothing on any suite."""
    tests, record = fake_machine
    monkeypatch.setenv("CANARY_FINDINGS", "0")
    assert sanitize.run(tool, ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 1
    assert "does not see our kernels; no test was run" in capsys.readouterr().out
    assert not list(record.iterdir())


def test_chunks_run_in_order_a_few_at_a_time_and_only_picks_some(fake_machine, capsys):
    """--chunk: consecutive tests per process, `jobs` processes at a time; --only: the numbered
    processes alone (to finish a run that a time limit cut short)."""
    tests, record = fake_machine
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2, chunk=2) == 0
    out = capsys.readouterr().out
    assert "memcheck: 5 tests in 3 sanitized processes, 2 at a time" in out
    assert out.count("done: 0 errors, exit 0") == 3
    # chunks [0, 1] (GPU 0), [2, 3] (GPU 1), [4] (GPU 0)
    assert {p.name: p.read_text() for p in record.iterdir()} == {"0": "0", "1": "0", "2": "1", "3": "1", "4": "0"}
    for p in record.iterdir():
        p.unlink()
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2, chunk=2, only=[2]) == 0
    assert sorted(p.name for p in record.iterdir()) == ["4"]
    assert "memcheck: 1 sanitized processes, 0 errors" in capsys.readouterr().out


def test_the_deadline_stops_the_run_and_names_what_is_left(fake_machine, monkeypatch, capsys):
    """--deadline: no process starts after it, the running one is stopped with the processes
    under it, the command fails naming the processes left, and --only with those finishes the
    run (every test run once, counting the first run's)."""
    tests, record = fake_machine
    monkeypatch.setenv("HOLD", "60")  # each fake sanitizer sleeps 60 s before its tests
    # 15 s: the collection (a few seconds, more on a loaded machine) is done and the first process is in its sleep
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=1, chunk=2, deadline=15) == 1
    out = capsys.readouterr().out
    assert "[0] stopped at the deadline" in out
    assert ("memcheck: the deadline (15 s) left 3 processes unfinished; to finish: the same command with "
            "--only 0,1,2") in out
    held = [int(p) for p in (record / "pids").read_text().split()]
    assert len(held) == 1 and not os.path.exists(f"/proc/{held[0]}")  # the stopped sanitizer ...
    assert not [p for p in record.iterdir() if p.name != "pids"]  # ... ran no test (its sleep was stopped too)
    monkeypatch.delenv("HOLD")
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=1, chunk=2, only=[0, 1, 2]) == 0
    assert sorted(p.name for p in record.iterdir() if p.name != "pids") == ["0", "1", "2", "3", "4"]


def test_a_sanitizer_abort_is_named_apart_from_findings(fake_machine, monkeypatch, capsys):
    tests, _ = fake_machine
    monkeypatch.setenv("ABORT", "1")
    monkeypatch.setenv("FINDINGS", "1")
    assert sanitize.run("racecheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 1
    out = capsys.readouterr().out
    assert "done: 1 hazards (the sanitizer aborted: its count is that abort)" in out
    assert "racecheck: 2 sanitized processes, 2 of them aborted by the sanitizer, 2 hazards" in out


def test_retry_aborted_runs_an_aborted_processs_tests_one_by_one(fake_machine, monkeypatch, capsys):
    """--retry-aborted: the tests of a process the sanitizer aborted run again, one process each;
    the run passes when each of them runs clean alone, and names those that abort again."""
    tests, record = fake_machine
    monkeypatch.setenv("ABORT_WHEN", "test_case[1]")  # the fake sanitizer aborts processes that run case 1 ...
    monkeypatch.setenv("FAULT_CASE", "1")  # ... where the test sees a CUDA error
    assert sanitize.run("racecheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2, chunk=3,
                        retry_aborted=True) == 1  # ... alone too
    out = capsys.readouterr().out
    assert "racecheck: the 3 tests of the 1 aborted processes again, one process each" in out
    # the retry's launches were blocking: its traceback's CUDA error names the faulting call
    assert ("aborted again alone: test_cases.py::test_case[1]; first seen at test_cases.py:23: "
            'raise AcceleratorError("an illegal memory access was encountered")') in out
    assert "aborted again alone: test_cases.py::test_case[0]" not in out
    assert (record / "0").read_text() == "01"  # retried alone on GPU 0, launches blocking
    assert (record / "3").read_text() == "1"  # the first pass only: GPU 1, not blocking
    monkeypatch.setenv("ABORT_WHEN", "test_case[1] test_case[2]")  # aborts only a process with both
    monkeypatch.delenv("FAULT_CASE")
    assert sanitize.run("racecheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2, chunk=3,
                        retry_aborted=True) == 0


MODEL_TESTS = '''
import os
import pytest

pytestmark = pytest.mark.gpu


def test_reference():
    with open(os.path.join(os.environ["RECORD_DIR"], "gemms"), "w") as f:
        f.write(os.environ.get("CUTE_FLASH_REFERENCE_GEMMS", "unset"))


@pytest.mark.lowp_gemm
def test_model():
    open(os.path.join(os.environ["RECORD_DIR"], "model"), "w").close()
'''


@pytest.mark.parametrize("tool, gemms, model_runs", [("memcheck", "unset", True), ("racecheck", "1", False)])
def test_racecheck_leaves_out_bf16_models_and_rounds_the_references_gemms(fake_machine, capsys, tool, gemms,
                                                                           model_runs):
    tests, record = fake_machine
    with open("test_model.py", "w") as f:
        f.write(MODEL_TESTS)
    assert sanitize.run(tool, ["-q", "-p", "no:cacheprovider", tests, "test_model.py"], jobs=2) == 0
    out = capsys.readouterr().out
    assert f"{tool}: {7 if model_runs else 6} tests in 2 sanitized processes" in out
    assert ("racecheck: leaves out 1 tests marked lowp_gemm" in out) == (not model_runs)
    assert (record / "gemms").read_text() == gemms
    assert (record / "model").exists() == model_runs


BIG_TESTS = '''
import os
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.whole_gpu]


def test_big():
    record = os.environ["RECORD_DIR"]
    seen = " ".join(sorted(os.listdir(record)))
    with open(os.path.join(record, "big"), "w") as f:
        f.write(seen)
'''


def test_whole_gpu_tests_run_alone_after_the_others(fake_machine, capsys):
    tests, record = fake_machine
    with open("test_big.py", "w") as f:
        f.write(BIG_TESTS)
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", "test_big.py", tests], jobs=3) == 0
    out = capsys.readouterr().out
    assert "memcheck: 5 tests in 3 sanitized processes; then 1 marked whole_gpu, one process each, alone" in out
    assert (record / "big").read_text() == "0 1 2 3 4"  # the other five had finished


def test_a_process_waits_for_memory_while_others_run(fake_machine, monkeypatch, capsys):
    tests, record = fake_machine
    monkeypatch.setenv("FREE_MIB", "0")
    monkeypatch.setenv("ONE_AT_A_TIME", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=3, chunk=1) == 0
    assert "memcheck: 5 sanitized processes, 0 errors" in capsys.readouterr().out


SLOW_TESTS = '''
import os
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sanitizer_slow]


@pytest.mark.parametrize("j", range(2))
def test_slow(j):
    record = os.environ["RECORD_DIR"]
    seen = " ".join(sorted(os.listdir(record)))
    with open(os.path.join(record, f"slow{j}"), "w") as f:
        f.write(seen)
'''


def test_sanitizer_slow_tests_start_first_one_process_each(fake_machine, capsys):
    tests, record = fake_machine
    with open("test_slow.py", "w") as f:
        f.write(SLOW_TESTS)
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests, "test_slow.py"], jobs=1, chunk=5) == 0
    out = capsys.readouterr().out
    assert "memcheck: 7 tests in 3 sanitized processes (2 marked sanitizer_slow first, one process each)" in out
    assert (record / "slow0").read_text() == "" and (record / "slow1").read_text() == "slow0"


def test_gpu_memory_counts_for_the_shard_an_app_runs_under():
    """`sanitize.memory_by_root`: an app's MiB count for the shard whose sanitizer it descends
    from (through any depth), summed per shard; an app under no sanitizer counts for none."""
    parents = {11: 10, 12: 11, 21: 20, 30: 1, 10: 1, 20: 1}
    apps = [(12, 500), (11, 100), (21, 7), (30, 999)]
    assert sanitize.memory_by_root(apps, parents.get, {10: 0, 20: 1}) == {0: 600, 1: 7}


def test_each_process_shows_its_gpu_memory_peak(fake_machine, monkeypatch, capsys):
    """The done line of a process gives the most GPU memory nvidia-smi listed for it while it ran
    (sampled every 3 s: the fake sanitizer holds for 4)."""
    tests, record = fake_machine
    monkeypatch.setenv("HOLD", "4")
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 0
    assert capsys.readouterr().out.count("done: 0 errors, exit 0, GPU memory peak 4321 MiB") == 2


def test_a_machine_without_nvidia_smi_runs_the_command(fake_machine, capsys):
    """No nvidia-smi on the PATH: one GPU is assumed, nothing waits for memory, no peak is shown,
    and no thread fails."""
    tests, record = fake_machine
    smi = next(p for p in os.environ["PATH"].split(os.pathsep) if os.path.exists(os.path.join(p, "nvidia-smi")))
    os.remove(os.path.join(smi, "nvidia-smi"))
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 0
    out, err = capsys.readouterr()
    assert "memcheck: 2 sanitized processes, 0 errors" in out and "peak" not in out
    assert "Exception in thread" not in err


@pytest.mark.parametrize("old", [False, True])
def test_the_queue_of_launches_is_bounded_where_the_sanitizer_can(fake_machine, monkeypatch, capsys, old):
    """Each process's sanitizer waits for a stream's launches every `SYNC_LIMIT`
    (`--force-synchronization-limit`, which lowers the tool's device memory), where its --help
    names the option; a sanitizer without it runs as before."""
    tests, _ = fake_machine
    if old:
        monkeypatch.setenv("OLD_SANITIZER", "1")
    assert sanitize.run("memcheck", ["-q", "-p", "no:cacheprovider", tests], jobs=2) == 0
    out = capsys.readouterr().out
    assert ("--force-synchronization-limit" in out) != old
    if not old:
        assert f"--force-synchronization-limit {sanitize.SYNC_LIMIT}" in out


def test_gpu_mib_sums_a_process_over_the_gpus_it_holds(monkeypatch):
    """What a sanitized test prints after it (tests/gpu/conftest.py): the process's MiB over
    every GPU nvidia-smi lists it on, None where it lists the process nowhere."""
    listing = "4242, 1000\n77, 5\n4242, 24\nnot a row\n"
    monkeypatch.setattr(sanitize, "_nvidia_smi", lambda *args: listing)
    assert sanitize.gpu_mib(4242) == 1024 and sanitize.gpu_mib(77) == 5 and sanitize.gpu_mib(1) is None


def test_the_stop_leaves_no_process_of_a_tree_that_keeps_forking(tmp_path):
    """The deadline's stop (`_kill_tree`) on a shell that forks children without pause: nothing
    under it runs on after the stop (listing the children and then killing them left the shell
    time to fork more, which outlived it)."""
    for trial in range(3):
        marks = tmp_path / str(trial)
        marks.mkdir()
        # each child leaves a mark once it has slept 0.2 s
        shell = subprocess.Popen(["sh", "-c", f"while :; do sh -c 'sleep 0.2; touch {marks}/$$' & sleep 0.001; done"])
        time.sleep(0.3)
        sanitize._kill_tree(shell.pid)
        shell.wait()
        stopped = time.time()
        time.sleep(0.5)  # an escaped child would leave its mark within 0.2 s
        assert not [m for m in marks.iterdir() if m.stat().st_mtime > stopped]
