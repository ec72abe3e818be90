"""launch/processes.py with real short-lived Python processes: readiness, an early exit and a timeout reported with
the log's tail, stop escalating to SIGKILL for a whole process group, and the context manager stopping on an
exception. Fast: plain `python -c` children, sub-second grace periods, no timing asserted beyond lower bounds."""

from __future__ import annotations

import re
import signal
import sys
import time

import psutil
import pytest

from fastgen.launch.processes import Process, ProcessExited, start
from fastgen.testing import wait_until


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def says(process: Process, text: str) -> bool:
    return text in process.log_tail()


def gone(pid: int) -> bool:
    """Exited: no longer in the process table, or a zombie (whoever reaps orphans is not us)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# Ignores SIGTERM itself when asked to, and starts a child that always does, in its own process group.
STUBBORN = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child up', flush=True); "
    "time.sleep(60)"
)])
print("child pid", child.pid, flush=True)
time.sleep(60)
"""


def start_stubborn(tmp_path, mode: str) -> tuple[Process, int]:
    process = start("stubborn", [*python(STUBBORN), mode], tmp_path / "stubborn.log", new_session=True)
    process.wait_ready(lambda: says(process, "child up"), 10, what="with its child up")
    return process, int(re.search(r"child pid (\d+)", process.log_tail()).group(1))


def test_wait_ready_returns_once_the_probe_passes(tmp_path):
    code = "import time; time.sleep(0.2); print('listening', flush=True); time.sleep(60)"
    with start("server", python(code), tmp_path / "server.log") as server:
        server.wait_ready(lambda: says(server, "listening"), 10, what="listening")
        assert server.alive()
    assert server.popen.returncode == -signal.SIGTERM


def test_an_early_exit_fails_readiness_with_the_log_tail(tmp_path):
    code = "import sys; print('model folder not found', flush=True); sys.exit(3)"
    with start("server", python(code), tmp_path / "server.log") as server:
        with pytest.raises(ProcessExited) as info:
            server.wait_ready(lambda: False, 30, what="listening")
    message = str(info.value)
    assert "server exited with code 3 before it was listening" in message
    assert "model folder not found" in message and str(tmp_path / "server.log") in message


def test_a_timeout_fails_readiness_with_the_log_tail(tmp_path):
    code = "import time; print('still loading', flush=True); time.sleep(60)"
    with start("server", python(code), tmp_path / "server.log") as server:
        with pytest.raises(TimeoutError, match="server not listening after 0.3 s") as info:
            server.wait_ready(lambda: says(server, "listening"), 0.3, what="listening")
        assert "still loading" in str(info.value)


def test_stop_kills_a_group_that_ignores_sigterm_after_the_grace_period(tmp_path):
    process, child = start_stubborn(tmp_path, "ignore")
    begun = time.monotonic()
    assert process.stop(grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - begun >= 0.5  # SIGTERM first, and the grace period waited out
    wait_until(lambda: gone(child), 5, "the child killed with its group")
    assert process.stop() == -signal.SIGKILL  # idempotent


def test_stop_also_ends_a_child_that_outlives_its_group_leader(tmp_path):
    process, child = start_stubborn(tmp_path, "obey")
    assert process.stop(grace=0.5) == -signal.SIGTERM  # the leader went at once; its child only to SIGKILL
    wait_until(lambda: gone(child), 5, "the orphaned child killed with its group")


def test_the_context_manager_stops_on_an_exception(tmp_path):
    with pytest.raises(KeyError):
        with start("server", python("import time; time.sleep(60)"), tmp_path / "server.log") as server:
            raise KeyError("a failing test")
    assert not server.alive() and server.popen.returncode == -signal.SIGTERM


def test_without_a_log_the_output_is_ours_and_env_replaces_the_environment(capfd):
    code = "import os; print('seen', os.environ.get('ONLY'), 'HOME' in os.environ, flush=True)"
    with start("printer", python(code), env={"ONLY": "this"}) as printer:
        assert printer.popen.wait(10) == 0
    assert "seen this False" in capfd.readouterr().out
    assert "no log" in printer.log_tail()
