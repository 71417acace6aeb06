"""Run untrusted Python (model-written programs and their tests) in a separate, confined process.

Every program runs under bubblewrap (bwrap), which gives it namespaces of its own:
- user: an unprivileged uid with no capabilities. When the caller is root (as in CI), bwrap itself is
  started as an unused uid first: root's processes are exempt from RLIMIT_NPROC and own the host's files.
- mount: a new root holding, read-only, only /usr (with the /bin, /lib* links or binds), two files of /etc
  and the interpreter's installation; a fresh /proc for its own processes and a minimal /dev; no /sys,
  /run, /var/run, home or project directory, so no filesystem socket is in reach. Writable are only /tmp
  (the working directory, HOME and TMPDIR, holding main.py; /var/tmp links to it) and /dev/shm: both
  size-limited tmpfs, gone with the namespace, so nothing a program writes survives it.
- network (nothing but a downed loopback; abstract Unix sockets are per namespace too), pid, ipc, uts,
  cgroup. The program's pid namespace dies with its init, which bwrap ties to the program and to its own
  parent: when the program exits, times out, or the caller dies, every process it started is killed.
Inside, a few lines of Python set the resource limits before the program starts (RLIMIT_NPROC must be set
inside the new user namespace to count only the run's processes): CPU seconds, address space (memory),
file size (which also caps stdout and stderr, files on the host), processes, no core dumps. stdin is
closed and the environment is empty apart from PATH, LANG, HOME, TMPDIR (and PWD, set by bwrap). Nothing
is ever exec()'d in the caller's process. A timeout, crash or limit hit is a failed result, never an
exception in the caller.

Whether bwrap works is probed once per process (`isolation()`). Where it does not (not installed, or user
namespaces disabled), run_code refuses with SandboxUnavailableError, unless the caller opts in to running
generated code unconfined: `run_code(..., allow_unsandboxed=True)`, the environment variable
DIVERSED_ALLOW_UNSANDBOXED=1, or `allow_unsandboxed()`, which sets it for this process and its children.
Unconfined runs keep the fresh directory, the empty environment and the limits except the process one,
and kill their process group afterwards; nothing else stands between the program and the machine.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

ALLOW_UNSANDBOXED_ENV = "DIVERSED_ALLOW_UNSANDBOXED"
_BWRAP = "bwrap"
_PATH = "/usr/local/bin:/usr/bin:/bin"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # faster library loading; the local time zone
_SCRATCH = "/tmp"  # inside the sandbox: the working directory, HOME and TMPDIR
_UID_BLOCK = range(61000, 64000)  # inside Debian's 60000-64999 block for on-demand system users: unused
_MAX_PROCESSES = 64
_MAX_FILE_BYTES = 16 * 1024**2
_TAIL_BYTES = 4000
# Sets the limits, then runs main.py (as a script, or as the module run_name). Limits set here bind the
# program (hard limits cannot be raised again without privileges) but not bwrap, and RLIMIT_NPROC counts only
# this user namespace.
_LAUNCHER = """\
import resource, runpy
for kind, limit in {limits!r}:
    resource.setrlimit(kind, (limit, limit))
runpy.run_path("main.py", run_name={run_name!r})
"""
# The self-check: a configuration must run Python and still let a program fork once.
_PROBE = "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\n"


class SandboxUnavailableError(RuntimeError):
    """bubblewrap cannot confine programs here, and running them unconfined was not allowed."""


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended: passed means exit status 0 within the time limit."""

    passed: bool
    returncode: int | None  # 128 + N when killed by signal N; None when it did not start or timed out
    timed_out: bool
    stdout: str  # the last few thousand characters
    stderr: str


@dataclass(frozen=True)
class Isolation:
    """The bubblewrap configuration run_code uses on this machine (see the module docstring)."""

    python: str  # the interpreter the program runs in
    python_roots: tuple[str, ...]  # its installation outside the system directories, bound read-only
    uid: int | None  # the unprivileged uid bwrap is started as when the caller is root


def run_code(code: str, *, timeout_s: float = 10, memory_mb: int = 1024, cpu_s: int | None = None,
             disk_mb: int = 64, allow_unsandboxed: bool | None = None, run_name: str = "__main__") -> SandboxResult:
    """Run a Python program in the sandbox and report how it ended.

    timeout_s: wall-clock limit; memory_mb: address-space limit; cpu_s: CPU-time limit (default: the
    wall-clock limit rounded up, plus one second, so a busy loop is caught by the wall clock first);
    disk_mb: size of each writable tmpfs (/tmp, /dev/shm). allow_unsandboxed: run the program unconfined
    where bubblewrap does not work, instead of raising SandboxUnavailableError (default: whether the
    environment variable DIVERSED_ALLOW_UNSANDBOXED is "1"). run_name: the program's __name__ (another
    name than "__main__" skips its `if __name__ == "__main__":` block, as test harnesses do).
    """
    if not run_name.isidentifier():
        raise ValueError(f"run_name must be a Python identifier, got {run_name!r}")
    limits = [(resource.RLIMIT_CPU, cpu_s or math.ceil(timeout_s) + 1),
              (resource.RLIMIT_AS, memory_mb * 1024**2), (resource.RLIMIT_FSIZE, _MAX_FILE_BYTES),
              (resource.RLIMIT_CORE, 0)]
    found = _probe()
    if isinstance(found, Isolation):
        return _run_confined(code, found, limits + [(resource.RLIMIT_NPROC, _MAX_PROCESSES)], disk_mb, timeout_s,
                             run_name)
    if allow_unsandboxed is None:
        allow_unsandboxed = os.environ.get(ALLOW_UNSANDBOXED_ENV) == "1"
    if not allow_unsandboxed:
        raise SandboxUnavailableError(
            f"refusing to run generated code without a sandbox: {found}. Install bubblewrap 0.8 or later (apt-get "
            f"install bubblewrap; it needs unprivileged user namespaces), or accept running the code unconfined, as "
            f"this user, with {ALLOW_UNSANDBOXED_ENV}=1 (or run_code(..., allow_unsandboxed=True)).")
    warnings.warn(f"running generated code WITHOUT a sandbox ({found})", RuntimeWarning, stacklevel=2)
    return _run_unconfined(code, limits, timeout_s, run_name)


