"""The thin layer that drives the udocker CLI (udocker has no stable Python API, so every call is a subprocess):
the user's image catalogue, per-user containers created once and reused, and starting commands in them."""
from __future__ import annotations

import fcntl
import getpass
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from contextlib import contextmanager
from typing import Iterator, Mapping

from .errors import InvalidSpec, ModeNotSupported, ToolsMissing, UdockerFailed, UnknownImage
from ..atomic import write_json
from . import quickstart
from .quickstart import MODE_ENV
from .nvidia import OPTIONAL_FILE_ERROR, container_has_driver, host_has_nvidia, repair_driver_links, where_libcuda_points
from .fastpath import Decision, cache_file, decide, known, launch, record_failure
from .nsexec import CONTAINER_FAILURE
from .runner import ContainerProcess, private_env_file
from .spec import (
    FAST_MODE,
    PROOT_MODE,
    RunSpec,
    SitePolicy,
    UdockerInstall,
    build_create_command,
    build_pull_command,
    build_run_command,
    build_setup_command,
    build_userns_plan,
    is_caller,
    check_container_name,
    check_image_ref,
    check_mode,
    check_run_spec,
    container_name_for,
    env_file_text,
    udocker_base,
    udocker_env,
)


class Udocker:
    """One user's udocker: ``install`` says where udocker and its tools are, ``policy`` what the site allows."""

    def __init__(self, install: UdockerInstall = UdockerInstall(), policy: SitePolicy | None = None,
                 environ: Mapping[str, str] | None = None, timeout: float = 900):
        self.install = install
        self.policy = policy or SitePolicy()
        self.environ = dict(os.environ if environ is None else environ)
        self.timeout = timeout

    # -- plumbing ---------------------------------------------------------------------------------------------------
    def env(self, mode: str | None = None) -> dict[str, str]:
        return udocker_env(self.install, self.environ, mode)

    def check_available(self) -> None:
        """Raise :class:`ToolsMissing` with what to install unless udocker and its tools are there."""
        exe = self.install.executable
        if not (os.path.isabs(exe) and os.access(exe, os.X_OK)) and not shutil.which(exe, path=self.environ.get("PATH")):
            raise ToolsMissing(f"udocker not found ({exe}): install it with 'pip install udocker'")
        if self.install.tools_dir:
            from .tools import check_tools  # (tarfile and friends: not for every launch)

            check_tools(self.install.tools_dir)
        check_mode(self.install.default_mode, self.policy)

    def _run(self, argv: list[str], timeout: float | None = None, tolerated: tuple[str, ...] = ()) -> str:
        """Run udocker; its "Error:" lines fail the call, but for those starting with one of ``tolerated``."""
        self.check_available()
        try:
            done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired as e:
            raise UdockerFailed(f"'udocker {argv[len(udocker_base(self.install))]}' did not finish in {e.timeout:.0f} s") from e
        out = done.stdout + done.stderr
        # udocker exits 0 on some failures (e.g. a truncated layer at create): its "Error:" lines count too.
        errors = [line for line in out.splitlines() if line.startswith("Error") and not line.startswith(tolerated)]
        if done.returncode != 0 or errors:
            cmd = " ".join(argv[len(udocker_base(self.install)):][:2])
            tail = "\n".join((errors or out.strip().splitlines())[-5:])
            raise UdockerFailed(f"'udocker {cmd}' failed (exit {done.returncode}): {tail}")
        return done.stdout

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """Serialize container creation between processes of the same user (e.g. two ranks on one node)."""
        top = self.env()["UDOCKER_DIR"]
        os.makedirs(top, mode=0o700, exist_ok=True)
        with open(os.path.join(top, f".hpcdl-{name}.lock"), "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- image catalogue --------------------------------------------------------------------------------------------
    def images(self) -> list[str]:
        """The images in the user's repository, as repository:tag."""
        out = self._run(udocker_base(self.install) + ["images"])
        words = [line.split() for line in out.splitlines()]
        return [w[0] for w in words if w and w[0] != "REPOSITORY"]

    def has_image(self, image: str) -> bool:
        return check_image_ref(image) in self.images()

    def _require_image(self, image: str) -> None:
        if not self.has_image(image):
            have = ", ".join(self.images()) or "none"
            raise UnknownImage(f"image {image!r} is not in your udocker repository (you have: {have}); "
                               "pull it from the site's registry or load it from a tarball first")

    def pull(self, image: str, registry: str | None = None) -> str:
        self._run(build_pull_command(image, self.install, registry))
        return image

    def load(self, tarball: str, repository: str) -> list[str]:
        """Load an OCI-layout or Docker-archive tarball into ``repository`` (the tags come from the archive);
        return the images it added."""
        if ":" in check_image_ref(repository):
            raise InvalidSpec(f"load takes a repository without a tag ({repository.split(':')[0]!r}): "
                              "the tags come from the archive")
        self._existing_file(tarball)
        before = set(self.images())
        self._run(udocker_base(self.install) + ["load", f"--input={tarball}", repository])
        return sorted(set(self.images()) - before)

    def import_tarball(self, tarball: str, image: str) -> str:
        """Import a root file system tarball as ``image``."""
        self._existing_file(tarball)
        self._run(udocker_base(self.install) + ["import", tarball, check_image_ref(image)])
        return image

    @staticmethod
    def _existing_file(path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"image tarball {path} does not exist or is not a file")

    def verify(self, image: str) -> None:
        self._require_image(image)
        self._run(udocker_base(self.install) + ["verify", image])

    def image_id(self, image: str) -> str:
        """A digest of the image's configuration (its layers' content ids): changes whenever the content does."""
        try:
            out = self._run(udocker_base(self.install) + ["inspect", check_image_ref(image)])
        except UdockerFailed:
            self._require_image(image)  # the clearer message where the image is simply not there
            raise
        return hashlib.sha256(out.encode()).hexdigest()

    def remove_image(self, image: str) -> None:
        self._require_image(image)
        self._run(udocker_base(self.install) + ["rmi", image])

    # -- containers -------------------------------------------------------------------------------------------------
    def containers(self) -> list[str]:
        """Names of the user's containers."""
        out = self._run(udocker_base(self.install) + ["ps"])
        names = []
        for line in out.splitlines()[1:]:
            if "['" in line:
                names += [n.strip(" '") for n in line.split("[", 1)[1].split("]", 1)[0].split(",") if n.strip(" '")]
        return names

    def ensure_container(self, image: str, mode: str | None = None, nvidia: bool | None = None) -> str:
        """The user's container for ``image``'s current content, created on first use (creation copies the whole
        image, so it is never done per command). GPU libraries are set up where the node has NVIDIA's driver."""
        mode = check_mode(mode or self.install.default_mode, self.policy)
        known = self._known_container(image)
        if known:
            return known
        name = container_name_for(image, self.image_id(image))
        nvidia = host_has_nvidia() if nvidia is None else nvidia
        with self._lock(name):
            if name not in self.containers():
                try:
                    self._run(build_create_command(image, name, self.install))
                    self._setup(name, mode, nvidia)
                except UdockerFailed:
                    self._remove_quietly(name)
                    raise
        self._remember_container(image, name)
        return name

    # Which container serves an image, remembered against the image's manifest file (a pull that changes the
    # content rewrites it), so that starting a command needs no udocker process once the container exists.
    def _manifest(self, image: str) -> str:
        repo, _, tag = check_image_ref(image).partition(":")
        return os.path.join(self.env()["UDOCKER_DIR"], "repos", repo, tag or "latest", "manifest")

    def _manifest_stamp(self, image: str) -> list | None:
        try:
            st = os.stat(self._manifest(image))
        except OSError:
            return None
        return [st.st_ino, st.st_size, st.st_mtime_ns]

    def _known_containers_file(self) -> str:
        return os.path.join(self.env()["UDOCKER_DIR"], "hpcdl-containers.json")

    def _known_container(self, image: str) -> str | None:
        try:
            with open(self._known_containers_file()) as f:
                entry = json.load(f).get(image)
        except (OSError, ValueError):
            return None
        stamp = self._manifest_stamp(image)
        if not entry or stamp is None or entry.get("stamp") != stamp:
            return None
        name = entry.get("container")
        try:
            return name if os.path.isdir(os.path.join(self.container_dir(name), "ROOT")) else None
        except InvalidSpec:
            return None

    def _remember_container(self, image: str, name: str) -> None:
        path = self._known_containers_file()
        try:
            with open(path) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        known[image] = {"container": name, "stamp": self._manifest_stamp(image)}
        write_json(path, known)

    def setup_nvidia(self, name: str) -> None:
        """Copy this node's NVIDIA driver libraries into the container (again after a driver update)."""
        with self._lock(name):
            self._setup(name, self.install.default_mode, nvidia=True)

    def _setup(self, name: str, mode: str | None, nvidia: bool) -> None:
        """``udocker setup``. With ``--nvidia`` udocker prints an "Error:" line for each optional file this node
        lacks (a Vulkan or OpenCL ICD, which few GPU nodes have) and exits 0 either way: the outcome that matters is
        checked instead: the driver's ``libcuda.so.1`` in the container, its links made whole (see :mod:`.nvidia`)."""
        self._run(build_setup_command(name, self.install, mode=mode, nvidia=nvidia),
                  tolerated=(OPTIONAL_FILE_ERROR,) if nvidia else ())
        if not nvidia:
            return
        root = os.path.join(self.container_dir(name), "ROOT")
        try:
            repair_driver_links(root)
        except OSError as e:
            raise UdockerFailed(f"could not complete the driver's libraries in container {name!r}: {e}") from e
        if not container_has_driver(root):
            raise UdockerFailed(f"'udocker setup --nvidia' gave container {name!r} no usable libcuda.so.1 "
                                f"({where_libcuda_points(root)}): udocker finds the driver's libraries through "
                                "ldconfig and LD_LIBRARY_PATH; make sure one of them has the directory of this node's "
                                "libcuda.so.1")

    def _remove_quietly(self, name: str) -> None:
        try:
            self._run(udocker_base(self.install) + ["rm", "-f", name])
        except UdockerFailed:
            pass

    def remove_container(self, name: str) -> None:
        if name not in self.containers():
            raise UnknownImage(f"container {name!r} does not exist in your udocker repository")
        self._run(udocker_base(self.install) + ["rm", "-f", name])

    def container_dir(self, name: str) -> str:
        """The directory udocker keeps the container ``name`` in (its ``ROOT`` and ``container.json``)."""
        return os.path.realpath(os.path.join(self.env()["UDOCKER_DIR"], "containers", check_container_name(name)))

    def mode_for(self, name: str) -> Decision:
        """The execution mode for ``name``'s commands on this node: the fast path where the site allows it and the
        node's probe (cached) says it works, else P1 (see :mod:`.fastpath`)."""
        return decide(self.policy.fast_path, os.path.join(self.container_dir(name), "ROOT"),
                      self.env()["UDOCKER_DIR"], self.environ)

    def known_mode(self) -> Decision | None:
        """The mode this node's containers run in, without starting one (None: no start has probed it yet)."""
        return known(self.policy.fast_path, self.env()["UDOCKER_DIR"])

    def start(self, spec: RunSpec, **popen_kwargs) -> ContainerProcess:
        """Validate ``spec`` and start it, in the mode this node runs (:meth:`mode_for`); the values of
        ``spec.env_names`` go through a private file, never the command line. Inside, ``HPCDL_CONTAINER_MODE`` says
        the mode. A fast path that fails before the command starts falls back to P1 and says so on stderr (unless
        the site forces the fast path: then it is an error)."""
        spec = check_run_spec(spec, self.policy)
        if spec.user is None:  # as the calling user, not udocker's default (a fake root)
            spec = replace(spec, user=getpass.getuser())
        if not os.path.isdir(os.path.join(self.container_dir(spec.container), "ROOT")):
            raise UnknownImage(f"container {spec.container!r} does not exist: create it with ensure_container(image)")
        system_mounts = [p for p in self.policy.system_mounts if os.path.exists(p)]
        decision = self.mode_for(spec.container)
        as_me = is_caller(spec.user, getpass.getuser(), os.getuid(), os.getgid())
        if decision.mode == FAST_MODE and as_me:  # (another user inside is P1's: the fast path never changes who)
            proc, why = self._start_fast(spec, system_mounts, **popen_kwargs)
            if proc is not None:
                return proc
            if self.policy.fast_path == FAST_MODE:
                raise ModeNotSupported(f"the fast path failed to start {spec.command[0]}: {why}")
            if why.startswith(CONTAINER_FAILURE):  # this container's root, not the node: the node keeps the fast path
                print(f"hpcdl-containers: the fast path cannot run container {spec.container} "
                      f"({why[len(CONTAINER_FAILURE):]}); running it in {PROOT_MODE} instead", file=sys.stderr,
                      flush=True)
            else:
                record_failure(self.env()["UDOCKER_DIR"], why)
                print(f"hpcdl-containers: the fast path failed on this node ({why}); running in {PROOT_MODE} instead",
                      file=sys.stderr, flush=True)
        environ = {**self.environ, MODE_ENV: self.install.default_mode}
        spec = replace(spec, env_names=(*spec.env_names, MODE_ENV))
        private_dir, env_file = private_env_file(env_file_text(spec.env_names, environ))
        argv = build_run_command(spec, self.install, env_file, system_mounts)
        return ContainerProcess(argv, self.env(), private_dir=private_dir, **popen_kwargs)

    def _fast_plan(self, spec: RunSpec, system_mounts: list[str], environ: Mapping[str, str]) -> dict:
        directory = self.container_dir(spec.container)
        try:
            with open(os.path.join(directory, "container.json")) as f:
                image_env = (json.load(f).get("config") or {}).get("Env") or []
        except (OSError, ValueError):
            image_env = []
        env_files = {}
        for path in spec.env_files:
            with open(path) as f:
                env_files[path] = f.read()
        home = self.environ.get("HOME") or os.path.expanduser("~")
        plan = build_userns_plan(spec, os.path.join(directory, "ROOT"), image_env, environ, env_files,
                                 system_mounts, home, os.getuid(), os.getgid(), getpass.getuser())
        plan["env"][MODE_ENV] = FAST_MODE
        return plan

    def _start_fast(self, spec: RunSpec, system_mounts: list[str], **popen_kwargs):
        plan = self._fast_plan(spec, system_mounts, self.environ)
        private_dir = tempfile.mkdtemp(prefix="hpcdl-run-")
        return launch(plan, self.environ, private_dir, **popen_kwargs)

    def remember_start(self, site: str, image: str, container: str) -> None:
        """Keep this node's fast-path start of ``container`` (``image``'s, with the site's file ``site``) resolved,
        for :mod:`.quickstart`: the plan of a call with no command, variables or terminal of its own, and what it
        was resolved from."""
        system_mounts = [p for p in self.policy.system_mounts if os.path.exists(p)]
        plan = self._fast_plan(RunSpec(container, ["true"], user=getpass.getuser()), system_mounts, {})
        quickstart.remember(site, image, plan, self._manifest(image), cache_file(self.env()["UDOCKER_DIR"]),
                            list(self.policy.system_mounts))

    def run(self, spec: RunSpec, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run ``spec`` to completion and return its exit status and output; stops the whole tree on timeout."""
        proc = self.start(spec, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.stop()
            raise
        return subprocess.CompletedProcess(proc.argv, proc.popen.returncode, out, err)
