"""The fast path's launcher: run one command in a udocker-prepared container root without ptrace, in an
unprivileged user namespace and a mount namespace of its own.

    python -S -E .../jupyter_hpcdl/containers/nsexec.py PLAN_FILE STATUS_FD   (the standard library only)

or, from a single-threaded process, as ``subprocess.Popen``'s ``preexec_fn`` (:func:`preexec`: no second
interpreter to start).

The plan (a JSON file only its owner can read, written by :func:`.spec.build_userns_plan`) says the root, the bind
mounts, the user's own uid and gid (mapped to themselves: the user is who they are inside, never a fake root), the
working directory, the environment and the argv. This process unshares, maps, binds, changes root and then
*becomes* the command (``execve``): the same pid, so exit codes, stdout and stderr, and signals are the command's
own; no tracer, so system calls cost what they cost natively. Capabilities held in the new namespace are dropped by
the ``execve`` itself (the user's uid is not 0 there).

Everything up to ``execve`` reports failure on ``STATUS_FD`` (close-on-exec: a successful ``execve`` closes it
with nothing written), so the caller can fall back to P1 with the reason instead of mistaking it for the command's
own exit code. A command that is not there (or not executable) is the command's failure, not the fast path's:
``exec:`` on ``STATUS_FD``, the reason on stderr, and 127 (126) as a shell would."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4



def _load_libc() -> ctypes.CDLL:
    """The C library's calls, from the symbols this interpreter already has (``dlopen(NULL)``: glibc or musl).
    ``ctypes.util.find_library`` would run ``ldconfig -p`` in a subprocess first: about 0.1 s on every start."""
    libc = ctypes.CDLL(None, use_errno=True)
    if all(hasattr(libc, name) for name in ("unshare", "mount", "prctl")):
        return libc
    from ctypes.util import find_library  # a static or unusual interpreter: look the library up by name

    return ctypes.CDLL(find_library("c"), use_errno=True)


_libc = _load_libc()


class Failed(Exception):
    """A step before the command started failed; the message names it."""


class CommandFailed(Exception):
    """The container was entered, but the command could not start there (as a shell says: 127 not found, 126)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise Failed(f"{what}: {os.strerror(err)} (errno {err})")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(uid: int, gid: int) -> None:
    """A user namespace in which the user is themselves (uid and gid mapped to the same ids), and a private mount
    namespace (nothing mounted here is seen outside)."""
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(user and mount namespaces)")
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
    except OSError as e:
        raise Failed(f"mapping the user's ids in the new user namespace: {e}") from None
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making the mounts private")


class ContainerFailed(Failed):
    """A step failed for this container's root (a bind target its image makes impossible, a root that is gone), not
    for the node: the message starts with :data:`CONTAINER_FAILURE`, and the node keeps the fast path."""

    def __init__(self, message: str):
        super().__init__(CONTAINER_FAILURE + message)


CONTAINER_FAILURE = "container: "
MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def resolve_in_root(root: str, path: str) -> str:
    """The host path of ``path`` inside the container root ``root``, its symbolic links followed as the container
    sees them: an absolute link starts again at ``root``, and ``..`` never climbs above it (what ``openat2`` with
    ``RESOLVE_IN_ROOT`` does). Components that do not exist yet are kept as they are written."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, part)
        if os.path.islink(here):
            links += 1
            if links > MAX_LINKS:
                raise ContainerFailed(f"{path} in the container: more than {MAX_LINKS} symbolic links")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            pending = [p for p in target.split("/") if p not in ("", ".")] + pending
            continue
        done.append(part)
    return os.path.join(root, *done)


def bind(source: str, target: str, readonly: bool = False) -> None:
    """``source`` at ``target`` (a host path without links, see :func:`resolve_in_root`; created first: a
    directory or an empty file, as the source is)."""
    try:
        if not os.path.lexists(target):
            if os.path.isdir(source):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
    except OSError as e:  # the image has something else there: the container's matter, not the node's
        raise ContainerFailed(f"making the bind target {target}: {e}") from None
    _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None),
           f"binding {source} at {target}")
    if readonly:
        _check(_libc.mount(b"none", target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None),
               f"making {target} read-only")


def prepare(plan: dict) -> None:
    """Enter, bind, change root and directory, drop what the command must not keep: everything but the
    ``execve`` of the command."""
    root = plan["root"]
    enter_namespaces(plan["uid"], plan["gid"])
    for b in plan["binds"]:
        required = b.get("required", True)
        if not os.path.lexists(b["source"]):
            if required:
                raise Failed(f"the bind source {b['source']} does not exist")
            continue
        try:
            bind(b["source"], resolve_in_root(root, b["target"]), b.get("readonly", False))
        except Failed:
            if required:  # an optional one (e.g. /etc/resolv.conf where the image has an odd link) is left out
                raise
    try:
        os.chroot(root)
        os.chdir(plan.get("workdir") or "/")
    except OSError as e:
        raise ContainerFailed(f"entering the container root {root}: {e}") from None
    if plan.get("cpus"):
        os.sched_setaffinity(0, plan["cpus"])
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def run(plan: dict) -> None:
    """:func:`prepare`, then become the command (never returns on success)."""
    prepare(plan)
    argv, env = plan["argv"], plan["env"]
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; the command gets them as from a shell
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:  # the command's own failure (not found, not executable), not the fast path's
        raise CommandFailed(f"{argv[0]}: {e.strerror}", 126 if isinstance(e, PermissionError) else 127) from None


def preexec(plan: dict, status: int):
    """For ``subprocess.Popen(plan["argv"], env=plan["env"], preexec_fn=...)`` in a single-threaded process: the
    child prepares the container and Popen's own ``execve`` starts the command, with no second interpreter. A
    failure is written to ``status`` first (then Popen raises SubprocessError); ``status`` is closed by a successful
    ``execve``."""
    def child() -> None:
        try:
            prepare(plan)
        except (Failed, OSError, ValueError, KeyError) as e:
            os.write(status, f"{e}".encode() or b"failed")
            raise
        os.set_inheritable(status, False)

    return child


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -S -E nsexec.py PLAN_FILE STATUS_FD", file=sys.stderr)
        return 125
    status = int(argv[1])
    os.set_inheritable(status, False)  # closed by a successful execve
    try:
        with open(argv[0]) as f:
            plan = json.load(f)
        os.unlink(argv[0])  # the environment's values live no longer than needed
        run(plan)
    except CommandFailed as e:
        try:
            os.write(status, b"exec:")
        except OSError:
            pass
        print(e, file=sys.stderr)
        return e.code
    except (Failed, OSError, ValueError, KeyError) as e:
        message = f"{e}".encode()
        try:
            os.write(status, message or b"failed")
        except OSError:  # nobody listens: say it where someone may
            print(f"hpcdl fast path: {e}", file=sys.stderr)
        return 125
    return 125  # not reached: run() ends in execve


if __name__ == "__main__":
    sys.exit(main())
