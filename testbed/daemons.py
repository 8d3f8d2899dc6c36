"""Daemons of the test bed, started by these scripts and stopped by the pids they recorded (never by name)."""
from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


def alive(pid: int) -> bool:
    """A live process (a zombie, which ``kill -0`` still finds, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s")


@dataclass
class Daemon:
    """``argv`` either daemonizes itself and writes ``pidfile`` (``forks=True``) or runs in the foreground, in which
    case it is started in a session of its own with its output in ``log`` and its pid written to ``pidfile``."""

    name: str
    argv: Sequence[str]
    pidfile: Path
    log: Path
    forks: bool = False
    ready: Callable[[], bool] = lambda: True
    env: dict | None = None
    user: str | None = None
    ready_timeout: float = 60
    cwd: str | None = None
    extra: dict = field(default_factory=dict)

    def pid(self) -> int | None:
        """The recorded pid, if that process is alive and is this daemon (a pid file left by a killed daemon may
        name a pid that another process has since taken)."""
        pid = read_pid(self.pidfile)
        if not pid or not alive(pid):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return None
        return pid if Path(self.argv[0]).name in cmdline else None

    def start(self) -> bool:
        """Start unless running; return whether it was started now."""
        if self.pid():
            return False
        self.pidfile.unlink(missing_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv)
        as_user = {}
        if self.user and self.forks:
            argv = ["runuser", "-u", self.user, "--"] + argv
        elif self.user:  # the daemon itself has the recorded pid (runuser would stand between)
            account = pwd.getpwnam(self.user)
            as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        env = {**os.environ, **(self.env or {})}
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, cwd=self.cwd, **as_user)
        if self.forks:
            proc.wait(timeout=60)
            wait_for(lambda: self.pid() is not None, 30, f"{self.name} pid file {self.pidfile}")
        else:
            self.pidfile.write_text(f"{proc.pid}\n")
        try:
            wait_for(lambda: self.pid() is not None and self.ready(), self.ready_timeout, self.name)
        except TimeoutError as e:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{e}; last lines of {self.log}:\n{tail}") from None
        return True

    def stop(self, timeout: float = 20) -> bool:
        """SIGTERM the recorded pid, SIGKILL after ``timeout``; return whether something was stopped."""
        pid = self.pid()
        if not pid:
            self.pidfile.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        try:
            wait_for(lambda: not alive(pid), timeout, f"{self.name} stop")
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not alive(pid), 10, f"{self.name} kill")
        self.pidfile.unlink(missing_ok=True)
        return True
