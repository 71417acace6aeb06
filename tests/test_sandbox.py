"""The sandbox for generated code: results, limits, isolation, and no processes left behind."""

import os
import socket
import time
from pathlib import Path

import pytest

from diversed.tasks.sandbox import isolation, run_code


def _live_processes(pgid: int) -> list[int]:
    """Processes of a process group that are not yet dead (zombies count as dead)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            found.append(int(stat.parent.name))
    return found


def _wait_until_dead(pgid: int, deadline_s: float = 2.0) -> list[int]:
    """SIGKILL is asynchronous: give killed processes a moment to go."""
    end = time.monotonic() + deadline_s
    while (alive := _live_processes(pgid)) and time.monotonic() < end:
        time.sleep(0.05)
    return alive


def test_correct_program_passes():
    result = run_code("print('ok')", timeout_s=3)
    assert result.passed and result.returncode == 0 and not result.timed_out
    assert result.stdout == "ok\n"


def test_failing_assert_fails():
    result = run_code("assert 1 == 2", timeout_s=3)
    assert not result.passed and result.returncode == 1 and not result.timed_out
    assert "AssertionError" in result.stderr


def test_infinite_loop_is_killed_at_the_time_limit():
    start = time.monotonic()
    result = run_code("while True:\n    pass", timeout_s=1)
    assert result.timed_out and not result.passed
    assert time.monotonic() - start < 3


def test_fork_bomb_is_contained_and_cleaned_up():
    code = "import os\nprint(os.getpgrp(), flush=True)\nwhile True:\n    os.fork()\n"
    start = time.monotonic()
    result = run_code(code, timeout_s=2)
    assert not result.passed
    assert time.monotonic() - start < 5
    assert _wait_until_dead(int(result.stdout.split()[0])) == []


def test_huge_allocation_fails_inside_the_memory_limit():
    result = run_code("x = bytearray(10 * 1024**3)", timeout_s=3, memory_mb=512)
    assert not result.passed and not result.timed_out
    assert "MemoryError" in result.stderr


@pytest.mark.skipif(not isolation().own_uid, reason="only a per-run uid (when run as root) catches escapees")
def test_processes_that_leave_the_group_are_killed_too():
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "print(pid, flush=True)\n")
    result = run_code(code, timeout_s=3)
    assert result.passed  # the program itself exited normally...
    assert _wait_until_dead(int(result.stdout)) == []  # ...and its daemon (leader of its own group) is gone


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("DIVERSED_TEST_SECRET", "hunter2")
    result = run_code("import os\nprint(' '.join(sorted(os.environ)))\nprint(os.environ)", timeout_s=3)
    assert result.passed
    assert "hunter2" not in result.stdout
    assert set(result.stdout.splitlines()[0].split()) <= {"PATH", "LANG", "HOME", "TMPDIR"}


def test_working_directory_is_fresh_and_removed():
    code = "import os\nprint(os.getcwd())\nprint(os.listdir())\nopen('scratch.txt', 'w').write('x')\n"
    first, second = run_code(code, timeout_s=3), run_code(code, timeout_s=3)
    assert first.passed and second.passed
    (first_dir, listing), (second_dir, _) = first.stdout.splitlines(), second.stdout.splitlines()
    assert listing == "['main.py']" and first_dir != second_dir
    assert not os.path.exists(first_dir) and not os.path.exists(second_dir)


def test_network_is_blocked():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        result = run_code(code, timeout_s=3)
        assert not result.passed and "Error" in result.stderr
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected
