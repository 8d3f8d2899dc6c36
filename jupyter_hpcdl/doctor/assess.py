"""From a node's facts to findings, each with what to do: pure, so every message is tested on recorded facts."""
from __future__ import annotations

from dataclasses import dataclass, field

from jupyter_hpcdl.backends import load_backend
from jupyter_hpcdl.containers.spec import FAST_MODE

from .facts import ImageFacts, NodeFacts
from .report import FAIL, OK, SKIP, WARN, Finding

@dataclass(frozen=True)
class Expected:
    """What the kernel side on the hub host's environment expects of the image."""

    hpcdl_version: str
    pinned: str | None  # the training backend's pinned framework release, e.g. Horovod's "0.28.1"
    #: Images the catalogue marks as having no training stack (``"training": false``): kernels run in them (on the
    #: host's environment, bound in), training ranks do not, so their stack is not checked.
    without_stack: frozenset[str] = frozenset()
    #: The pinned release of each other backend an image of the catalogue names (``pinned`` is the site's default's).
    pins: dict[str, str | None] = field(default_factory=dict)


def hub_callback(f: NodeFacts) -> Finding:
    if not f.hub_error:
        how = f"HTTP {f.hub_status}" if f.hub_status else "TLS, internal_ssl"
        return Finding("hub callback", OK, f"{f.hub_url} answers from the node ({how})", where=f.node)
    return Finding("hub callback", FAIL, f"{f.hub_url} is not reachable from {f.node}: {f.hub_error}",
                   "jobs report to this URL: set c.JupyterHub.hub_connect_ip (or hub_connect_url) to an address of the "
                   "hub host that compute nodes reach, and open its port between them", where=f.node)


def gpus(f: NodeFacts, images: tuple[ImageFacts, ...]) -> list[Finding]:
    if f.gpus_requested == 0:
        return [Finding("GPUs", SKIP, "the doctor's job asked for no GPU", where=f.node)]
    seen = [d for d in (f.cuda_visible_devices or "").split(",") if d.strip()]
    if len(seen) != f.gpus_requested:
        how = "unset" if f.cuda_visible_devices is None else repr(f.cuda_visible_devices)
        return [Finding("GPUs", FAIL, f"the job asked for {f.gpus_requested} GPU(s) but CUDA_VISIBLE_DEVICES is "
                        f"{how} on {f.node}",
                        "make the batch system bind GPUs to jobs (Slurm: GresTypes=gpu, Gres=gpu:N on the node, "
                        "gres.conf with File=/dev/nvidia*; Grid Engine, which has no GPU binding of its own: a gpu "
                        "consumable and a queue starter_method or prolog that sets CUDA_VISIBLE_DEVICES, as the test "
                        "bed's testbed/sge-gpu-starter.sh)", where=f.node)]
    found = [Finding("GPUs", OK, f"{len(seen)} GPU(s) bound to the job: CUDA_VISIBLE_DEVICES={f.cuda_visible_devices}",
                     where=f.node)]
    for img in images:
        inside = img.versions.get("cuda_visible_devices") if img.versions else None
        if img.versions and inside != f.cuda_visible_devices:
            found.append(Finding("GPUs", FAIL, f"{img.ref}: the container sees CUDA_VISIBLE_DEVICES={inside!r}, the job "
                                 f"{f.cuda_visible_devices!r}", "pass CUDA_VISIBLE_DEVICES into containers by name "
                                 "(hpcdl-containers run -e CUDA_VISIBLE_DEVICES)", where=f.node))
    return found


def nvidia(f: NodeFacts, images: tuple[ImageFacts, ...]) -> list[Finding]:
    if not f.nvidia_driver:
        return [Finding("NVIDIA libraries", SKIP, f"no NVIDIA driver libraries (libcuda) on {f.node}: nothing for "
                        "udocker setup --nvidia to copy", where=f.node)]
    found = []
    for img in images:
        if img.nvidia_error:
            found.append(Finding("NVIDIA libraries", FAIL, f"{img.ref}: udocker setup --nvidia failed: {img.nvidia_error}",
                                 "the driver's user-space libraries (libcuda.so*, libnvidia-*) must be readable by users; "
                                 "run the doctor again after a driver update", where=f.node))
        elif img.nvidia_error == "":
            ok = "GPU " in img.nvidia_smi
            found.append(Finding("NVIDIA libraries", OK if ok else FAIL,
                                 f"{img.ref}: nvidia-smi in the container: {img.nvidia_smi or 'no output'}",
                                 "" if ok else "the container has the driver's libraries but sees no GPU: check that "
                                 "/dev/nvidia* are visible in jobs", where=f.node))
    return found


