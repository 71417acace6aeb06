"""Run untrusted Python (model-written programs and their tests) in a separate, confined process.

Every program runs as `python -I main.py` in a fresh temporary directory (removed afterwards), with an
empty environment apart from PATH, LANG, HOME and TMPDIR (both that directory), stdin closed, its own
session and process group, and resource limits: CPU seconds, address space (memory), file size, no core
dumps. Nothing is ever exec()'d in the caller's process. A timeout, crash or limit hit is a failed
result, never an exception in the caller; the process group is SIGKILLed on timeout and after every run.

The rest depends on the machine. `isolation()` probes once per process and says what applies:
- own_uid (only when the caller is root, as in CI): each run gets a fresh uid from a block with no
  accounts, so the program cannot read the caller's private files, RLIMIT_NPROC (which does not bind
  root) applies, and after the run every process of that uid is killed, including any that left the
  process group. When the interpreter running us (sys.executable) is unreadable to other users (a venv on
  a pyenv python under /root, say), the sandbox runs the system python3 instead: standard library only,
  which is all the benchmarks' tests need.
- netns: a new, empty network namespace (as root; otherwise inside a new user namespace, where the kernel
  allows it): nothing but a downed loopback, so no connection is possible. Where that is refused, a
  prelude prepended to the program replaces socket creation with an error (best effort only).
- process_limit: RLIMIT_NPROC (64 processes and threads) stops fork bombs. It counts all processes of
  the run's user, so it is set only where that user is the run's alone: its own uid, or a fresh user
  namespace (Linux 5.14+ counts per namespace; the probe checks that forking still works). Without it a
  fork bomb runs until the time limit kills its process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import pwd
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_PATH = "/usr/local/bin:/usr/bin:/bin"
_UID_BLOCK = range(61000, 64000)  # inside Debian's 60000-64999 block for on-demand system users: unused
_MAX_PROCESSES = 64
_MAX_FILE_BYTES = 64 * 1024**2
_TAIL_BYTES = 4000
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)  # resolved here: the child after fork should not load libraries
_NO_NETWORK_PRELUDE = """\
import socket as _sandbox_socket, _socket
def _sandbox_no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_sandbox_socket.socket = _sandbox_socket.create_connection = _socket.socket = _sandbox_no_network
del _sandbox_socket, _socket, _sandbox_no_network
"""
# The probe: a configuration must run Python and still let a program fork once.
_PROBE = "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\n"
# Run as the run's uid: kill every other process of that uid. kill(-1) reaches exactly the processes this
# uid may signal and fails with ESRCH once none is left. Bounded, in case a zombie lingers unreaped.
_KILL_ALL = """\
import os, signal
for _ in range(1000):
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        break
"""

_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended: passed means exit status 0 within the time limit."""

    passed: bool
    returncode: int | None  # None when the process could not start; negative: killed by that signal
    timed_out: bool
    stdout: str  # the last few thousand characters
    stderr: str


@dataclass(frozen=True)
class Isolation:
    """The confinement run_code uses on this machine (see the module docstring)."""

    python: str  # the interpreter the program runs in
    own_uid: bool  # each run as a fresh unprivileged uid
    netns: bool  # a new network namespace; else the socket-disabling prelude
    process_limit: bool  # RLIMIT_NPROC set


def run_code(code: str, *, timeout_s: float = 10, memory_mb: int = 1024, cpu_s: int | None = None
             ) -> SandboxResult:
    """Run a Python program in the sandbox and report how it ended.

    timeout_s: wall-clock limit; memory_mb: address-space limit; cpu_s: CPU-time limit (default: the
    wall-clock limit rounded up, plus one second, so a busy loop is caught by the wall clock first).
    """
    return _run(code, isolation(), timeout_s, memory_mb, cpu_s or math.ceil(timeout_s) + 1)


