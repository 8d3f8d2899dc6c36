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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups added here
def pytest_collection_modifyitems(config, items):
    """Each test goes to its stream's group (``xdist_group``). Tests marked ``gpu`` need an NVIDIA GPU: skipped without one, or failed where HPCDL_REQUIRE_GPU=1 (a GPU
    check). Tests marked ``testbed`` need the bed: without it they are skipped, or fail where
    HPCDL_REQUIRE_TESTBED=1 (CI)."""
    if not Path("/dev/nvidia0").exists() and os.environ.get("HPCDL_REQUIRE_GPU") != "1":
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (/dev/nvidia0)"))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(stream_of(item)))
    if bed_is_up() or os.environ.get("HPCDL_REQUIRE_TESTBED") == "1":
        return  # where the bed is required, pytest_runtest_setup fails its tests instead
    for item in items:
        if "testbed" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_BED))


#: The two streams the suite runs in, side by side (``testbed/test`` gives pytest-xdist one worker for each):
#: 'slurm' uses Slurm, its hub, its nodes (the fault tests stop them) and alice's containers; 'rest' has the tests
#: that need no bed, the bed's tests that use no scheduler, and Grid Engine's. A bed test is in 'slurm' unless
#: marked ``stream("rest")``.
STREAMS = ("slurm", "rest")


def stream_of(item) -> str:
    marker = item.get_closest_marker("stream")
    if marker is not None:
        assert marker.args[0] in STREAMS, f"{item.nodeid}: stream must be one of {STREAMS}"
        return marker.args[0]
    return "slurm" if "testbed" in item.keywords else "rest"


NO_BED = f"the test bed is not up ({STATE}/bed.json, as root): run 'bash testbed/test'"


def bed_is_up() -> bool:
    return (STATE / "bed.json").exists() and os.geteuid() == 0


@pytest.fixture
def browser_page(tmp_path, request):
    """A page in Debian's Chromium driven by Playwright (see browser.py); a test that fails leaves what the page
    showed then in artifacts/screenshots/FAILED-<test>.png."""
    from browser import SHOTS, chromium_page

    with chromium_page(tmp_path / "profile") as page:
        yield page
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            try:
                page.screenshot(path=str(SHOTS / f"FAILED-{request.node.name.split('[')[0]}.png"), full_page=True)
            except Exception:  # the page itself may be what broke
                pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's report of its call, for fixtures that act on a failure (browser_page)."""
    report = yield
    if report.when == "call":
        item.report_call = report
    return report


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


# -- leftovers: each test is checked after its teardown, and the test that leaked is named and fails ---------------
#: Wider-scoped fixtures that hold no process or job: a test using only these is checked at once.
INERT_FIXTURES = {"bed", "alice", "bob", "hub", "files", "tools_dir", "ud", "container", "binder_env", "executed"}
_BEFORE = pytest.StashKey[dict]()
_STARTED = pytest.StashKey[tuple]()
#: Each test's wall time (setup and teardown included), the machine's busy and total CPU time meanwhile, its stream.
_PER_TEST: list[list] = []
_DEFERRED: dict[tuple, str] = {}  # things left by a test while a wider fixture of its module is still alive
_REPORTED: set[tuple] = set()  # named once: a later test is not blamed for them


def _test_users() -> list[str]:
    """The bed's users, whose processes and jobs the leftover check follows; none where no bed is up (no test then
    starts anything as them but its own children, which the check follows anyway), so that a run beside another,
    such as the bed guard's own run inside a test, does not claim the other run's servers."""
    if not bed_is_up():
        return []
    try:
        return json.loads((STATE / "bed.json").read_text()).get("users", ["alice", "bob"])
    except (OSError, ValueError):
        return ["alice", "bob"]


def _jobs_to_check(item) -> bool:
    """A bed test's leftovers include batch jobs (a test that needs no bed submits none)."""
    return "testbed" in item.keywords and bed_is_up()


