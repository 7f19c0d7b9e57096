"""The GPU suite under compute-sanitizer: `python -m cute_flash memcheck|racecheck [--jobs N]
[--chunk N] [--only i,j] [--retry-aborted] [--deadline S] [pytest args]`.

memcheck finds out-of-bounds and misaligned accesses (torch's caching allocator is off, so
each tensor is its own allocation and a read just past it is caught; host API errors are not
counted: the DSL and the cluster-occupancy query probe the driver on purpose). racecheck finds
shared-memory hazards between threads of a CTA (RAW, WAR, WAW) that neither memcheck nor a
gradient check can see. Both instrument our kernels alone, and each first runs a canary, a
kernel of ours with findings on purpose, to show that its filter reaches them. A kernel change
that moves memory accesses or synchronization is done when both report nothing
(docs/architecture.md, "Sanitizers").

`jobs` > 1 collects the tests and deals them round-robin to that many sanitized pytest
processes, spread over the visible GPUs (run it from the repository root: the collected ids are
relative to it); `chunk` gives each process that many consecutive tests instead, `jobs` at a
time (`Plan`). A process starts only when its GPU has `MIN_FREE_MIB` free (or none of ours
running); tests marked `sanitizer_slow` start first, one process each, and tests marked
`whole_gpu` run after the others, one process at a time. `deadline` S: after S seconds no
process starts and the running ones are stopped, and the command names the processes left
for `--only` to finish (a whole-suite run in calls of a fixed length). Never pytest-xdist's
`-n`: with 15 xdist workers under one sanitizer no test finished in 570 s on the H200 machine,
while one process ran 17 tests in 160 s (compiles dominate, so separate processes scale with
the cores).
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

from cute_flash.reference import ROUNDED_FP32_GEMMS


@dataclass(frozen=True)
class Tool:
    """One compute-sanitizer tool: its options and the summary line each process prints."""
    name: str
    options: tuple
    summary: str  # a regex whose group 1 is the process's count of findings
    noun: str  # what it finds
    canary: str | None = None  # a kernel of tools/canaries.py whose run must report findings: the tool sees ours
    env: tuple = ()  # (name, value) pairs its processes need
    leaves_out: str | None = None  # a pytest mark whose tests this tool cannot run

    @property
    def marks(self) -> str:
        """The pytest mark expression of the tests it runs."""
        return f"gpu and not {self.leaves_out}" if self.leaves_out else "gpu"

    def command(self, sanitizer: str, shard: list) -> list:
        return self._under(sanitizer, ["pytest", "-m", self.marks, *shard])

    def canary_command(self, sanitizer: str) -> list:
        return self._under(sanitizer, ["cute_flash.tools.canaries", self.canary])

    def _under(self, sanitizer: str, module_args: list) -> list:
        return [sanitizer, "--tool", self.name, *self.options, "--error-exitcode", "86",
                sys.executable, "-m", *module_args]


OUR_KERNELS = "kernel_cutlass_"  # the prefix of every kernel the DSL compiles
# The sanitizer's own failure, which its summary then counts as one finding; the process's CUDA
# context is lost, so its later tests fail (docs/tuning/gpu-suite.md, "fifth session")
ABORT = "Internal Sanitizer Error"
# The mark of tests that need most of the GPU's memory (tensors past 2^31 elements): they run after
# the others, one sanitized process at a time, where the others' memory would run them out of it
ALONE = "whole_gpu"
# The mark of tests that take minutes under a sanitizer (65537-CTA grids, the Hopper KV-cache
# entry's paged tests): each in a process of its own, started first, so that none is left at the end
# of a chunk when the time limit comes (docs/tuning/gpu-suite.md, "eighth session")
FIRST = "sanitizer_slow"
MARKS_FILE = "CUTE_FLASH_SANITIZE_MARKS"  # where `pytest_collection_finish` lists the tests and their marks
# A sanitized process starts only where its GPU has this much memory free (or runs none of ours):
# one process peaked near 20 GB, and 4 memcheck or 14 racecheck processes filled an 80 GB H100,
# failing tests out of memory (docs/tuning/gpu-suite.md, "eighth session")
MIN_FREE_MIB = 20 * 1024
# Where a test's traceback ends in torch's CUDA error (pytest's long format: the frame's line
# marked ">", then "path:line: AcceleratorError"). Under CUDA_LAUNCH_BLOCKING=1 a launch returns
# when its kernel has run, so that call launched the faulting kernel, or follows a library call
# (cuBLAS) that launched it without checking for errors
CUDA_ERROR_AT = re.compile(r"^(\S+\.py:\d+): (?:torch\.)?AcceleratorError$")

# Launches a stream may queue under the tool before it waits for them (its
# `--force-synchronization-limit`; unbounded by default): its help says a lower limit lowers the
# tool's device memory, and torch launches asynchronously. One sanitized process peaked near 20 GB
# (docs/tuning/gpu-suite.md, "Eighth session")
SYNC_LIMIT = 4

TOOLS = {
    # torch's caching allocator off: each tensor its own allocation, so a write just past one is caught.
    # Our kernels alone: torch's SDPA FLASH kernel, run by the tests' references, writes 4 bytes past an
    # allocation and the process aborts (docs/tuning/gpu-suite.md, "Seventeenth session")
    "memcheck": Tool("memcheck", ("--report-api-errors", "no", "--kernel-name", f"kns={OUR_KERNELS}"),
                     r"ERROR SUMMARY: (\d+) error", "errors", canary="overrun",
                     env=(("PYTORCH_NO_CUDA_MEMORY_CACHING", "1"),)),
    # `analysis`: one line per pair of racing instructions (kernel + offset), hazards counted beside it.
    # Our kernels alone: with every kernel instrumented (the tests' torch references too) no test of the
    # Hopper backward's file finished in 230 s (docs/tuning/gpu-suite.md). Even so a process aborts at
    # torch's first fp16/bf16 GEMM (cuBLAS, no kernel of ours running: "seventh session"), so the
    # reference runs its input-dtype GEMMs in float32, and tests with a bf16 model are left out
    "racecheck": Tool("racecheck", ("--racecheck-report", "analysis", "--kernel-name", f"kns={OUR_KERNELS}"),
                      r"RACECHECK SUMMARY: (\d+) hazard", "hazards", canary="race",
                      env=((ROUNDED_FP32_GEMMS, "1"),), leaves_out="lowp_gemm"),
}


def sanitizer_path() -> str:
    return shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"


def bounded(tool: Tool, sanitizer: str) -> Tool:
    """`tool` with `--force-synchronization-limit SYNC_LIMIT` where the installed sanitizer takes
    the option (its --help names it, on either stream), else as it is."""
    try:
        listed = subprocess.run([sanitizer, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return tool
    if "--force-synchronization-limit" not in listed.stdout + listed.stderr:
        return tool
    return replace(tool, options=(*tool.options, "--force-synchronization-limit", str(SYNC_LIMIT)))


@dataclass(frozen=True)
class Plan:
    """How the collected tests are split: `jobs` processes at a time; `chunk` tests per process in
    collected order (default: the tests dealt round-robin to `jobs` processes); `only` the shard
    numbers to run (default all), to finish a run that a time limit cut short."""
    jobs: int = 1
    chunk: int | None = None
    only: tuple | None = None

    def shards(self, ids: list, options: list) -> list:
        if self.chunk:
            return [options + ids[i:i + self.chunk] for i in range(0, len(ids), self.chunk)]
        return [options + ids[i::self.jobs] for i in range(min(self.jobs, len(ids)))]


def run(tool_name: str, pytest_args: list, jobs: int = 1, chunk: int | None = None, only=None,
        retry_aborted: bool = False, deadline: float | None = None) -> int:
    """The GPU tests (default: all of `tests`) under `tool_name`; prints every process's output,
    a line per finished process and the sum of their findings. Fails on any finding, a failed
    test or a process with no summary (a sanitizer that did not run), and, for a tool with a
    canary, on a canary it reports nothing for. `retry_aborted`: the tests of each process the
    sanitizer aborted (whose later tests then failed for want of a CUDA context) run again, one
    process each and with launches blocking, and stand for that process; for each that aborts
    again it names the first call to see the fault (`CUDA_ERROR_AT`). `deadline`: seconds from
    now after which no process starts and running ones are stopped; those left are named for
    `--only`, and the command fails (a run cut short is not clean)."""
    stop_at = None if deadline is None else time.monotonic() + deadline
    sanitizer, plan = sanitizer_path(), Plan(jobs, chunk, tuple(only) if only else None)
    tool = bounded(TOOLS[tool_name], sanitizer)
    # CUTE_FLASH_MEMCHECK=1 tells the tests they are sanitized (hypothesis draws fewer shapes)
    env = dict(os.environ, CUTE_FLASH_MEMCHECK="1", **dict(tool.env))
    if tool.canary and not _canary_sings(tool, sanitizer, env):
        return 1
    pytest_args = pytest_args or ["tests"]
    shards = [pytest_args]
    shared = 1
    if jobs > 1 or chunk or retry_aborted:
        options = [a for a in pytest_args if not os.path.exists(a.split("::")[0])]
        quiet = [a for a in pytest_args if a not in ("-q", "-v")]  # ids one per line needs exactly one -q
        gpu = {t: marks for t, marks in _collect(quiet, env).items() if "gpu" in marks}
        runs = {t: marks for t, marks in gpu.items() if tool.leaves_out not in marks}  # what `tool.marks` selects
        slow = [t for t, marks in runs.items() if FIRST in marks and ALONE not in marks]
        alone = [t for t, marks in runs.items() if ALONE in marks]
        ids = [t for t, marks in runs.items() if FIRST not in marks and ALONE not in marks]
        if tool.leaves_out:
            print(f"{tool.name}: leaves out {len(gpu) - len(runs)} tests marked {tool.leaves_out}, which it cannot run",
                  flush=True)
        shards = [options + [t] for t in slow] + plan.shards(ids, options)
        shared = len(shards)
        shards += [options + [t] for t in alone]
        at_a_time = f", {jobs} at a time" if shared > jobs else ""
        before = f" ({len(slow)} marked {FIRST} first, one process each)" if slow else ""
        after = f"; then {len(alone)} marked {ALONE}, one process each, alone" if alone else ""
        print(f"{tool.name}: {len(ids) + len(slow)} tests in {shared} sanitized processes{before}{at_a_time}{after}",
              flush=True)
    picked = [i for i in range(len(shards)) if plan.only is None or i in plan.only]
    gpus = _visible_gpus() if len(shards) > 1 else None  # one process: the caller's environment as it is
    first = _pool(tool, sanitizer, env, shards, [i for i in picked if i < shared], jobs, gpus, "", stop_at)
    first.add(_pool(tool, sanitizer, env, shards, [i for i in picked if i >= shared], 1, gpus, "", stop_at))
    print(first.line(tool, picked), flush=True)
    left = [i for i in picked if i not in first.codes or i in first.stopped]
    if stop_at is not None and left:
        print(f"{tool.name}: the deadline ({deadline:g} s) left {len(left)} processes unfinished; to finish: the same "
              f"command with --only {','.join(str(i) for i in left)}", flush=True)
        return 1
    if not (retry_aborted and first.aborts):
        return 0 if first.clean(picked) else 1
    kept = [i for i in picked if i not in first.aborts]
    again = [[a for a in shards[i] if "::" not in a] + [t] for i in sorted(first.aborts)
             for t in shards[i] if "::" in t]
    print(f"{tool.name}: the {len(again)} tests of the {len(first.aborts)} aborted processes again, one process "
          f"each", flush=True)
    blocking = dict(env, CUDA_LAUNCH_BLOCKING="1")  # the fault seen at (or just after) its launch
    retried = _pool(tool, sanitizer, blocking, again, list(range(len(again))), jobs, gpus, "r", stop_at)
    print(retried.line(tool, list(range(len(again)))), flush=True)
    for i in sorted(retried.aborts):
        where = retried.faults.get(i, "no CUDA error in its traceback")
        print(f"{tool.name}: aborted again alone: {again[i][-1]}; first seen at {where}", flush=True)
    return 0 if first.clean(kept) and retried.clean(range(len(again))) else 1


@dataclass
class PoolResult:
    """What a pool of sanitized processes printed: each one's summed findings, its exit code,
    those the sanitizer aborted, and where each one's first CUDA error was raised ("path:line:
    source"); the most GPU memory (MiB) nvidia-smi listed for each one's processes; and those
    the deadline stopped."""
    summaries: dict
    codes: dict
    aborts: set
    faults: dict
    peaks: dict = field(default_factory=dict)
    stopped: set = field(default_factory=set)

    def add(self, other: "PoolResult") -> None:
        """Take in another pool's processes (of other shard indices)."""
        self.summaries.update(other.summaries)
        self.codes.update(other.codes)
        self.aborts |= other.aborts
        self.faults.update(other.faults)
        self.peaks.update(other.peaks)
        self.stopped |= other.stopped

    def clean(self, picked) -> bool:
        """Every one of `picked` ran to its summary: no finding, no failed test, no abort."""
        return all(self.summaries.get(i) == 0 and self.codes.get(i) == 0 and i not in self.aborts for i in picked)

    def line(self, tool: Tool, picked) -> str:
        aborted = f", {len(self.aborts)} of them aborted by the sanitizer" if self.aborts else ""
        found = sum(self.summaries.values())
        return (f"{tool.name}: {len(self.summaries)} sanitized processes{aborted}, {found} {tool.noun}; "
                f"pytest/sanitizer exits {[self.codes.get(i) for i in picked]}")


