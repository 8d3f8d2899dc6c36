"""The test bed's container images, built here without Docker Hub: a Debian root file system (mmdebstrap), the shared
Python environment (TensorFlow, Horovod, ipykernel, ipyparallel) and jupyter-hpcdl, as three OCI layers (umoci),
pushed to the registry on loopback (skopeo) as ``hpcdl/base``; ``hpcdl/torch`` is the same with PyTorch (from the
same environment) as a fourth layer below jupyter-hpcdl's. Each layer is rebuilt only when what it is made of
changes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

IMAGE = "hpcdl/base"
OS_IMAGE = "hpcdl/os"
TORCH_IMAGE = "hpcdl/torch"
SUITE = "bookworm"
OS_PACKAGES = ("python3", "libopenmpi3", "openmpi-bin", "procps", "ca-certificates")
IDENTITY_FILE = "etc/hpcdl-image.json"
#: PyTorch's part of the shared environment (about 750 MB installed): its own layer, in ``hpcdl/torch`` only, so
#: that the users who train with Horovod pull no more than before.
TORCH_PARTS = ("torch", "torch-*", "torchgen", "functorch")


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def project_wheel(cache: Path) -> Path:
    """The jupyter-hpcdl wheel that testbed/install.sh built (the app layer installs it, as a site would)."""
    found = sorted((cache / "dist").glob("jupyter_hpcdl-*.whl"))
    if not found:
        raise FileNotFoundError(f"no jupyter-hpcdl wheel in {cache / 'dist'}: run testbed/install.sh first")
    return found[-1]


def _run(argv: list[str], **kw) -> None:
    subprocess.run(argv, check=True, **kw)


def os_layer(cache: Path) -> tuple[Path, str]:
    key = _sha(SUITE, *OS_PACKAGES)[:16]
    out = cache / f"os-{key}.tar"
    if not out.exists():
        partial = out.with_suffix(".partial.tar")
        _run(["mmdebstrap", "--quiet", "--mode=root", "--variant=minbase", f"--include={','.join(OS_PACKAGES)}",
              SUITE, str(partial)])
        partial.rename(out)
    return out, key


def venv_layer(cache: Path, venv: Path) -> tuple[Path, str]:
    """The shared environment, at the same path as on the host, without jupyter-hpcdl itself (its own layer)."""
    freeze = subprocess.run([str(venv / "bin/python"), "-m", "pip", "--disable-pip-version-check", "freeze", "--all",
                             "--exclude", "jupyter-hpcdl"], check=True, capture_output=True, text=True).stdout
    key = _sha(str(venv), freeze)[:16]
    out = cache / f"venv-{key}.tar"
    if not out.exists():
        for old in cache.glob("venv-*.tar"):  # one environment layer is cached at a time
            old.unlink()
        partial = out.with_suffix(".partial.tar")
        site = next((venv / "lib").glob("python3*/site-packages")).relative_to("/")
        bin_dir = (venv / "bin").relative_to("/")
        _run(["tar", "-C", "/", f"--exclude={site}/jupyter_hpcdl", f"--exclude={site}/jupyter_hpcdl-*",
              f"--exclude={bin_dir}/hpcdl-*", *(f"--exclude={site}/{name}" for name in TORCH_PARTS),
              f"--exclude={bin_dir}/torch*", "-cf", str(partial), str(venv.relative_to("/"))])
        partial.rename(out)
    return out, key


def torch_layer(cache: Path, venv: Path) -> tuple[Path, str] | None:
    """PyTorch from the shared environment, at the same path (None where it has none)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    found = sorted(p for name in TORCH_PARTS for p in site.glob(name))
    dist = [p for p in found if p.name.endswith(".dist-info")]
    if not dist:
        return None
    key = _sha(str(venv), *(p.name for p in found))[:16]
    out = cache / f"torch-{key}.tar"
    if not out.exists():
        for old in cache.glob("torch-*.tar"):
            old.unlink()
        partial = out.with_suffix(".partial.tar")
        scripts = sorted(str(p.relative_to("/")) for p in (venv / "bin").glob("torch*"))
        _run(["tar", "-C", "/", "-cf", str(partial), *(str(p.relative_to("/")) for p in found), *scripts])
        partial.rename(out)
    return out, key