def _version_findings(img: ImageFacts, expect: Expected, node: str) -> list[Finding]:
    v = img.versions
    if img.ref in expect.without_stack:
        return [Finding("image versions", OK, f"{img.ref}: Python {v.get('python')}; marked as without the training "
                        "stack in the catalogue (kernels only), so TensorFlow, Horovod and the rest are not checked",
                        where=node)]
    out = []
    have = v.get("jupyter-hpcdl")
    if have != expect.hpcdl_version:
        out.append(Finding("image versions", FAIL, f"{img.ref} has jupyter-hpcdl {have or 'not installed'}, the hub host "
                           f"{expect.hpcdl_version}", f"rebuild and publish {img.ref} with jupyter-hpcdl "
                           f"{expect.hpcdl_version} (docs/admin.md, 'The image')", where=node))
    backends = [load_backend(name) for name in v.get("backends") or [None]]  # what the catalogue says it holds
    levels = {"fail": FAIL, "warn": WARN}
    out += [Finding("image versions", levels[f.level], f.message, f.fix, where=node)
            for backend in backends
            for f in backend.assess_stack(v, img.ref, expect.pins.get(backend.name, expect.pinned))]
    missing = [n for n in ("ipykernel", "ipyparallel") if not v.get(n)]
    if missing:
        out.append(Finding("image versions", FAIL, f"{img.ref} lacks {', '.join(missing)} (kernels and ranks run in "
                           "the container)", f"install {' '.join(missing)} in the image", where=node))
    if not out:
        out.append(Finding("image versions", OK, f"{img.ref}: Python {v.get('python')}, "
                           f"{', '.join(backend.stack_summary(v) for backend in backends)}, "
                           f"jupyter-hpcdl {have}, ipykernel {v.get('ipykernel')}, ipyparallel "
                           f"{v.get('ipyparallel')}", where=node))
    return out


def image(img: ImageFacts, expect: Expected, node: str, registry: str | None) -> list[Finding]:
    if img.pull_error:
        return [Finding("image", FAIL, f"{img.ref} is not in the user's udocker repository and could not be pulled "
                        f"from {registry or 'the registry'}: {img.pull_error}",
                        f"publish {img.ref} to the site's registry (or fix its name in c.SiteProfile.images), or have "
                        f"users run 'hpcdl-containers pull {img.ref}'", where=node)]
    if img.error:
        return [Finding("image", FAIL, f"{img.ref} does not start: {img.error}",
                        f"try 'hpcdl-containers run {img.ref} -- python3 -c pass' on a node as the user; rebuild or "
                        "re-pull the image if its layers are damaged ('hpcdl-containers verify')", where=node)]
    how = "present" if img.present else "pulled from the registry"
    found = [Finding("image", OK, f"{img.ref}: {how}, starts (container {img.container})", where=node)]
    if img.container_mode:
        fast = img.container_mode == FAST_MODE
        where_runs = "on the fast path (user namespaces, no ptrace)" if fast else f"in {img.container_mode}"
        found.append(Finding("container mode", OK if fast else WARN,
                             f"{img.ref} runs {where_runs}: {img.container_mode_reason}",
                             "" if fast else "unprivileged user namespaces would make containers run at native speed "
                             "(sysctl user.max_user_namespaces > 0; docs/containers.md)", where=node))
    return found + _version_findings(img, expect, node)


def assess_node(f: NodeFacts, expect: Expected, registry: str | None = None) -> list[Finding]:
    found = [hub_callback(f)]
    if f.udocker_error:
        found.append(Finding("udocker", FAIL, f"udocker on {f.node}: {f.udocker_error}",
                             "install udocker in the nodes' environment (pip install udocker) and its engine tools "
                             "shared (hpcdl-udocker-tools build, then install into the site's tools_dir)", where=f.node))
        found.append(Finding("images", SKIP, "not checked: udocker does not work", where=f.node))
    else:
        found.append(Finding("udocker", OK, f"{f.udocker_version}, tools in {f.tools_dir or '~/.udocker'}, mode "
                             f"{f.mode}, no download", where=f.node))
        for img in f.images:
            found += image(img, expect, f.node, registry)
    found += gpus(f, f.images)
    found += nvidia(f, f.images)
    return found