def allow_unsandboxed() -> None:
    """Opt in to running generated code unconfined where bubblewrap does not work, in this process and the
    processes it starts (sets DIVERSED_ALLOW_UNSANDBOXED=1)."""
    os.environ[ALLOW_UNSANDBOXED_ENV] = "1"


def isolation() -> Isolation:
    """The bubblewrap configuration that works here (probed once, then cached); SandboxUnavailableError
    saying why when none does."""
    found = _probe()
    if isinstance(found, str):
        raise SandboxUnavailableError(found)
    return found


@functools.cache
def _probe() -> Isolation | str:
    """The first configuration that passes the self-check, or why none does."""
    if shutil.which(_BWRAP, path=_PATH) is None:
        return "bubblewrap (bwrap) is not installed"
    uid = _unused_uid() if os.geteuid() == 0 else None
    # The interpreter running us, without its venv (the programs need the standard library only); else,
    # when its installation is out of the sandbox uid's reach (a pyenv python under /root, say), the system one.
    candidates = [Isolation(sys._base_executable, _outside_system_dirs(sys.base_prefix, sys.base_exec_prefix), uid)]
    if system_python := shutil.which("python3", path=_PATH):
        candidates.append(Isolation(system_python, (), uid))
    for candidate in candidates:
        result = _run_confined(_PROBE, candidate, [], disk_mb=1, timeout_s=30)
        if result.passed:
            return candidate
    return f"bubblewrap failed its self-check ({result.stderr.strip() or f'exit status {result.returncode}'})"


def _outside_system_dirs(*paths: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p for p in paths if not any(Path(p).is_relative_to(d) for d in _SYSTEM_DIRS)))


def _unused_uid() -> int:
    taken = {user.pw_uid for user in pwd.getpwall()}
    return next(uid for uid in _UID_BLOCK if uid not in taken)


def _run_confined(code: str, iso: Isolation, limits: list[tuple[int, int]], disk_mb: int, timeout_s: float,
                  run_name: str = "__main__") -> SandboxResult:
    program = os.memfd_create("main.py")
    try:
        os.write(program, code.encode())
        os.lseek(program, 0, os.SEEK_SET)
        args = [_BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                "--hostname", "sandbox"]
        for path in _SYSTEM_DIRS:  # merged-/usr systems have links here, others directories
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        for path in _ETC_FILES:
            args += ["--ro-bind-try", path, path]
        for path in iso.python_roots:
            args += ["--ro-bind", path, path]
        size = str(disk_mb * 1024**2)
        args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
                 "--size", size, "--tmpfs", _SCRATCH, "--symlink", "../tmp", "/var/tmp",
                 "--file", str(program), f"{_SCRATCH}/main.py", "--chdir", _SCRATCH,
                 "--remount-ro", "/",  # the new root itself: a tmpfs without a size limit
                 "--", iso.python, "-I", "-c", _LAUNCHER.format(limits=limits, run_name=run_name)]
        switch_user = {} if iso.uid is None else {"user": iso.uid, "group": iso.uid, "extra_groups": []}
        return _execute(args, _SCRATCH, timeout_s, pass_fds=(program,), **switch_user)
    finally:
        os.close(program)


def _run_unconfined(code: str, limits: list[tuple[int, int]], timeout_s: float, run_name: str) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="diversed-sandbox-", ignore_cleanup_errors=True) as workdir:
        Path(workdir, "main.py").write_text(code)
        return _execute([sys.executable, "-I", "-c", _LAUNCHER.format(limits=limits, run_name=run_name)], workdir,
                        timeout_s, cwd=workdir)


def _execute(args: list[str], home: str, timeout_s: float, **popen) -> SandboxResult:
    """Run args in a session of their own to completion or the time limit, then kill what is left of it."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env={"PATH": _PATH, "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home},
                                    start_new_session=True, **popen)
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult(False, None, False, "", f"the sandbox could not start the program: {e}")
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Under bwrap the group is bwrap alone, and its sandbox dies with it (--die-with-parent).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        code = None if timed_out else proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return SandboxResult(code == 0, code, timed_out, _tail(out), _tail(err))


def _tail(file) -> str:
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - _TAIL_BYTES))
    return file.read().decode(errors="replace")
