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

#: Where nodes keep the driver's user-space libraries (``udocker setup --nvidia`` finds them through ldconfig).
NVIDIA_LIBRARY_GLOBS = ("/usr/lib/x86_64-linux-gnu/libcuda.so*", "/usr/lib64/libcuda.so*", "/usr/lib/libcuda.so*",
                        "/usr/local/nvidia/lib64/libcuda.so*")
#: Where udocker puts them in the container (the first of these the image has).
CONTAINER_LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64")
#: How ``udocker setup --nvidia`` reports an optional file of its list that this node lacks (a Vulkan or OpenCL ICD).
OPTIONAL_FILE_ERROR = "Error: creating nvidia dir"
_MAX_LINKS = 40  # as the kernel's limit on nested symbolic links


def host_has_nvidia(globs=NVIDIA_LIBRARY_GLOBS) -> bool:
    """Whether this node has the NVIDIA driver's user-space libraries that ``udocker setup --nvidia`` copies."""
    return any(glob.glob(g) for g in globs)


def resolve_in_root(root: str, path: str) -> str | None:
    """The file ``path`` (absolute, inside the container) names once its links are followed as the container sees
    them (absolute targets inside ``root``), as a host path; None when it does not exist there."""
    current = os.path.join(root, path.lstrip("/"))
    for _ in range(_MAX_LINKS):
        if not os.path.islink(current):
            return current if os.path.exists(current) else None
        target = os.readlink(current)
        if os.path.isabs(target):
            current = os.path.join(root, target.lstrip("/"))
        else:
            current = os.path.normpath(os.path.join(os.path.dirname(current), target))
        if os.path.commonpath([root, current]) != os.path.normpath(root):
            return None  # a relative link that climbs out of the root
    return None


def driver_library_dir(root: str) -> str | None:
    """The container's directory (inside it) that holds the driver's ``libcuda.so.1``, if any."""
    return next((d for d in CONTAINER_LIBRARY_DIRS if os.path.lexists(os.path.join(root, d, "libcuda.so.1"))), None)


def container_has_driver(root: str) -> bool:
    """Whether the container's ``libcuda.so.1`` is there and resolves inside the container."""
    found = driver_library_dir(root)
    return found is not None and resolve_in_root(root, f"/{found}/libcuda.so.1") is not None


def repair_driver_links(root: str) -> list[str]:
    """Point each link in the container's driver directory that leads nowhere inside the container at the file it
    names on this node: the same file udocker copied beside it where there is one, else a copy. Returns the names
    of the links repaired."""
    found = driver_library_dir(root)
    if found is None:
        return []
    directory = os.path.join(root, found)
    repaired = []
    for name in sorted(os.listdir(directory)):
        link = os.path.join(directory, name)
        if not os.path.islink(link) or resolve_in_root(root, f"/{found}/{name}") is not None:
            continue
        host_file = os.path.realpath(os.readlink(link)) if os.path.isabs(os.readlink(link)) else None
        if host_file is None or not os.path.isfile(host_file):
            continue  # neither inside nor on the node: left as udocker made it
        beside = os.path.join(directory, os.path.basename(host_file))
        if not os.path.isfile(beside) or os.path.islink(beside):
            shutil.copy2(host_file, beside + ".hpcdl-partial")
            os.replace(beside + ".hpcdl-partial", beside)
        if os.path.basename(host_file) != name:
            os.unlink(link)
            os.symlink(os.path.basename(host_file), link)
        repaired.append(name)
    return repaired
