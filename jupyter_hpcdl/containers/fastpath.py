"""The fast path, chosen per node: a container runs without ptrace (:mod:`.nsexec`: an unprivileged user namespace
on the root udocker prepared) where the node allows it, and in udocker's P1 where it does not (no user namespaces,
a container inside a container, a site that said no). A quick probe decides once per node, kernel and launcher
version; the answer is cached in the user's udocker directory."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Mapping

from ..atomic import write_json
from .errors import ModeNotSupported
from .runner import ContainerProcess, start_prepared
from .spec import FAST_MODE, FAST_PATH_CHOICES, PROOT_MODE

NSEXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsexec.py")
START_TIMEOUT = 30.0  # seconds for the launcher to reach the command's execve


@dataclass(frozen=True)
class Decision:
    """The mode for this node and why."""

    mode: str
    reason: str
    key: str = ""
    checked_at: float = 0.0


def cache_key() -> str:
    """What the answer depends on: the kernel, the launcher's code and the Python that runs it."""
    with open(NSEXEC, "rb") as f:
        launcher = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"{platform.release()}|{launcher}|{sys.version_info.major}.{sys.version_info.minor}"


def cache_file(udocker_dir: str, host: str | None = None) -> str:
    return os.path.join(udocker_dir, "hpcdl-fastpath", f"{host or socket.gethostname()}.json")


def read_cached(path: str, key: str) -> Decision | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return Decision(**data) if data.get("key") == key else None


def write_cached(path: str, decision: Decision) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_json(path, asdict(decision))


def launch(plan: dict, env: Mapping[str, str], private_dir: str, **popen_kwargs) -> tuple[ContainerProcess | None, str]:
    """Start ``plan``; the process once it has become the command, or None and why not (nothing was started). A
    single-threaded process prepares the container in its own child (:func:`.nsexec.preexec`); others start the
    launcher's interpreter (forking a threaded process and running Python there is not safe). Only the latter
    has a deadline of its own (START_TIMEOUT); the node's probe takes it, so a node whose mounts hang is known by
    then."""
    if threading.active_count() == 1:
        started = start_prepared(plan, private_dir, **popen_kwargs)
        if started is not None:
            return started
    return _launch_interpreter(plan, env, private_dir, **popen_kwargs)


def _launch_interpreter(plan: dict, env: Mapping[str, str], private_dir: str,
                        **popen_kwargs) -> tuple[ContainerProcess | None, str]:
    """``plan`` through the launcher's own interpreter (it exits 125 before the command started if it cannot)."""
    path = os.path.join(private_dir, "plan.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(plan, f)
    read_end, write_end = os.pipe()
    pass_fds = tuple(popen_kwargs.pop("pass_fds", ())) + (write_end,)
    try:
        proc = ContainerProcess([sys.executable, "-S", "-E", NSEXEC, path, str(write_end)], env,
                                private_dir=private_dir, mode=FAST_MODE, pass_fds=pass_fds, **popen_kwargs)
    finally:
        os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], START_TIMEOUT)
        said = os.read(read_end, 4096).decode(errors="replace") if ready else None
    finally:
        os.close(read_end)
    if said is None:
        proc.stop()
        return None, f"the launcher did not start the command within {START_TIMEOUT:.0f} s"
    if said and not said.startswith("exec:"):  # (exec: the command itself could not start: its own exit code)
        proc.wait(10)
        return None, said
    return proc, ""


def probe(root: str, env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether the fast path runs a command in the container root ``root`` on this node, and why not."""
    plan = {"root": root, "uid": os.getuid(), "gid": os.getgid(), "workdir": "/",
            "binds": [{"source": d, "target": d} for d in ("/dev", "/proc", "/sys")],
            "env": {"PATH": "/usr/bin:/bin"}, "argv": ["/bin/sh", "-c", "test -r /proc/self/status && id -u"]}
    private_dir = tempfile.mkdtemp(prefix="hpcdl-probe-")
    t0 = time.monotonic()
    # through the launcher's interpreter: a node whose mounts hang is named within START_TIMEOUT, where a start in
    # Popen's child would wait with it
    proc, why = _launch_interpreter(plan, env, private_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc is None:
        return False, why
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.stop()
        return False, "the probe did not finish in 20 s"
    if proc.popen.returncode != 0 or out.strip() != str(os.getuid()):
        return False, f"the probe's command failed (exit {proc.popen.returncode}): {(err or out).strip()[-200:]}"
    return True, f"user namespaces work here (probe {time.monotonic() - t0:.2f} s)"


def known(choice: str, udocker_dir: str) -> Decision | None:
    """The mode for containers on this node as far as it is known without starting anything: P1 where the site
    turned the fast path off, else the node's cached answer (None until a first start has probed it)."""
    if choice not in FAST_PATH_CHOICES:
        raise ModeNotSupported(f"fast_path must be one of {', '.join(FAST_PATH_CHOICES)}, not {choice!r}")
    if choice == "off":
        return Decision(PROOT_MODE, "the site turned the fast path off")
    return read_cached(cache_file(udocker_dir), cache_key())


def decide(choice: str, root: str, udocker_dir: str, env: Mapping[str, str], prober=probe) -> Decision:
    """The mode for containers on this node, as the site's ``choice`` says: "off" → P1; "userns" → the fast path
    (an error if it cannot run here); "auto" → the fast path where the cached or fresh probe says it works, else
    P1."""
    decision = known(choice, udocker_dir)
    if decision is None:
        ok, why = prober(root, env)
        decision = Decision(FAST_MODE if ok else PROOT_MODE, why, cache_key(), time.time())
        write_cached(cache_file(udocker_dir), decision)
    if choice == FAST_MODE and decision.mode != FAST_MODE:
        raise ModeNotSupported(f"the site asks for the fast path, but it does not run on this node: "
                               f"{decision.reason}")
    return decision


def record_failure(udocker_dir: str, why: str) -> Decision:
    """The fast path failed on this node after the probe passed: P1 from now on (until the kernel or the launcher
    changes)."""
    decision = Decision(PROOT_MODE, f"the fast path failed here: {why}", cache_key(), time.time())
    write_cached(cache_file(udocker_dir), decision)
    return decision