def _pool(tool: Tool, sanitizer: str, env: dict, shards: list, picked: list, jobs: int, gpus, label: str,
          stop_at: float | None = None):
    """`shards[i]` for i in `picked` under the tool, `jobs` processes at a time, spread over
    `gpus` (None: the caller's environment); each process's output tagged [label i]. At
    `stop_at` (time.monotonic()) none starts and the running ones are stopped, process tree and
    all (`PoolResult.stopped`)."""
    result, lock = PoolResult({}, {}, set(), {}), threading.Lock()
    todo = list(reversed(picked))

    def late() -> bool:
        return stop_at is not None and time.monotonic() >= stop_at

    def sanitized(i):
        shard = shards[i]
        cmd = tool.command(sanitizer, shard)
        shard_env = dict(env, CUDA_VISIBLE_DEVICES=gpus[i % len(gpus)]) if gpus else env
        tag = f"[{label}{i}] " if len(shards) > 1 or label else ""
        with lock:
            print(tag + " ".join(cmd[:len(cmd) - len(shard)]) + f" ... ({len(shard)} arguments)", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=shard_env)
        with lock:
            roots[proc.pid] = i
        source = ""  # the last traceback line marked ">" (the raising call's source)
        for line in proc.stdout:
            with lock:
                print(tag + line, end="", flush=True)
                found = re.search(tool.summary, line)
                if found:
                    result.summaries[i] = result.summaries.get(i, 0) + int(found.group(1))
                if ABORT in line:
                    result.aborts.add(i)
                if line.startswith(">"):
                    source = line[1:].strip()
                error_at = CUDA_ERROR_AT.match(line.strip())
                if error_at and i not in result.faults:
                    result.faults[i] = f"{error_at.group(1)}: {source}"
        result.codes[i] = proc.wait()
        with lock:
            del roots[proc.pid]
            if i in result.stopped:
                print(f"{tag}stopped at the deadline, exit {result.codes[i]}", flush=True)
                return
            aborted = " (the sanitizer aborted: its count is that abort)" if i in result.aborts else ""
            peak = f", GPU memory peak {result.peaks[i]} MiB" if i in result.peaks else ""
            print(f"{tag}done: {result.summaries.get(i, 'no summary')} {tool.noun}{aborted}, exit {result.codes[i]}"
                  f"{peak}", flush=True)

    running = collections.Counter()  # sanitized processes in flight, by GPU
    roots = {}  # the pid of each running process's sanitizer -> its shard
    finished = threading.Event()

    def sample():
        """Every few seconds, each running shard's GPU memory (its processes' as nvidia-smi lists
        them), kept at its most."""
        while not finished.wait(3):
            with lock:
                now = dict(roots)
            for shard, mib in memory_by_root(_compute_apps(), _parent_pid, now).items():
                with lock:
                    result.peaks[shard] = max(result.peaks.get(shard, 0), mib)

    def stop():
        """At the deadline, stop every running process (its sanitizer and what runs under it)."""
        if stop_at is None or finished.wait(max(stop_at - time.monotonic(), 0)):
            return
        with lock:
            for pid, i in roots.items():
                result.stopped.add(i)
                _kill_tree(pid)

    def slot():
        while True:
            with lock:
                if not todo or late():
                    return
                i = todo.pop()
            gpu = gpus[i % len(gpus)] if gpus else None
            while True:  # wait for memory, unless this GPU runs none of ours (then nothing would free it)
                with lock:
                    if late():
                        return
                    free = _free_mib(gpu) if running[gpu] else None
                    if free is None or free >= MIN_FREE_MIB:
                        running[gpu] += 1
                        break
                time.sleep(2)
            try:
                sanitized(i)
            finally:
                with lock:
                    running[gpu] -= 1

    threads = [threading.Thread(target=slot) for _ in range(min(jobs, len(picked)) or 1)]
    watchers = [threading.Thread(target=sample), threading.Thread(target=stop)]
    for t in threads + watchers:
        t.start()
    for t in threads:
        t.join()
    finished.set()
    for t in watchers:
        t.join()
    return result


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it (found through /proc; `pid` alone where there
    is no /proc): the sanitizer's target would outlive it otherwise. Each is stopped first, the
    root before its children are listed and until no new one appears, so that none forks a
    process after the listing (a fake sanitizer's shell, its sleep killed, ran its tests)."""
    tree, new = set(), {pid}
    while new:
        _signal(new, signal.SIGSTOP)
        tree |= new
        new = _under(pid) - tree
    _signal(tree, signal.SIGKILL)


def _under(pid: int) -> set:
    """The processes under `pid` (through /proc; none where there is no /proc)."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return set()
    return {p for p in pids if p != pid and _root_of(p, _parent_pid, {pid}) == pid}


def _signal(pids, sig) -> None:
    """`sig` to each of `pids`, skipping any already gone."""
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def memory_by_root(apps: list, parent, roots: dict) -> dict:
    """{shard: MiB} from `apps` [(pid, MiB)]: each app's memory counts for the shard whose
    sanitizer (`roots`: {pid: shard}) it runs under, found by `parent` (pid -> its parent's
    pid, or None) from the app up; apps under no root count for none."""
    out = {}
    for pid, mib in apps:
        root = _root_of(pid, parent, roots)
        if root is not None:
            out[roots[root]] = out.get(roots[root], 0) + mib
    return out


def _root_of(pid, parent, roots):
    """The first of `roots` (pids) met walking up from `pid` through `parent` (pid -> its
    parent's pid, or None), `pid` itself included; None if none is."""
    for _ in range(64):  # a bound on the walk up
        if pid is None or pid in roots:
            break
        pid = parent(pid)
    return pid if pid in roots else None


def _nvidia_smi(*args) -> str:
    """nvidia-smi's output for `args`, "" where there is no nvidia-smi to run."""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True).stdout
    except OSError:
        return ""


def _compute_apps() -> list:
    """[(pid, MiB)] of the processes nvidia-smi lists on the GPUs (none where it lists nothing)."""
    apps = []
    for line in _nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits").splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
        except ValueError:
            continue
        apps.append((pid, mib))
    return apps


def gpu_mib(pid: int) -> int | None:
    """The GPU memory nvidia-smi lists for process `pid` (MiB, summed over GPUs), None where it
    lists none: the sanitized tests print theirs after each test (tests/gpu/conftest.py)."""
    used = [mib for p, mib in _compute_apps() if p == pid]
    return sum(used) if used else None


def _parent_pid(pid: int) -> int | None:
    """The parent of `pid` (from /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _collect(pytest_args: list, env: dict) -> dict:
    """{test id: its marks (a frozenset of names)} of the tests among `pytest_args` (one -q at
    most in them), in collected order: one collection, with this module as its plugin
    (`pytest_collection_finish`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where cute_flash is
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "marks")
        run_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, (root, env.get("PYTHONPATH")))),
                       **{MARKS_FILE: path})
        listed = subprocess.run([sys.executable, "-m", "pytest", "-p", __name__, "--collect-only", "-q", *pytest_args],
                                capture_output=True, text=True, env=run_env)
        lines = open(path).read().splitlines() if os.path.exists(path) else []
    if not lines:
        print(listed.stdout[-4000:] + listed.stderr[-4000:])
    return {test: frozenset(marks.split(",")) for test, _, marks in (line.rpartition(" ") for line in lines)}