def app_layer(work: Path, venv: Path, wheel: Path, identity: dict) -> Path:
    """jupyter-hpcdl installed from its wheel into the environment's path, and the image's identity file."""
    stage = work / "app"
    shutil.rmtree(stage, ignore_errors=True)
    _run([str(venv / "bin/python"), "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps",
          "--no-compile", "--ignore-installed", "--no-warn-script-location",
          "--root", str(stage), str(wheel)], cwd=str(work))
    (stage / IDENTITY_FILE).parent.mkdir(parents=True, exist_ok=True)
    (stage / IDENTITY_FILE).write_text(json.dumps(identity) + "\n")
    out = work / "app.tar"
    with tarfile.open(out, "w") as tar:
        for top in sorted(os.listdir(stage)):
            tar.add(stage / top, arcname=top)
    return out


def build(cache: Path, venv: Path, wheel: Path, registry: str, state_file: Path) -> dict:
    """Build (where needed) and push ``hpcdl/base:latest``, ``hpcdl/torch:latest`` (where the environment has
    PyTorch) and ``hpcdl/os:latest``; return the build's identity."""
    cache.mkdir(parents=True, exist_ok=True)
    os_tar, os_key = os_layer(cache)
    venv_tar, venv_key = venv_layer(cache, venv)
    torch_found = torch_layer(cache, venv)
    torch_key = torch_found[1] if torch_found else None
    build_id = _sha(os_key, venv_key, str(torch_key), wheel.read_bytes())[:16]
    identity = {"image": IMAGE, "build": build_id, "os": os_key, "venv": venv_key, "torch": torch_key}
    try:
        if json.loads(state_file.read_text()) == identity:
            return identity
    except (FileNotFoundError, ValueError):
        pass
    layout = cache / "oci"
    if not layout.exists():
        _run(["umoci", "init", "--layout", str(layout)])
    tags = subprocess.run(["umoci", "ls", "--layout", str(layout)], check=True, capture_output=True, text=True).stdout.split()
    os_tag, stack_tag, final_tag = f"os-{os_key}", f"stack-{os_key}-{venv_key}", f"base-{build_id}"
    env = [f"--config.env=PATH={venv}/bin:/usr/local/bin:/usr/bin:/bin", "--config.env=LANG=C.UTF-8"]
    if os_tag not in tags:
        _run(["umoci", "new", "--image", f"{layout}:{os_tag}"])
        _run(["umoci", "raw", "add-layer", "--image", f"{layout}:{os_tag}", str(os_tar)])
        _run(["umoci", "config", "--image", f"{layout}:{os_tag}", *env, "--config.cmd=/bin/bash"])
    if stack_tag not in tags:
        _run(["umoci", "raw", "add-layer", "--image", f"{layout}:{os_tag}", "--tag", stack_tag, str(venv_tar)])
    finals = [(final_tag, stack_tag, IMAGE)]
    if torch_found:
        torch_tag = f"torch-{os_key}-{venv_key}-{torch_key}"
        if torch_tag not in tags:
            _run(["umoci", "raw", "add-layer", "--image", f"{layout}:{stack_tag}", "--tag", torch_tag,
                  str(torch_found[0])])
        finals.append((f"torchbase-{build_id}", torch_tag, TORCH_IMAGE))
    for tag, below, name in finals:
        with tempfile.TemporaryDirectory(dir=cache) as work:
            app_tar = app_layer(Path(work), venv, wheel, {**identity, "image": name})
            _run(["umoci", "raw", "add-layer", "--image", f"{layout}:{below}", "--tag", tag, str(app_tar)])
        _run(["umoci", "config", "--image", f"{layout}:{tag}", "--config.label=org.jupyter-hpcdl.build=" + build_id,
              f"--config.cmd={venv}/bin/python3"])
    for tag in tags:  # earlier builds' tags, then their unreferenced blobs
        if tag.startswith(("base-", "torchbase-")) and tag not in {t for t, _, _ in finals}:
            _run(["umoci", "rm", "--image", f"{layout}:{tag}"])
    _run(["umoci", "gc", "--layout", str(layout)])
    for tag, name in [*((t, n) for t, _, n in finals), (os_tag, OS_IMAGE)]:
        _run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:{tag}",
              f"docker://{registry}/{name}:latest"])
    # A plain OCI archive of the small OS image, for tests of `udocker load`.
    archive = cache / "os-oci.tar"
    _run(["skopeo", "copy", "--quiet", f"oci:{layout}:{os_tag}", f"oci-archive:{archive}.partial:{OS_IMAGE}:latest"])
    os.replace(f"{archive}.partial", archive)
    state_file.write_text(json.dumps(identity) + "\n")
    return identity