def _holds_wider_fixture(item) -> bool:
    """Whether ``item`` uses a module- or session-wide fixture of this suite that may hold processes (what it starts
    in such a fixture's object, e.g. a rescaled session's engines, lives as long as that fixture)."""
    for name, defs in getattr(item, "_fixtureinfo").name2fixturedefs.items():
        d = defs[-1]
        if d.scope != "function" and name not in INERT_FIXTURES and d.baseid.startswith("tests"):
            return True
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """With HPCDL_REQUIRE_TESTBED=1 (the README's test command, CI) a test that needs the bed fails without it; with
    HPCDL_REQUIRE_GPU=1 a test that needs a GPU fails without one. Then what is there is noted (see teardown)."""
    from leftovers import cpu_times, snapshot

    if "gpu" in item.keywords and os.environ.get("HPCDL_REQUIRE_GPU") == "1" and not Path("/dev/nvidia0").exists():
        pytest.fail("HPCDL_REQUIRE_GPU=1 but this machine has no NVIDIA GPU (/dev/nvidia0)", pytrace=False)
    if "testbed" in item.keywords and not bed_is_up() and os.environ.get("HPCDL_REQUIRE_TESTBED") == "1":
        pytest.fail(f"HPCDL_REQUIRE_TESTBED=1 but {NO_BED}", pytrace=False)
    worker_group = item.nodeid.rpartition("@")[2] if os.environ.get("PYTEST_XDIST_WORKER") else None
    if worker_group is not None and getattr(item.config.option, "loadgroup", False) and worker_group != stream_of(item):
        pytest.fail(f"{item.nodeid} runs outside its stream {stream_of(item)!r}: the streams would overlap",
                    pytrace=False)
    item.stash[_BEFORE] = snapshot(_test_users(), STATE, _jobs_to_check(item), stream_of(item))
    item.stash[_STARTED] = (time.monotonic(), *cpu_times())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the teardown: what the test (or its function-scoped fixtures) started and left, jobs and processes, is
    waited for briefly, then named and the test fails. What a test leaves in a wider fixture is checked when the
    module ends, and blamed on the test it appeared in."""
    from leftovers import snapshot, still_there

    try:
        result = yield
    finally:
        _account(item)
    users, up, stream = _test_users(), _jobs_to_check(item), stream_of(item)
    before = item.stash.get(_BEFORE, {})
    new = {k: t for k, t in snapshot(users, STATE, up, stream).items() if k not in before}
    module_ends = nextitem is None or nextitem.module is not item.module
    if _holds_wider_fixture(item) and not module_ends:
        for key in new:
            _DEFERRED.setdefault(key, item.nodeid)
        return result
    if not module_ends:
        left = still_there(set(new), users, STATE, up, stream)
        _REPORTED.update(t.key for t in left)
        if left:
            pytest.fail(f"LEFT BEHIND by {item.nodeid}:\n" + "\n".join(t.text for t in left), pytrace=False)
        return result
    for key in new:
        _DEFERRED.setdefault(key, item.nodeid)
    left = still_there(None, users, STATE, up, stream, exclude=_REPORTED)
    blamed = dict(_DEFERRED)
    _DEFERRED.clear()
    _REPORTED.update(t.key for t in left)
    if left:
        lines = [f"{t.text}  (appeared in {blamed.get(t.key, 'an earlier module')})" for t in left]
        pytest.fail(f"LEFT BEHIND when {item.module.__name__} ended, after {item.nodeid}:\n" + "\n".join(lines),
                    pytrace=False)
    return result


def _account(item) -> None:
    from leftovers import cpu_times

    if _STARTED not in item.stash:
        return
    t0, busy0, total0 = item.stash[_STARTED]
    busy, total = cpu_times()
    _PER_TEST.append([item.nodeid, time.monotonic() - t0, busy - busy0, total - total0, stream_of(item)])


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its figures go to the controller
        session.config.workeroutput["hpcdl_cost"] = json.dumps(_PER_TEST)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _PER_TEST.extend(json.loads(getattr(node, "workeroutput", {}).get("hpcdl_cost", "[]")))


def pytest_terminal_summary(terminalreporter):
    """Where the time went: each file's share of the run (setup and teardown included) and how busy the cores were
    meanwhile (a file that leaves them idle waits on something: a scheduler, a timeout, a poll); then each stream's
    time. Each test's figures: artifacts/test-cost.tsv."""
    if not _PER_TEST:
        return
    by_file: dict[str, list[float]] = {}
    by_stream: dict[str, float] = {}
    for nodeid, wall, busy, total, stream in _PER_TEST:
        cost = by_file.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0.0, 0])
        cost[0], cost[1], cost[2], cost[3] = cost[0] + wall, cost[1] + busy, cost[2] + total, cost[3] + 1
        by_stream[stream] = by_stream.get(stream, 0.0) + wall
    whole = sum(c[0] for c in by_file.values()) or 1.0
    terminalreporter.section("time by file")
    for path, (wall, busy, total, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:25]:
        terminalreporter.write_line(f"{wall:8.1f} s {100 * wall / whole:5.1f} %  cores busy {100 * busy / max(total, 1):3.0f} %"
                                    f"  {n:3d} tests  {path}")
    streams = ", ".join(f"{name} {wall:.0f} s" for name, wall in sorted(by_stream.items()))
    terminalreporter.write_line(f"{whole:8.1f} s of tests in all; by stream: {streams}")
    out = Path(terminalreporter.config.rootpath) / "artifacts" / "test-cost.tsv"
    out.parent.mkdir(exist_ok=True)
    out.write_text("test\tstream\tseconds\tcores_busy\n" + "".join(
        f"{n}\t{st}\t{w:.1f}\t{b / max(t, 1):.2f}\n" for n, w, b, t, st in _PER_TEST))
