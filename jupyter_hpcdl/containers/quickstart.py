"""``hpcdl-containers``' front door: ``run`` at the cost of a plain Python start where this node's fast path has
started the same image before.

The full path (the site's settings, the image catalogue, the node's mode; about 0.1 s of imports) leaves what it
resolved for a fast-path start (the container root, the binds, the image's environment, who runs) in
``~/.jupyter-hpcdl/starts/NODE.json``, with the stamps of everything it was resolved from: the site's file, the
image's manifest, the node's mode decision, this package's container code, the user. A later start of the same
shape (``run [-e NAME | --env-prefix P]... IMAGE -- CMD...``, in the same working directory rule) whose stamps
all still hold is started from it: a child prepares the container and becomes the command (no second
interpreter), and this process waits for it as the full path does. Any other command or shape, a stamp that
changed, or a start that fails before the command runs goes to the full path (which then decides again, and falls
back to P1 with its message where the fast path no longer works). Standard library only, imported first."""
from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

SITE_CONFIG_ENV = "HPCDL_SITE_CONFIG"
DEFAULT_SITE_CONFIG = "/etc/jupyter-hpcdl/site.json"
#: Inside every container: the execution mode it runs in (named here, where the front door needs it too).
MODE_ENV = "HPCDL_CONTAINER_MODE"
#: The container code a remembered start was resolved by (a new installation changes their stamps).
SOURCES = ("nsexec.py", "spec.py", "udocker.py", "fastpath.py", "site.py", "runner.py", "quickstart.py")
#: Who runs, as the full path names them (getpass's variables, then the home).
USER_VARIABLES = ("HOME", "LOGNAME", "USER", "LNAME", "USERNAME")
HERE = os.path.dirname(os.path.abspath(__file__))


def site_config_path(given: str | None = None) -> str:
    return given or os.environ.get(SITE_CONFIG_ENV) or DEFAULT_SITE_CONFIG


class Call(NamedTuple):
    """A ``run`` the front door can start: the site's file (``--site``), the image, the variables by name and by
    prefix, the command."""

    site: str
    image: str
    names: list[str]
    prefixes: list[str]
    command: list[str]


def cwd_in_home() -> str | None:
    """Start where the caller is when that is inside the home directory (which the container binds)."""
    cwd, home = os.getcwd(), os.path.expanduser("~")
    return cwd if cwd == home or cwd.startswith(home.rstrip("/") + "/") else None


def _plain_dir(path: str | None) -> bool:
    """Whether the full path would take ``path`` as the working directory unchanged (normalized, no ':' or line
    break); where not, it says what is wrong."""
    return path is None or (os.path.normpath(path) == path and not any(c in path for c in ":\n\r\0"))


def _valid_name(name: str) -> bool:
    return bool(name) and name.isascii() and (name[0].isalpha() or name[0] == "_") and \
        all(c.isalnum() or c == "_" for c in name)


def parse(argv: list[str]) -> Call | None:
    """``[--site FILE] run [-e NAME | --env NAME | --env=NAME | --env-prefix P | --env-prefix=P]... IMAGE -- CMD...``;
    None for anything else (the full path's parser takes it, and says what is wrong)."""
    site = None
    if argv[:1] == ["--site"] and len(argv) > 1:
        site, argv = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--site="):
        site, argv = argv[0].split("=", 1)[1], argv[1:]
    if argv[:1] != ["run"] or site == "":
        return None
    names: list[str] = []
    prefixes: list[str] = []
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        if word in ("-e", "--env", "--env-prefix") and i + 1 < len(argv):
            (names if word != "--env-prefix" else prefixes).append(argv[i + 1])
            i += 2
        elif word.startswith(("--env=", "--env-prefix=")):
            (names if word.startswith("--env=") else prefixes).append(word.split("=", 1)[1])
            i += 1
        else:
            return None
    if len(argv) < i + 3 or argv[i + 1] != "--" or argv[i].startswith("-"):
        return None
    if not all(_valid_name(n) for n in (*names, *prefixes)):
        return None
    return Call(site_config_path(site), argv[i], names, prefixes, argv[i + 2:])


