"""The sandbox for generated code: results and limits, every way out of it probed from inside, and the
refusal to run code unconfined unless asked to."""

import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from diversed.tasks import sandbox
from diversed.tasks.sandbox import (
    ALLOW_UNSANDBOXED_ENV,
    SandboxUnavailableError,
    allow_unsandboxed,
    isolation,
    run_code,
)

PROJECT = Path(__file__).resolve().parents[1]
# A program prelude: attempt(name, action) prints "name open" when the action works, "name closed" when it
# raises OSError (socket errors, timeouts and DNS failures included).
ATTEMPT = """\
import os, socket
def attempt(name, action):
    try:
        action()
    except OSError:
        print(name, "closed")
    else:
        print(name, "open")
"""


def _attempts(result) -> dict[str, str]:
    """name -> "open" or "closed" from a program built on ATTEMPT."""
    assert result.passed, result.stderr
    return dict(line.split() for line in result.stdout.splitlines())


def _processes_with(marker: str) -> list[int]:
    """Live host processes whose command line holds marker (zombies have none)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _wait_until_gone(marker: str, deadline_s: float = 2.0) -> list[int]:
    """SIGKILL is asynchronous: give killed processes a moment to go."""
    end = time.monotonic() + deadline_s
    while (alive := _processes_with(marker)) and time.monotonic() < end:
        time.sleep(0.05)
    return alive


def _unix_server(parent: str) -> socket.socket:
    """A listening Unix socket in a fresh directory under parent that any user may reach: only the sandbox's
    mount namespace stands in the way."""
    directory = tempfile.mkdtemp(prefix="diversed-test-", dir=parent)
    os.chmod(directory, 0o755)
    server = socket.socket(socket.AF_UNIX)
    server.bind(os.path.join(directory, "socket"))
    os.chmod(server.getsockname(), 0o777)
    server.listen()
    server.settimeout(0)
    return server


# --- results and limits


@pytest.mark.parametrize("code, returncode, output", [
    ("print('ok')", 0, "ok\n"), ("assert 1 == 2", 1, "AssertionError"), ("def f(:\n", 1, "SyntaxError")])
def test_results(code, returncode, output):
    result = run_code(code, timeout_s=3)
    assert result.passed == (returncode == 0) and result.returncode == returncode and not result.timed_out
    assert output in result.stdout + result.stderr


def test_infinite_loop_is_killed_at_the_time_limit():
    start = time.monotonic()
    result = run_code("while True:\n    pass", timeout_s=1)
    assert result.timed_out and not result.passed and result.returncode is None
    assert time.monotonic() - start < 3


def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock():
    result = run_code("while True:\n    pass", timeout_s=20, cpu_s=1)
    assert not result.passed and not result.timed_out
    assert result.returncode in (128 + signal.SIGXCPU, 128 + signal.SIGKILL)


def test_huge_allocation_fails_inside_the_memory_limit():
    result = run_code("x = bytearray(10 * 1024**3)", timeout_s=3, memory_mb=512)
    assert not result.passed and not result.timed_out
    assert "MemoryError" in result.stderr


def test_scratch_space_is_bounded():
    code = ATTEMPT + ("for where in ('.', '/tmp', '/var/tmp', '/dev/shm'):\n"
                      "    attempt(where, lambda: open(f'{where}/big', 'wb').write(bytes(8 * 1024**2)))\n")
    assert _attempts(run_code(code, timeout_s=3, disk_mb=4)) == dict.fromkeys(
        (".", "/tmp", "/var/tmp", "/dev/shm"), "closed")  # full at 4 MiB


def test_huge_output_is_cut_off():
    start = time.monotonic()
    result = run_code("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout_s=5)
    assert not result.passed and not result.timed_out and "File too large" in result.stderr  # RLIMIT_FSIZE
    assert len(result.stdout) <= 4000 and time.monotonic() - start < 4


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("DIVERSED_TEST_SECRET", "hunter2")
    result = run_code("import os\nprint(' '.join(sorted(os.environ)))\nprint(os.environ)", timeout_s=3)
    assert result.passed
    assert "hunter2" not in result.stdout
    assert set(result.stdout.splitlines()[0].split()) <= {"PATH", "LANG", "HOME", "TMPDIR", "PWD"}  # PWD: bwrap's


# --- ways out


def test_network_is_closed():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_UNIX) as abstract:
        abstract.bind(f"\0diversed-test-{uuid.uuid4().hex}")
        abstract.listen()
        code = ATTEMPT + (
            f"attempt('tcp-loopback', lambda: socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 2))\n"
            "attempt('tcp-outside', lambda: socket.create_connection(('1.1.1.1', 53), 2))\n"
            "attempt('dns', lambda: socket.getaddrinfo('example.com', 80))\n"
            f"attempt('unix-abstract', lambda: socket.socket(socket.AF_UNIX).connect({abstract.getsockname()!r}))\n")
        assert _attempts(run_code(code, timeout_s=10)) == dict.fromkeys(
            ("tcp-loopback", "tcp-outside", "dns", "unix-abstract"), "closed")
        for listening in (server, abstract):
            listening.settimeout(0)
            with pytest.raises(BlockingIOError):
                listening.accept()  # nothing connected


def test_filesystem_sockets_are_out_of_reach():
    servers = [_unix_server(parent) for parent in ("/tmp", "/run") if os.access(parent, os.W_OK)]
    try:
        code = ATTEMPT + "".join(
            f"attempt({s.getsockname()!r}, lambda: socket.socket(socket.AF_UNIX).connect({s.getsockname()!r}))\n"
            for s in servers)
        code += "for path in ('/run', '/var/run', '/sys'):\n    attempt(path, lambda: os.stat(path))\n"
        assert _attempts(run_code(code, timeout_s=3)) == dict.fromkeys(
            [s.getsockname() for s in servers] + ["/run", "/var/run", "/sys"], "closed")
        for server in servers:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        for server in servers:
            path = server.getsockname()
            server.close()
            os.unlink(path)
            os.rmdir(os.path.dirname(path))


def test_only_the_system_directories_are_mounted():
    code = ("import os\nprint(' '.join(line.split()[4] for line in open('/proc/self/mountinfo')))\n"
            "print(' '.join(name for name in os.listdir('/proc') if name.isdigit()))\n")
    result = run_code(code, timeout_s=3)
    assert result.passed, result.stderr
    mounts, pids = (line.split() for line in result.stdout.splitlines())
    allowed = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
               "/etc/localtime", "/tmp", "/proc", "/dev", *isolation().python_roots}
    assert {m for m in mounts if not m.startswith(("/proc/", "/dev/"))} <= allowed
    assert len(pids) <= 3  # bwrap's init, the program and nothing else of the machine's


def test_writes_outside_the_scratch_space_fail():
    marker = f"diversed-probe-{uuid.uuid4().hex}"
    everywhere = ["/", "/usr", "/etc", "/var", str(Path.home()), str(PROJECT), sys.prefix]
    # A checkout under /tmp (CI's clone may be one) is, inside, a path of the sandbox's own empty /tmp: writing
    # there is the scratch space, and what counts is that nothing reaches the host's copy.
    outside = [p for p in everywhere if not Path(p).is_relative_to("/tmp")]
    write = f"os.makedirs(place, exist_ok=True) or open(place + '/{marker}', 'x')"
    code = ATTEMPT + f"for place in {everywhere!r}:\n    attempt(place, lambda: {write})\n"
    attempts = _attempts(run_code(code, timeout_s=3))
    assert {p: attempts[p] for p in outside} == dict.fromkeys(outside, "closed")
    assert not any(os.path.exists(os.path.join(place, marker)) for place in everywhere)


def test_nothing_written_survives_the_run():
    marker = f"diversed-probe-{uuid.uuid4().hex}"
    places = [".", "~", "/tmp", "/var/tmp", "/dev/shm"]
    code = ATTEMPT + (f"for place in {places!r}:\n"
                      f"    attempt(place, lambda: open(os.path.expanduser(place) + '/{marker}', 'w').write('x'))\n")
    assert _attempts(run_code(code, timeout_s=3)) == dict.fromkeys(places, "open")
    assert not any(Path(place, marker).exists() for place in ("/tmp", "/var/tmp", "/dev/shm", Path.home(), PROJECT))
    after = run_code("import os\nprint(sorted(os.listdir('/tmp')), os.listdir('/dev/shm'))", timeout_s=3)
    assert after.stdout == "['main.py'] []\n"  # the next run starts clean


@pytest.mark.parametrize("ending", ["exits", "times out"])
def test_no_process_outlives_the_run(ending):
    marker = f"diversed-probe-{uuid.uuid4().hex}"
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(60)', '{marker}']"
    code = (f"import os, subprocess, sys\nsubprocess.Popen({sleeper})\n"
            f"if os.fork() == 0:  # a daemon: double fork, new session\n    os.setsid()\n"
            f"    if os.fork() == 0:\n        os.execv(sys.executable, {sleeper})\n    os._exit(0)\n"
            f"os.wait()\n" + ("while True:\n    pass\n" if ending == "times out" else ""))
    start = time.monotonic()
    result = run_code(code, timeout_s=1)
    assert result.passed == (ending == "exits") and time.monotonic() - start < 3
    assert _wait_until_gone(marker) == []


def test_fork_bomb_is_contained_and_cleaned_up():
    marker = f"diversed-probe-{uuid.uuid4().hex}"
    bomb = "import os\\nwhile True:\\n    os.fork()"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', '{bomb}', '{marker}'])\n"
    start = time.monotonic()
    result = run_code(code, timeout_s=3)
    assert not result.passed and time.monotonic() - start < 5
    assert _wait_until_gone(marker) == []


# --- without a sandbox


def test_detection_says_why_it_fails(monkeypatch):
    monkeypatch.setattr(sandbox, "_BWRAP", "diversed-no-such-bwrap")
    assert "not installed" in sandbox._probe.__wrapped__()
    monkeypatch.setattr(sandbox, "_BWRAP", "false")  # found, but fails every time
    assert "self-check" in sandbox._probe.__wrapped__()


@pytest.mark.parametrize("opt_in", ["parameter", "environment"])
def test_unsandboxed_runs_only_when_asked_for(monkeypatch, opt_in):
    monkeypatch.setattr(sandbox, "_probe", lambda: "bwrap is broken")
    monkeypatch.setenv(ALLOW_UNSANDBOXED_ENV, "0")
    with pytest.raises(SandboxUnavailableError, match=f"bwrap is broken.*{ALLOW_UNSANDBOXED_ENV}=1"):
        run_code("print('ok')")
    with pytest.raises(SandboxUnavailableError):
        isolation()
    if opt_in == "environment":
        allow_unsandboxed()  # sets the variable; monkeypatch restores it
    with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
        result = run_code("print('ok')", timeout_s=3, allow_unsandboxed=True if opt_in == "parameter" else None)
        memory = run_code("x = bytearray(10 * 1024**3)", timeout_s=3, memory_mb=512, allow_unsandboxed=True)
    assert result.passed and result.stdout == "ok\n"
    assert not memory.passed and "MemoryError" in memory.stderr  # the limits still hold
    if opt_in == "environment":
        with pytest.raises(SandboxUnavailableError):
            run_code("print('ok')", allow_unsandboxed=False)  # the parameter wins


def test_run_name_sets_the_programs_name_and_must_be_an_identifier():
    program = "print(__name__)\nif __name__ == '__main__':\n    raise SystemExit(3)\n"
    assert run_code(program, timeout_s=10, run_name="candidate").stdout == "candidate\n"
    with pytest.raises(ValueError, match="run_name"):
        run_code("pass", run_name="not a name")
