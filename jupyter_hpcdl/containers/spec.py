"""Typed descriptions of a udocker installation and of one container run, and the pure builders that turn
them into udocker command lines and environments. Nothing here touches the file system or starts a process:
every function is a pure function of its arguments, tested alone (like kubespawner's ``objects.py``)."""
from __future__ import annotations

import os.path
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .errors import InvalidSpec, ModeNotSupported, MountNotAllowed

#: What each udocker execution mode does with Debian's tools (../shared/notes/udocker.md); a site allows a subset.
MODE_NOTES: dict[str, str] = {
    "P1": "proot with seccomp acceleration",
    "P2": "proot without seccomp acceleration",
    "F1": "fakechroot: bind mounts are ignored and binaries inside mounts cannot start",
    "F2": "fakechroot: bind mounts are ignored and binaries inside mounts cannot start",
    "F3": "fakechroot with patchelf: container setup fails with Debian's patchelf",
    "F4": "fakechroot with patchelf: container setup fails with Debian's patchelf",
    "R1": "runc: exit codes and stderr are lost without a terminal; SIGTERM is ignored",
    "R2": "runc with proot: exit codes and stderr are lost without a terminal",
    "R3": "runc with proot: exit codes and stderr are lost without a terminal",
    "S1": "singularity/apptainer: not installed",
}
#: udocker's proot mode: new containers' default, and the mode wherever the fast path is off or fails.
PROOT_MODE = "P1"
DEFAULT_MODES: tuple[str, ...] = (PROOT_MODE, "P2")
#: The fast path's mode (no ptrace: an unprivileged user namespace on the container udocker prepared; see nsexec.py).
FAST_MODE = "userns"
#: A site's ``fast_path`` setting and the execution mode it gives a node's containers (the one map of both).
FAST_PATH_CHOICES: dict[str, str] = {
    "auto": f"probe each node once, {PROOT_MODE} where it fails",
    FAST_MODE: "always: an error where it can't run",
    "off": PROOT_MODE,
}
#: Host paths every udocker run binds by default (udocker's sysdirs), bound by the fast path too where they exist.
SYSTEM_DIRS: tuple[str, ...] = ("/dev", "/proc", "/sys", "/etc/resolv.conf", "/etc/host.conf", "/lib/modules")
#: udocker's PATH for images that set none.
DEFAULT_PATH = "/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"

_CONTAINER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# repository[:tag]; repository is lower-case path components as in Docker references.
_IMAGE_REF = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$|^[0-9]{1,10}(?::[0-9]{1,10})?$")
_FORBIDDEN_IN_PATH = ("\n", "\r", "\0", ":")


@dataclass(frozen=True)
class UdockerInstall:
    """Where udocker, its repository and its engine tools are.

    ``udocker_dir`` is the user's own repository (images, layers, containers); ``tools_dir`` holds the engine tools
    (``bin/`` and ``lib/``), which a site can install once, read-only, for every user (no download on compute nodes).
    """

    executable: str = "udocker"
    udocker_dir: str = "~/.udocker"
    tools_dir: str | None = None
    allow_root: bool = False
    default_mode: str = PROOT_MODE


@dataclass(frozen=True)
class Mount:
    """A host path bound into the container (at the same path unless ``container_path`` is given)."""

    host_path: str
    container_path: str | None = None

    @property
    def target(self) -> str:
        return self.container_path or self.host_path


@dataclass(frozen=True)
class RunSpec:
    """One command to run in an existing container.

    Environment values never appear on the command line: ``env_names`` are taken from the caller's environment at
    run time and handed over in an env-file (see :func:`env_file_text`); ``env_files`` are files the user made.
    """

    container: str
    command: Sequence[str]
    mounts: Sequence[Mount] = ()
    env_names: Sequence[str] = ()
    env_files: Sequence[str] = ()
    workdir: str | None = None
    user: str | None = None
    hostauth: bool = True
    bind_home: bool = True
    cpuset: str | None = None


