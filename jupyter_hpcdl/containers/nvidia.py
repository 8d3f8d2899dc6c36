"""The node's NVIDIA driver in a container: what ``udocker setup --nvidia`` copies, checked and made whole.

udocker copies the driver's libraries from every directory where ldconfig or ``LD_LIBRARY_PATH`` shows them, a
symbolic link as a link. A node whose driver lives elsewhere (``/usr/local/nvidia``, a read-only mount, with
absolute links to it in ``/usr/lib``, as on a GPU machine this was tested on) then gives the container links to
paths that do not exist inside it; which copy wins depends on the order udocker walks the directories in, which
changes from run to run. :func:`repair_driver_links` points such links at the copied files instead.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import Callable, Mapping

#: Where nodes keep the driver's user-space libraries (``udocker setup --nvidia`` finds them through ldconfig).
NVIDIA_LIBRARY_GLOBS = ("/usr/lib/x86_64-linux-gnu/libcuda.so*", "/usr/lib64/libcuda.so*", "/usr/lib/libcuda.so*",
                        "/usr/local/nvidia/lib64/libcuda.so*")
#: Where udocker puts them in the container (the first of these the image has).
CONTAINER_LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64")
#: The driver's libraries as udocker's list names them (``nvi_lib_list``): the only links a repair touches.
DRIVER_LIBRARY_PREFIXES = ("libcuda.", "libnvidia-", "libnvcuvid.", "libOpenCL.")
#: How ``udocker setup --nvidia`` reports an optional file of its list that this node lacks (a Vulkan or OpenCL ICD).
OPTIONAL_FILE_ERROR = "Error: creating nvidia dir"
_MAX_LINKS = 40  # as the kernel's limit on nested symbolic links


def host_has_nvidia(globs=NVIDIA_LIBRARY_GLOBS, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this node has the NVIDIA driver's user-space libraries that ``udocker setup --nvidia`` copies: in
    the usual places, or in a directory of ``LD_LIBRARY_PATH`` (a site's ``module load``), where udocker looks too."""
    extra = [os.path.join(d, "libcuda.so*") for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    return any(glob.glob(g) for g in (*globs, *extra))


def resolve_in_root(root: str, path: str) -> str | None:
    """The host path of the file ``path`` names inside the container at ``root``, its links followed component by
    component as the container sees them (an absolute target starts again at ``root``; ``..`` stops at it); None
    when it does not exist there or the links loop."""
    root = os.path.normpath(root)
    todo = [c for c in path.split("/") if c]
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop(0)
        if part in (".", ""):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, part)
        if os.path.islink(here):
            links += 1
            if links > _MAX_LINKS:
                return None
            target = os.readlink(here)
            if os.path.isabs(target):
                done = []
            todo = [c for c in target.split("/") if c] + todo
            continue
        if not os.path.lexists(here):
            return None
        done.append(part)
    return os.path.join(root, *done)


def driver_library_dir(root: str) -> str | None:
    """The container's directory (inside it) that holds the driver's ``libcuda.so.1``, if any."""
    return next((d for d in CONTAINER_LIBRARY_DIRS if os.path.lexists(os.path.join(root, d, "libcuda.so.1"))), None)


def container_has_driver(root: str) -> bool:
    """Whether the container's ``libcuda.so.1`` is there and resolves, inside the container, to a file."""
    found = driver_library_dir(root)
    resolved = resolve_in_root(root, f"/{found}/libcuda.so.1") if found else None
    return resolved is not None and os.path.isfile(resolved)


def where_libcuda_points(root: str) -> str:
    """What the container's ``libcuda.so.1`` is, for an error message."""
    found = driver_library_dir(root)
    if found is None:
        return f"none in {' or '.join('/' + d for d in CONTAINER_LIBRARY_DIRS)}"
    link = os.path.join(root, found, "libcuda.so.1")
    return f"/{found}/libcuda.so.1 -> {os.readlink(link)}" if os.path.islink(link) else f"/{found}/libcuda.so.1"


def _is_driver_library(name: str) -> bool:
    return name.startswith(DRIVER_LIBRARY_PREFIXES)


def repair_driver_links(root: str) -> list[str]:
    """Point each driver library link (``libcuda.*``, ``libnvidia-*``...) in the container's library directory that
    leads nowhere inside the container at the file it names on this node, when that is a driver library too: the
    same file udocker copied beside it where there is one, else a copy. Writes only inside the container's own
    directory. Returns the names of the links repaired."""
    found = driver_library_dir(root)
    if found is None:
        return []
    directory = os.path.join(root, found)
    if os.path.commonpath([os.path.realpath(directory), os.path.realpath(root)]) != os.path.realpath(root):
        return []  # the image's library directory is a link out of the container: not ours to write to
    repaired = []
    for name in sorted(os.listdir(directory)):
        link = os.path.join(directory, name)
        if not (_is_driver_library(name) and os.path.islink(link)) or resolve_in_root(root, f"/{found}/{name}"):
            continue
        target = os.readlink(link)
        host_file = os.path.realpath(target) if os.path.isabs(target) else None
        if host_file is None or not os.path.isfile(host_file) or not _is_driver_library(os.path.basename(host_file)):
            continue  # neither inside nor a driver library on the node: left as udocker made it
        beside = os.path.join(directory, os.path.basename(host_file))
        if not os.path.isfile(beside) or os.path.islink(beside):
            _replace_with(beside, lambda tmp: shutil.copy2(host_file, tmp))
        if os.path.basename(host_file) != name:
            _replace_with(link, lambda tmp: (os.unlink(tmp), os.symlink(os.path.basename(host_file), tmp)))
        repaired.append(name)
    return repaired


def _replace_with(path: str, make: Callable[[str], object]) -> None:
    """Put what ``make`` writes at a temporary name beside ``path`` in its place at once (readers never see none)."""
    fd, tmp = tempfile.mkstemp(prefix=".hpcdl-", dir=os.path.dirname(path))
    os.close(fd)
    try:
        make(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
