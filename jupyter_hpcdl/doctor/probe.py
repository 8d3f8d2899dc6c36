"""The doctor's job on a compute node: ``python -m jupyter_hpcdl.doctor.probe REQUEST.json``. It gathers facts (no
verdicts: see assess.py) and writes them atomically next to the request. Every step has a deadline."""
from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, replace
from typing import Sequence
from pathlib import Path

from jupyter_hpcdl.containers.errors import ContainerError
from jupyter_hpcdl.containers.nvidia import host_has_nvidia
from jupyter_hpcdl.containers.site import load_site
from jupyter_hpcdl.containers.spec import RunSpec, udocker_base
from jupyter_hpcdl.containers.udocker import Udocker
from jupyter_hpcdl.atomic import atomic_write
from jupyter_hpcdl.backends import load_backend

from .facts import ImageFacts, NodeFacts, ProbeRequest, request_from_json

def check_hub(url: str, timeout: float) -> tuple[int, str]:
    """(HTTP status, "") when the hub's API answers at ``url``, else (0, why). With JupyterHub's ``internal_ssl``
    the hub answers only a client with a certificate of its CA, which the doctor has not: a hub that asks for one
    (a TLS handshake refused for want of a certificate) answers, as (0, "")."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return (e.code, "") if e.code < 500 else (e.code, f"HTTP {e.code} {e.reason}")
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLError) and url.startswith("https:"):
            return 0, ""  # a TLS server answered (unverified by the doctor: no client certificate, no CA)
        return 0, str(reason)


def probe_image(ud: Udocker, ref: str, registry: str | None, timeout: float,
                backends: Sequence[str] = ()) -> ImageFacts:
    """Pull (where needed) and start ``ref``, and run the probe of each of ``backends`` (the site's default where
    none is named) in it."""
    facts = ImageFacts(ref)
    try:
        facts = replace(facts, present=ud.has_image(ref))
        if not facts.present:
            try:
                ud.pull(ref, registry)
                facts = replace(facts, pull_error="")
            except ContainerError as e:
                return replace(facts, pull_error=str(e))
        nvidia = host_has_nvidia()
        facts = replace(facts, container=ud.ensure_container(ref, nvidia=False))
        if nvidia:
            try:
                ud.setup_nvidia(facts.container)
                facts = replace(facts, nvidia_error="")
            except ContainerError as e:
                facts = replace(facts, nvidia_error=str(e))
        try:
            decision = ud.mode_for(facts.container)
            facts = replace(facts, container_mode=decision.mode, container_mode_reason=decision.reason)
        except ContainerError as e:
            facts = replace(facts, container_mode="none", container_mode_reason=str(e))
        env = ["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in os.environ else []
        versions: dict = {}
        for backend in (load_backend(name) for name in (backends or [None])):  # each stack the image should hold
            done = ud.run(RunSpec(facts.container, ["python3", "-c", backend.probe_script], env_names=env),
                          timeout=timeout)
            line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("HPCDL-VERSIONS ")), None)
            if done.returncode or line is None:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                return replace(facts, error=f"python3 in the container exited {done.returncode}: {' / '.join(tail)}")
            versions.update(json.loads(line.split(" ", 1)[1]))
        facts = replace(facts, versions={**versions, "backends": list(backends)})
        if nvidia and facts.nvidia_error == "":
            smi = ud.run(RunSpec(facts.container, ["nvidia-smi", "-L"], env_names=env), timeout=timeout)
            facts = replace(facts, nvidia_smi=(smi.stdout or smi.stderr).strip()[:1000])
    except subprocess.TimeoutExpired as e:
        return replace(facts, error=f"the container did not finish {e.cmd[-1] if e.cmd else 'its command'!r:.40} "
                                    f"in {e.timeout:.0f} s")
    except ContainerError as e:
        return replace(facts, error=str(e))
    return facts


def probe(req: ProbeRequest) -> NodeFacts:
    status, hub_error = check_hub(req.hub_url, timeout=min(10.0, req.step_timeout))
    facts = NodeFacts(node=socket.gethostname(), nonce=req.nonce, hub_url=req.hub_url, hub_status=status,
                      hub_error=hub_error, gpus_requested=req.gpus,
                      cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), nvidia_driver=host_has_nvidia())
    facts = replace(facts, node=os.environ.get("SLURMD_NODENAME") or facts.node)
    try:
        site = load_site(req.site_config)
        ud = Udocker(site.install(), site.policy(), timeout=req.step_timeout)
        facts = replace(facts, tools_dir=site.tools_dir, mode=site.execution_mode)
        ud.check_available()
        version = subprocess.run(udocker_base(ud.install) + ["--version"], env=ud.env(), capture_output=True,
                                 text=True, timeout=req.step_timeout)
        if version.returncode:
            raise ContainerError(f"'udocker --version' exited {version.returncode}: {version.stderr.strip()[-300:]}")
        facts = replace(facts, udocker_version=next((x for x in version.stdout.splitlines() if "version" in x.lower()),
                                                    version.stdout.strip()[:80]))
    except subprocess.TimeoutExpired as e:
        return replace(facts, udocker_error=f"'udocker --version' did not finish in {e.timeout:.0f} s (is it trying "
                                            "to download its tools?)")
    except (ContainerError, FileNotFoundError, ValueError) as e:
        return replace(facts, udocker_error=str(e))
    images = tuple(probe_image(ud, ref, site.registry, req.step_timeout, req.backends.get(ref, ()))
                   for ref in req.images)
    return replace(facts, images=images)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m jupyter_hpcdl.doctor.probe REQUEST.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            req = request_from_json(f.read())
    except OSError as e:
        print(f"hpcdl-doctor probe on {socket.gethostname()}: cannot read the request {argv[0]} ({e.strerror}): "
              "is the home directory shared with the hub host, at the same path?", file=sys.stderr)
        return 3
    facts = probe(req)
    try:
        atomic_write(req.result, lambda tmp: Path(tmp).write_text(facts.to_json()))
    except OSError as e:
        print(f"hpcdl-doctor probe on {facts.node}: cannot write {req.result} ({e.strerror})", file=sys.stderr)
        print(json.dumps(asdict(facts)))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
