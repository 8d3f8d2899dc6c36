"""The doctor's exchange directory (the probe's request and result), handled as the user whose job reads and writes
it: when the doctor runs as root, these file operations run in a child that has become that user, so no link the
user planted in their home can turn a root write, chown or read elsewhere."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

DEFAULT_PARENT = "~/.jupyter-hpcdl/doctor"


class ExchangeError(RuntimeError):
    """A file operation in the exchange directory failed; the message says which and why."""


def run_as(user: str | None, fn: Callable[..., Any], *args: Any, timeout: int = 60) -> Any:
    """``fn(*args)`` as ``user`` (in a forked child when this process is root and ``user`` is someone else);
    its JSON-able result, or :class:`ExchangeError` with what went wrong."""
    if user is None or os.geteuid() != 0 or user == "root":
        try:
            return fn(*args)
        except OSError as e:
            raise ExchangeError(f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")) from None
    entry = pwd.getpwnam(user)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, do the one thing, report, exit
        os.close(read_end)
        try:
            signal.alarm(timeout)  # a hung file system ends the child, not the doctor
            os.setgroups(os.getgrouplist(user, entry.pw_gid))
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            os.environ["HOME"] = entry.pw_dir
            out = {"ok": fn(*args)}
        except OSError as e:
            out = {"error": f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")}
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent as a message
            out = {"error": f"{type(e).__name__}: {e}"}
        with os.fdopen(write_end, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        result = json.loads(data)
    except ValueError:
        raise ExchangeError(f"the file operation as {user} did not finish (status {status})") from None
    if "error" in result:
        raise ExchangeError(result["error"])
    return result["ok"]


def prepare(parent: str | None, nonce: str, request_json: str) -> str:
    """Create ``parent/nonce`` (0700) and the request in it; ``parent`` must exist unless it is the default."""
    base = Path(os.path.expanduser(parent or DEFAULT_PARENT))
    if parent is None:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
    elif not base.is_dir():
        raise ExchangeError(f"--exchange-dir {parent} is not an existing directory")
    work = base / nonce
    work.mkdir(mode=0o700)
    fd = os.open(work / "request.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(request_json)
    return str(work)


def collect(work: str) -> dict[str, str | None]:
    """The probe's result and the tail of the job's output, where they exist."""
    out: dict[str, str | None] = {"result": None, "job_out": None}
    for key, name in (("result", "result.json"), ("job_out", "job.out")):
        try:
            fd = os.open(os.path.join(work, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, errors="replace") as f:
            out[key] = f.read(1_000_000)
    return out


def remove(work: str) -> None:
    shutil.rmtree(work, ignore_errors=True)