def _stamp(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def starts_file() -> str:
    return os.path.join(os.path.expanduser("~"), ".jupyter-hpcdl", "starts", f"{os.uname().nodename}.json")


def stamps(site: str, manifest: str, decision: str, mounts: list[str]) -> dict:
    """What a remembered start was resolved from, as it is now (``mounts``: the site's system mounts, bound where
    they exist)."""
    return {"site": [site, _stamp(site)], "manifest": [manifest, _stamp(manifest)],
            "decision": [decision, _stamp(decision)], "code": [_stamp(os.path.join(HERE, f)) for f in SOURCES],
            "user": [os.getuid(), os.getgid(), *(os.environ.get(v) for v in USER_VARIABLES)],
            "kernel": os.uname().release, "python": list(sys.version_info[:2]),
            "mounts": [[m, os.path.exists(m)] for m in mounts]}


def _entries() -> dict:
    try:
        with open(starts_file()) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def remember(site: str, image: str, plan: dict, manifest: str, decision: str, mounts: list[str]) -> None:
    """Keep the fast path's resolved start of ``image`` (``plan``: for no command, no variables by name, no
    terminal; ``HPCDL_CONTAINER_MODE`` set) for the next start on this node."""
    from ..atomic import write_json

    path = starts_file()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)
    entries = _entries()
    entries[image] = {"stamps": stamps(site, manifest, decision, mounts), "plan": plan}
    write_json(path, entries)


def forget(image: str) -> None:
    entries = _entries()
    if entries.pop(image, None) is not None:
        from ..atomic import write_json

        write_json(starts_file(), entries)


def remembered(site: str, image: str) -> dict | None:
    """The plan remembered for ``image`` with the site's file ``site``, if everything it was resolved from still
    holds."""
    entry = _entries().get(image)
    if not isinstance(entry, dict) or not isinstance(entry.get("plan"), dict):
        return None
    was = entry.get("stamps") or {}
    try:
        now = stamps(site, was["manifest"][0], was["decision"][0], [m for m, _ in was["mounts"]])
        if now != was or None in (now["manifest"][1:] + now["decision"][1:]) or \
                not os.path.isdir(entry["plan"]["root"]):
            return None
    except (KeyError, IndexError, TypeError, ValueError):  # an entry this code did not write
        return None
    return entry["plan"]


def plan_for(base: dict, names: list[str], prefixes: list[str], command: list[str], environ) -> dict:
    """``base`` for this call: the caller's terminal, the variables named (and those with the prefixes) with their
    values from ``environ``, the command, the working directory; as the full path builds it."""
    env = dict(base["env"])
    mode = {k: env.pop(k) for k in (MODE_ENV,) if k in env}  # set last, as the full path does
    if "TERM" in environ:
        env["TERM"] = environ["TERM"]
    chosen = [*names, *sorted(n for n in environ if _valid_name(n) and any(n.startswith(p) for p in prefixes))]
    env.update({n: environ[n] for n in chosen if n in environ})
    env.update(mode)
    return {**base, "env": env, "argv": list(command), "workdir": cwd_in_home() or base["workdir"]}


def run(argv: list[str]) -> int | None:
    """``argv`` started from a remembered start, and its exit status; None where the full path must take it."""
    call = parse(argv)
    if call is None:
        return None
    base = remembered(call.site, call.image)
    if base is None or not _plain_dir(cwd_in_home()):
        return None
    from .runner import run_foreground, start_prepared

    try:
        plan = plan_for(base, call.names, call.prefixes, call.command, os.environ)
    except (KeyError, TypeError, ValueError, AttributeError):  # an entry this code did not write
        return None
    started = start_prepared(plan)
    if started is None or started[0] is None:
        if started is not None:  # the container could not be prepared: resolve it all again
            try:
                forget(call.image)
            except OSError:
                pass
        return None
    return run_foreground(started[0])
