"""Starting a child process, waiting until it is ready and stopping it: the one way the supervisor, the CLI, the tests
and the benchmarks do it.

    with start("prometheus", argv, log_dir / "prometheus.log") as prometheus:
        prometheus.wait_ready(lambda: answers(url), timeout=30, what="ready")
        ...
    # stopped here, also on an exception: SIGTERM, then SIGKILL after the grace period

Output goes to a log file (a pipe nobody reads blocks the child once it is full), and every failure quotes the log's
tail. stdin is /dev/null: a child never competes with us for a terminal. With new_session the child leads a process
group of its own, out of reach of the terminal's Ctrl-C, and stopping it stops everything it started in that group.
Restart policies (the supervisor's backoff) and staged shutdowns (balancer before replicas) stay with their callers:
this module is the mechanics of one process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TAIL_CHARS = 3000
STOP_GRACE_S = 10.0
KILLED_WAIT_S = 10.0  # a SIGKILLed process still has to be scheduled to exit (and may sit in uninterruptible IO)
POLL_S = 0.05


class ProcessExited(RuntimeError):
    """The process exited while we waited for it to be ready; the message quotes its log."""


@dataclass
class Process:
    """A started child. `own_group`: it leads a process group (started with new_session), which stop ends whole."""

    name: str
    popen: subprocess.Popen
    log_path: Path | None  # None: its output went wherever ours goes
    own_group: bool = False
    # Set once the group is seen empty or SIGKILLed: from then on its id may name someone else's group.
    group_done: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = TAIL_CHARS) -> str:
        if self.log_path is None:
            return "(no log: its output went to ours)"
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - chars))
                return log.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def wait_ready(self, ready: Callable[[], bool], timeout: float, what: str = "ready", interval: float = 0.1) -> None:
        """Returns once ready() is true; ProcessExited if the process exits first, TimeoutError after timeout s.
        ready() is called between checks that the process still runs, so it may block for a while (a request with
        its own timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise ProcessExited(
                    f"{self.name} exited with code {self.popen.returncode} before it was {what}; {self.where_log()}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not {what} after {timeout:g} s; {self.where_log()}")
            time.sleep(interval)

    def where_log(self) -> str:
        return f"the end of its log ({self.log_path}):\n{self.log_tail()}"

    def stop(self, grace: float = STOP_GRACE_S) -> int:
        """SIGTERM, then SIGKILL whatever is left after `grace` seconds; returns the exit code. With its own group
        the whole group gets both signals, and the grace period lasts until the last member is gone: a child that
        outlives its parent is stopped too. Idempotent."""
        if not self.group_alive():
            return self.popen.wait(KILLED_WAIT_S)
        self.send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if self.group_alive():
            self.send(signal.SIGKILL)
        return self.popen.wait(KILLED_WAIT_S)

    def kill(self) -> None:
        """SIGKILL at once (its group too, with one) and reap it: for teardown and crash tests. Idempotent."""
        if self.group_alive():
            self.send(signal.SIGKILL)
        self.popen.wait(KILLED_WAIT_S)

    def send(self, signum: int) -> None:
        """A signal to the process, or to its whole group when it leads one."""
        if self.own_group:
            if signum == signal.SIGKILL:
                self.group_done = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signum)
        elif self.popen.poll() is None:
            self.popen.send_signal(signum)

    def group_alive(self) -> bool:
        """Whether the process (with its own group: any member of the group) still runs."""
        leader_alive = self.popen.poll() is None  # reaps it: a zombie leader would keep its group looking alive
        if not self.own_group or leader_alive or self.group_done:
            return leader_alive
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            self.group_done = True
            return False
        except PermissionError:  # a member that changed its credentials; it still runs
            pass
        return True

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(
    name: str,
    argv: Sequence[str],
    log_path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    new_session: bool = False,
    append: bool = False,
    pass_fds: Sequence[int] = (),
) -> Process:
    """Starts argv with stdin from /dev/null and stdout and stderr into log_path (its folder created; truncated
    unless append), or, without a log, into our own. env: the child's whole environment (default: ours).
    new_session: a session and process group of its own (see the module's docstring). pass_fds: descriptors the
    child inherits (a lock it must go on holding)."""
    common = dict(stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=new_session, pass_fds=tuple(pass_fds))
    if log_path is None:
        popen = subprocess.Popen(list(argv), **common)
    else:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab" if append else "wb") as log:
            popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, **common)
    return Process(name, popen, log_path, own_group=new_session)
