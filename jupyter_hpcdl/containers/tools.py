"""udocker's engine tools without a download: a tools tarball assembled from the distribution's own packages
(proot, runc, patchelf, libfakechroot), with a small compiled wrapper that works around two defects of Debian's
proot 5.1.0. Air-gapped compute nodes need exactly this; a site installs it once into a shared, read-only
directory and points ``UDOCKER_BIN``/``UDOCKER_LIB`` at it (see :func:`.spec.udocker_env`)."""
from __future__ import annotations

import argparse
import glob
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import resources

from .errors import ToolsMissing

#: The lowest tools release udocker 1.3 accepts (``lib/VERSION``).
TOOLS_RELEASE = "1.2.11"
_WRAPPER_SOURCE = "proot_wrapper.c"


def tool_names(arch: str | None = None) -> dict[str, str]:
    """File names udocker looks for in its ``bin``/``lib`` directories on this architecture (kernel >= 4.8)."""
    arch = arch or {"x86_64": "x86_64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return {
        "proot": f"bin/proot-{arch}-4_8_0",
        "runc": f"bin/runc-{arch}",
        "patchelf": f"bin/patchelf-{arch}",
        "fakechroot": "lib/libfakechroot.so",
        "version": "lib/VERSION",
    }


def _find_fakechroot() -> str:
    found = glob.glob("/usr/lib/*/fakechroot/libfakechroot.so") + glob.glob("/usr/lib*/fakechroot/libfakechroot.so")
    if not found:
        raise ToolsMissing("libfakechroot.so not found: install the distribution's libfakechroot package")
    return found[0]


def _need(path: str | None, package: str) -> str:
    if not path or not os.path.exists(path):
        raise ToolsMissing(f"{path or package} not found: install the distribution's {package} package")
    return path


def build_tools_tarball(
    out: str,
    proot: str | None = None,
    runc: str | None = None,
    patchelf: str | None = None,
    fakechroot: str | None = None,
    cc: str = "cc",
) -> str:
    """Write a udocker tools tarball (``udocker_dir/{bin,lib,doc}``) to ``out`` from the host's binaries."""
    proot = _need(proot or shutil.which("proot"), "proot")
    runc = _need(runc or shutil.which("runc"), "runc")
    patchelf = _need(patchelf or shutil.which("patchelf"), "patchelf")
    fakechroot = _need(fakechroot or _find_fakechroot(), "libfakechroot")
    if not shutil.which(cc):
        raise ToolsMissing(f"C compiler {cc!r} not found: install gcc (build-essential) to build the proot wrapper")
    names = tool_names()
    with tempfile.TemporaryDirectory() as tmp:
        top = os.path.join(tmp, "udocker_dir")
        for sub in ("bin", "lib", "doc"):
            os.makedirs(os.path.join(top, sub))
        wrapper = os.path.join(top, names["proot"])
        source = resources.files(__package__).joinpath(_WRAPPER_SOURCE)
        with resources.as_file(source) as src:
            subprocess.run([cc, "-O2", "-o", wrapper, str(src)], check=True)
        shutil.copy2(proot, wrapper + ".real")
        shutil.copy2(runc, os.path.join(top, names["runc"]))
        shutil.copy2(patchelf, os.path.join(top, names["patchelf"]))
        shutil.copy2(fakechroot, os.path.join(top, names["fakechroot"]))
        with open(os.path.join(top, names["version"]), "w") as f:
            f.write(TOOLS_RELEASE + "\n")
        with open(os.path.join(top, "doc", "README.hpcdl"), "w") as f:
            f.write("udocker tools assembled by jupyter-hpcdl from distribution packages:\n"
                    f"proot {proot} (wrapped), runc {runc}, patchelf {patchelf}, {fakechroot}\n")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        partial = out + ".partial"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(top, arcname="udocker_dir")
        os.replace(partial, out)
    return out


def install_tools(tarball: str, tools_dir: str) -> str:
    """Unpack a tools tarball into ``tools_dir/{bin,lib,doc}`` (replacing what was there), readable by all."""
    staging = tempfile.mkdtemp(prefix=".tools-", dir=os.path.dirname(os.path.abspath(tools_dir)) or ".")
    try:
        with tarfile.open(tarball) as tar:
            if hasattr(tarfile, "tar_filter"):  # Python >= 3.11.4 and security backports
                tar.extractall(staging, filter="tar")
            else:
                tar.extractall(staging)
        src = os.path.join(staging, "udocker_dir")
        os.makedirs(tools_dir, exist_ok=True)
        for sub in ("bin", "lib", "doc"):
            dest = os.path.join(tools_dir, sub)
            if os.path.exists(dest):
                shutil.rmtree(dest)
            os.rename(os.path.join(src, sub), dest)
            os.chmod(dest, 0o755)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    check_tools(tools_dir)
    return tools_dir


def check_tools(tools_dir: str) -> str:
    """Raise :class:`ToolsMissing` unless ``tools_dir`` holds usable udocker tools."""
    names = tool_names()
    missing = [n for n in ("proot", "version") if not os.path.exists(os.path.join(tools_dir, names[n]))]
    if missing:
        raise ToolsMissing(
            f"udocker tools missing in {tools_dir} ({', '.join(names[n] for n in missing)}): "
            f"build them with 'hpcdl-udocker-tools build tools.tar.gz' and 'hpcdl-udocker-tools install tools.tar.gz {tools_dir}'"
        )
    return tools_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpcdl-udocker-tools", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="assemble a tools tarball from the host's proot, runc, patchelf, libfakechroot")
    b.add_argument("out")
    i = sub.add_parser("install", help="unpack a tools tarball into a shared directory")
    i.add_argument("tarball")
    i.add_argument("tools_dir")
    c = sub.add_parser("check", help="check a tools directory")
    c.add_argument("tools_dir")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            print(build_tools_tarball(args.out))
        elif args.cmd == "install":
            print(install_tools(args.tarball, args.tools_dir))
        else:
            print(check_tools(args.tools_dir))
    except ToolsMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
