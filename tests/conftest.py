"""Fixtures for tests against the running test bed (``python testbed/bed.py up``)."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import time
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))  # the bed's own modules (hubclient, bed)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need an NVIDIA GPU: skipped without one, or failed where HPCDL_REQUIRE_GPU=1 (a GPU
    check). Tests marked ``testbed`` need the bed: without it they are skipped, or fail where
    HPCDL_REQUIRE_TESTBED=1 (CI)."""
    if not Path("/dev/nvidia0").exists() and os.environ.get("HPCDL_REQUIRE_GPU") != "1":
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (/dev/nvidia0)"))
    if bed_is_up() or os.environ.get("HPCDL_REQUIRE_TESTBED") == "1":
        return  # where the bed is required, pytest_runtest_setup fails its tests instead
    for item in items:
        if "testbed" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_BED))


NO_BED = f"the test bed is not up ({STATE}/bed.json, as root): run 'bash testbed/test'"


def bed_is_up() -> bool:
    return (STATE / "bed.json").exists() and os.geteuid() == 0


def pytest_runtest_setup(item):
    """With HPCDL_REQUIRE_TESTBED=1 (the README's test command, CI) a test that needs the bed fails without it; with
    HPCDL_REQUIRE_GPU=1 a test that needs a GPU fails without one."""
    if "gpu" in item.keywords and os.environ.get("HPCDL_REQUIRE_GPU") == "1" and not Path("/dev/nvidia0").exists():
        pytest.fail("HPCDL_REQUIRE_GPU=1 but this machine has no NVIDIA GPU (/dev/nvidia0)", pytrace=False)
    if "testbed" in item.keywords and not bed_is_up() and os.environ.get("HPCDL_REQUIRE_TESTBED") == "1":
        pytest.fail(f"HPCDL_REQUIRE_TESTBED=1 but {NO_BED}", pytrace=False)


@pytest.fixture
def browser_page(tmp_path):
    """A page in Debian's Chromium driven by Playwright (see browser.py)."""
    from browser import chromium_page

    with chromium_page(tmp_path / "profile") as page:
        yield page


@pytest.fixture(scope="session")
def bed() -> dict:
    return json.loads((STATE / "bed.json").read_text())


class User:
    """A real Unix user of the test bed; commands run as them with a clean, login-like environment."""

    def __init__(self, name: str, bed: dict):
        self.name, self.bed = name, bed
        self.home = pwd.getpwnam(name).pw_dir
        self.uid = pwd.getpwnam(name).pw_uid

    def env(self, **extra: str) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "LANG": "C.UTF-8",
                "PATH": f"{self.bed['venv']}/bin:/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2", **extra}

    def run(self, *argv: str, timeout: float = 300, check: bool = False, input: str | None = None, **env: str):
        cmd = ["runuser", "-u", self.name, "--", "env", "-i", *(f"{k}={v}" for k, v in self.env(**env).items()), *argv]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.home, input=input)
        if check and r.returncode:
            raise AssertionError(f"{' '.join(argv)} as {self.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def tmpdir(self) -> Path:
        d = Path(tempfile.mkdtemp(prefix="hpcdl-test-", dir=self.home))
        shutil.chown(d, self.name, self.name)
        return d

    def write(self, path: Path, text: str) -> Path:
        path.write_text(text)
        shutil.chown(path, self.name, self.name)
        return path


@pytest.fixture(scope="session")
def alice(bed) -> User:
    return User("alice", bed)


@pytest.fixture(scope="session")
def bob(bed) -> User:
    return User("bob", bed)


@pytest.fixture
def alice_dir(alice):
    d = alice.tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def user_processes(*users: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["username", "cmdline"]):
        if p.info["username"] in users:
            found.append(p)
    return found


def pytest_sessionfinish(session, exitstatus):
    """After the whole session: no job of the test users in the queue and no process of theirs left (else the run
    fails)."""
    if not bed_is_up():
        return
    users = json.loads((STATE / "bed.json").read_text()).get("users", ["alice", "bob"])
    deadline = time.monotonic() + 30  # a cancelled job's processes take a moment to go
    while True:
        queue = subprocess.run(["squeue", "-h", "-u", ",".join(users), "-o", "%i %T"], capture_output=True, text=True).stdout
        left = [f"{p.pid} {p.info['username']} {' '.join(p.info['cmdline'] or [])}" for p in user_processes(*users)]
        if not (queue.strip() or left) or time.monotonic() > deadline:
            break
        time.sleep(1)
    if queue.strip() or left:
        print(f"\nLEFT BEHIND by the tests: jobs {queue!r}, processes {left}", file=sys.stderr)
        session.exitstatus = 1