@functools.cache
def isolation() -> Isolation:
    """The strongest confinement that works here (probed once, then cached)."""
    for candidate in _candidates():
        result = _run(_PROBE, candidate, timeout_s=30, memory_mb=1024, cpu_s=30)
        if result.passed:
            return candidate
    raise RuntimeError(f"the sandbox cannot run Python on this machine: {result.stderr}")


def _candidates() -> Iterator[Isolation]:
    """Strongest first."""
    if os.geteuid() == 0:
        system_python = shutil.which("python3", path=_PATH)
        for python in dict.fromkeys(p for p in (sys.executable, system_python) if p):
            yield Isolation(python, own_uid=True, netns=True, process_limit=True)
            yield Isolation(python, own_uid=True, netns=False, process_limit=True)
    else:  # only a user namespace (part of netns here) gives the run a process count of its own
        yield Isolation(sys.executable, own_uid=False, netns=True, process_limit=True)
    yield Isolation(sys.executable, own_uid=False, netns=True, process_limit=False)
    yield Isolation(sys.executable, own_uid=False, netns=False, process_limit=False)


def _run(code: str, iso: Isolation, timeout_s: float, memory_mb: int, cpu_s: int) -> SandboxResult:
    if not iso.netns:
        code = _NO_NETWORK_PRELUDE + code
    with tempfile.TemporaryDirectory(prefix="diversed-sandbox-", ignore_cleanup_errors=True) as workdir, \
            _run_uid(iso) as uid, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        Path(workdir, "main.py").write_text(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
        limits = [(resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_mb * 1024**2),
                  (resource.RLIMIT_FSIZE, _MAX_FILE_BYTES), (resource.RLIMIT_CORE, 0)]
        try:
            proc = subprocess.Popen(
                [iso.python, "-I", "main.py"], cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                env={"PATH": _PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir},
                start_new_session=True,
                preexec_fn=functools.partial(_confine, iso, limits, uid))
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, None, False, "", f"the sandbox could not start the program: {e}")
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _end(proc, iso.python, uid)
        return SandboxResult(proc.returncode == 0 and not timed_out, proc.returncode, timed_out,
                             _tail(out), _tail(err))


def _confine(iso: Isolation, limits: list[tuple[int, int]], uid: int | None) -> None:
    """In the child between fork and exec: limits, namespaces (needs root or a user namespace), the process
    limit (after them: a user namespace created under it would inherit it as a cap on the whole user), and
    last the drop to uid."""
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    if iso.netns:
        flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
        if _LIBC.unshare(flags) != 0:
            raise OSError(ctypes.get_errno(), "unshare failed")
    if iso.process_limit:
        resource.setrlimit(resource.RLIMIT_NPROC, (_MAX_PROCESSES, _MAX_PROCESSES))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _end(proc: subprocess.Popen, python: str, uid: int | None) -> None:
    """Kill the program's process group (on timeout the program itself; after a normal exit whatever it
    left running there), reap it, then kill every process of its uid, group or no group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if uid is not None:
        quiet = subprocess.DEVNULL
        subprocess.run([python, "-I", "-S", "-c", _KILL_ALL], user=uid, group=uid, extra_groups=[], env={},
                       cwd="/", stdin=quiet, stdout=quiet, stderr=quiet, check=False)


@contextlib.contextmanager
def _run_uid(iso: Isolation) -> Iterator[int | None]:
    """A uid that no other run in this process is using, or None without own_uid."""
    if not iso.own_uid:
        yield None
        return
    with _uids_lock:
        uid = random.choice([u for u in _free_uids() if u not in _uids_in_use])
        _uids_in_use.add(uid)
    try:
        yield uid
    finally:
        with _uids_lock:
            _uids_in_use.discard(uid)


@functools.cache
def _free_uids() -> list[int]:
    taken = {user.pw_uid for user in pwd.getpwall()}
    return [uid for uid in _UID_BLOCK if uid not in taken]


def _tail(file) -> str:
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - _TAIL_BYTES))
    return file.read().decode(errors="replace")