def pytest_collection_finish(session):
    """This module as `_collect`'s pytest plugin: each collected test's id and marks, a line
    each, into the file MARKS_FILE names (nothing where it is unset)."""
    path = os.environ.get(MARKS_FILE)
    if path:
        with open(path, "w") as f:
            for item in session.items:
                f.write(f"{item.nodeid} {','.join(sorted({m.name for m in item.iter_markers()}))}\n")


def _canary_sings(tool: Tool, sanitizer: str, env: dict) -> bool:
    """Run the tool's canary, a kernel with findings on purpose: True when the tool reports them."""
    done = subprocess.run(tool.canary_command(sanitizer), capture_output=True, text=True, env=env)
    found = re.search(tool.summary, done.stdout)
    count = int(found.group(1)) if found else 0
    print(f"{tool.name} canary ({tool.canary}, {tool.noun} on purpose): {count} reported", flush=True)
    if not count:
        print(done.stdout[-4000:] + done.stderr[-4000:])
        print(f"{tool.name}: the canary reported nothing, so the tool does not see our kernels; no test was run")
    return count > 0


def _free_mib(gpu) -> int | None:
    """The free memory of `gpu` (None: the first visible one) in MiB, as nvidia-smi reports it;
    None where it reports no number (then nothing waits for memory)."""
    try:
        return int(_nvidia_smi("--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", gpu or "0").split()[0])
    except (IndexError, ValueError):
        return None


def _visible_gpus():
    """The GPU ids to spread sanitized processes over: CUDA_VISIBLE_DEVICES, else every GPU
    nvidia-smi lists (without initialising CUDA in this process)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")
    return _nvidia_smi("--query-gpu=index", "--format=csv,noheader").split() or ["0"]