@dataclass(frozen=True)
class SitePolicy:
    """What a site allows: host paths under which mounts may bind, and the execution modes that work there."""

    allowed_mount_roots: Sequence[str] = ("~", "/tmp")
    allowed_modes: Sequence[str] = DEFAULT_MODES
    #: Host files every container gets, set by the site (not users): /etc/hosts so that node names resolve inside.
    system_mounts: Sequence[str] = ("/etc/hosts",)
    home: str = field(default_factory=lambda: os.path.expanduser("~"))
    fast_path: str = "auto"

    def roots(self) -> list[str]:
        return [os.path.normpath(self.home + r[1:] if r.startswith("~") else r) for r in self.allowed_mount_roots]


def check_container_name(name: str) -> str:
    if not isinstance(name, str) or not _CONTAINER_NAME.match(name):
        raise InvalidSpec(
            f"container name {name!r} is not valid: use 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name


def check_image_ref(ref: str) -> str:
    if not isinstance(ref, str) or not _IMAGE_REF.match(ref):
        raise InvalidSpec(
            f"image reference {ref!r} is not valid: use repository[:tag] in lower case, e.g. 'hpcdl/base:2026.11' "
            "(give a registry with --registry, not inside the name)"
        )
    return ref


def check_mode(mode: str, policy: SitePolicy) -> str:
    if mode not in MODE_NOTES:
        raise ModeNotSupported(f"unknown execution mode {mode!r}: udocker modes are {', '.join(MODE_NOTES)}")
    if mode not in policy.allowed_modes:
        raise ModeNotSupported(
            f"execution mode {mode} can't run on this site ({MODE_NOTES[mode]}); use one of: {', '.join(policy.allowed_modes)}"
        )
    return mode


def _check_path(path: str, what: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or any(c in path for c in _FORBIDDEN_IN_PATH):
        raise InvalidSpec(f"{what} {path!r} must be an absolute path without ':' or line breaks")
    return os.path.normpath(path)


def check_mount(mount: Mount, policy: SitePolicy) -> Mount:
    """Refuse a mount whose host path is outside every allowed root, judged with its links and '..' resolved (a
    link under an allowed root that points elsewhere is refused); the mount keeps the resolved path, so what is
    judged is what is bound."""
    host = os.path.realpath(_check_path(mount.host_path, "mount host path"))
    target = _check_path(mount.target, "mount container path")
    roots = [os.path.realpath(r) for r in policy.roots()]
    if not any(host == r or host.startswith(r.rstrip("/") + "/") for r in roots):
        raise MountNotAllowed(
            f"mount of {host} is not allowed on this site: host paths must be under {', '.join(roots)}"
        )
    return Mount(host, target)


def check_run_spec(spec: RunSpec, policy: SitePolicy) -> RunSpec:
    """Validate every field of ``spec``; return it with normalized paths or raise a :class:`ContainerError`."""
    check_container_name(spec.container)
    if isinstance(spec.command, str) or not spec.command or not all(isinstance(a, str) and "\0" not in a for a in spec.command):
        raise InvalidSpec("command must be a non-empty list of strings (an argv, not a shell line)")
    for name in spec.env_names:
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise InvalidSpec(f"environment variable name {name!r} is not valid: use letters, digits and '_'")
    if spec.user is not None and not _USER.match(spec.user):
        raise InvalidSpec(f"user {spec.user!r} is not valid: give a login name or uid[:gid]")
    if spec.cpuset is not None and not re.match(r"^[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*$", spec.cpuset):
        raise InvalidSpec(f"cpuset {spec.cpuset!r} is not valid: use a list such as 0,2-3")
    return RunSpec(
        container=spec.container,
        command=tuple(spec.command),
        mounts=tuple(check_mount(m, policy) for m in spec.mounts),
        env_names=tuple(spec.env_names),
        env_files=tuple(_check_path(f, "env-file") for f in spec.env_files),
        workdir=None if spec.workdir is None else _check_path(spec.workdir, "workdir"),
        user=spec.user,
        hostauth=spec.hostauth,
        bind_home=spec.bind_home,
        cpuset=spec.cpuset,
    )


def udocker_env(install: UdockerInstall, base: Mapping[str, str], mode: str | None = None) -> dict[str, str]:
    """The environment for a udocker process: the caller's ``base`` plus where udocker finds its repository and
    tools. ``UDOCKER_TARBALL`` is empty, so udocker never tries to download its tools."""
    env = dict(base)
    home = base.get("HOME") or os.path.expanduser("~")
    env["UDOCKER_DIR"] = home + install.udocker_dir[1:] if install.udocker_dir.startswith("~") else install.udocker_dir
    env["UDOCKER_TARBALL"] = ""
    env["UDOCKER_DEFAULT_EXECUTION_MODE"] = mode or install.default_mode
    if install.tools_dir:
        env["UDOCKER_BIN"] = os.path.join(install.tools_dir, "bin")
        env["UDOCKER_LIB"] = os.path.join(install.tools_dir, "lib")
    return env


def udocker_base(install: UdockerInstall) -> list[str]:
    """The start of every udocker command line: quiet, and ``--allow-root`` where the caller is root."""
    return [install.executable, "-q"] + (["--allow-root"] if install.allow_root else [])


def build_run_command(spec: RunSpec, install: UdockerInstall, env_file: str | None = None,
                      system_mounts: Sequence[str] = ()) -> list[str]:
    """The ``udocker run`` argv for a validated ``spec``. ``env_file`` is where the caller wrote the values of
    ``spec.env_names`` (see :func:`env_file_text`); no value is ever placed on the command line.
    ``system_mounts`` are the site's own binds (same path inside), outside the users' allowlist."""
    argv = udocker_base(install) + ["run", "--nobanner"]
    if spec.hostauth:
        argv.append("--hostauth")
    if spec.bind_home:
        argv.append("--bindhome")
    if spec.user:
        argv.append(f"--user={spec.user}")
    if spec.workdir:
        argv.append(f"--workdir={spec.workdir}")
    if spec.cpuset:
        argv.append(f"--cpuset-cpus={spec.cpuset}")
    for path in system_mounts:
        argv.append(f"--volume={_check_path(path, 'system mount')}:{path}")
    for m in spec.mounts:
        argv.append(f"--volume={m.host_path}:{m.target}")
    if spec.env_names:
        if not env_file:
            raise InvalidSpec("env_names need an env_file to carry their values")
        argv.append(f"--env-file={env_file}")
    argv += [f"--env-file={f}" for f in spec.env_files]
    return argv + [spec.container, *spec.command]


def names_with_prefixes(environ: Mapping[str, str], prefixes: Sequence[str]) -> list[str]:
    """The names in ``environ`` that start with one of ``prefixes`` (e.g. ``PMIX_``: variables an MPI launcher sets
    per task, whose names are not known in advance)."""
    for prefix in prefixes:
        if not isinstance(prefix, str) or not _ENV_NAME.match(prefix):
            raise InvalidSpec(f"environment variable prefix {prefix!r} is not valid: use letters, digits and '_'")
    return sorted(n for n in environ if _ENV_NAME.match(n) and any(n.startswith(p) for p in prefixes))


def env_file_text(names: Sequence[str], environ: Mapping[str, str]) -> str:
    """The env-file lines for the variables ``names`` that are set in ``environ`` (one ``NAME=value`` a line).
    A value with a line break cannot be carried by udocker's env-file format and is refused."""
    lines = []
    for name in names:
        if name in environ:
            value = environ[name]
            if "\n" in value or "\r" in value:
                raise InvalidSpec(f"environment variable {name} holds a line break, which udocker's env-file can't carry")
            lines.append(f"{name}={value}")
    return "".join(line + "\n" for line in lines)


def build_create_command(image: str, container: str, install: UdockerInstall) -> list[str]:
    """``udocker create`` of a named container from an image in the user's repository."""
    return udocker_base(install) + ["create", f"--name={check_container_name(container)}", check_image_ref(image)]


def build_setup_command(container: str, install: UdockerInstall, mode: str | None = None, nvidia: bool = False) -> list[str]:
    """``udocker setup``: the container's execution mode and, on NVIDIA nodes, the host's driver libraries."""
    argv = udocker_base(install) + ["setup"]
    if mode:
        argv.append(f"--execmode={mode}")
    if nvidia:
        argv += ["--nvidia", "--force"]
    return argv + [check_container_name(container)]


def build_pull_command(image: str, install: UdockerInstall, registry: str | None = None) -> list[str]:
    """``udocker pull``; a registry is a full URL (``http://`` for a plain-HTTP registry on loopback)."""
    argv = udocker_base(install) + ["pull"]
    if registry is not None:
        if not re.match(r"^https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?/?$", registry):
            raise InvalidSpec(f"registry {registry!r} is not valid: give a URL such as http://127.0.0.1:5000")
        argv.append(f"--registry={registry.rstrip('/')}")
    return argv + [check_image_ref(image)]


def container_name_for(image: str, image_id: str) -> str:
    """The per-user container made from ``image`` whose content is ``image_id``: a new image content gets a new
    container, and the same content always finds the one already created."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", check_image_ref(image))
    return check_container_name(f"hpcdl-{slug[:80]}-{image_id[:12]}")


def parse_env_lines(text: str) -> dict[str, str]:
    """``NAME=value`` lines (an env-file, udocker's format) as a mapping; blank lines and ``#`` comments skipped."""
    env = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not _ENV_NAME.match(name):
            raise InvalidSpec(f"env-file line {line[:40]!r} is not NAME=value")
        env[name] = value
    return env


def is_caller(who: str | None, user: str, uid: int, gid: int) -> bool:
    """Whether a run's ``user`` (None, a name or uid[:gid]) is the calling user."""
    return who in (None, user, str(uid), f"{uid}:{gid}")


def build_userns_plan(spec: RunSpec, root: str, image_env: Sequence[str], environ: Mapping[str, str],
                      env_files: Mapping[str, str], system_mounts: Sequence[str], home: str, uid: int, gid: int,
                      user: str, exists=os.path.lexists) -> dict:
    """What :mod:`.nsexec` needs to run a validated ``spec`` on the container root ``root`` the way ``udocker
    run`` would: udocker's system directories, the site's system mounts, the home (``bind_home``), the host's
    passwd and group read-only (``hostauth``), the user's allowed mounts; the image's environment, then the user's
    names and env-files (``env_files``: path -> its text), ``HOME``/``USER``; the user's own uid and gid.
    ``spec.user`` other than the caller is refused: the fast path never changes who runs."""
    if not is_caller(spec.user, user, uid, gid):
        raise InvalidSpec(f"the fast path runs as you ({user}); user {spec.user!r} needs a P mode")
    binds = [{"source": d, "target": d, "required": d in ("/dev", "/proc", "/sys")} for d in SYSTEM_DIRS
             if exists(d) or d in ("/dev", "/proc", "/sys")]
    binds += [{"source": _check_path(p, "system mount"), "target": p} for p in system_mounts]
    if spec.hostauth:
        binds += [{"source": f, "target": f, "readonly": True} for f in ("/etc/passwd", "/etc/group") if exists(f)]
    if spec.bind_home:
        binds.append({"source": home, "target": home})
    binds += [{"source": m.host_path, "target": m.target} for m in spec.mounts]
    env = dict(e.split("=", 1) for e in image_env if "=" in e)
    env.setdefault("PATH", DEFAULT_PATH)
    if "TERM" in environ:
        env["TERM"] = environ["TERM"]
    env.update(HOME=home, USER=user, LOGNAME=user, USERNAME=user)
    for name in spec.env_names:
        if name in environ:
            env[name] = environ[name]
    for path in spec.env_files:
        env.update(parse_env_lines(env_files[path]))
    plan = {"root": root, "uid": uid, "gid": gid, "binds": binds, "env": env, "argv": list(spec.command),
            "workdir": spec.workdir or (home if spec.bind_home else "/")}
    if spec.cpuset:
        plan["cpus"] = sorted({c for part in spec.cpuset.split(",") for c in _cpu_range(part)})
    return plan


def _cpu_range(part: str) -> range:
    first, _, last = part.partition("-")
    return range(int(first), int(last or first) + 1)
