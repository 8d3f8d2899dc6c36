"""Kernels and training ranks in alice's container in each mode: on the fast path (user namespaces, the bed's
default) and in P1 (the site's fast_path turned off by configuration). A Jupyter kernel from the containerized
kernelspec runs as alice, says its mode, is interrupted and shuts down leaving nothing; two ranks in containers join
one world, train, and report their mode. (The hub and browser tests run kernels in the bed's default mode.)"""
import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import user_processes

pytestmark = pytest.mark.testbed

CODE = r'''
import json
out = {}
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard
with TrainingSession(ranks=2, where="local", containers=True, start_timeout=180) as s:
    out["ranks"] = sorted(w["container_mode"] for w in s.world)
    s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    out["epochs"] = s.fit(epochs=1).epochs_done
print(json.dumps(out))
'''


MODES = [("auto", "userns"), ("off", "P1")]  # the site's fast_path -> the mode containers run in on the bed


@contextlib.contextmanager
def site_with(bed, alice, fast_path: str) -> Iterator[Path]:
    """A copy of the bed's site file with ``fast_path`` set, readable by alice."""
    site = json.loads(Path(bed["site_config"]).read_text())
    site.setdefault("ContainerSite", {})["fast_path"] = fast_path
    config = alice.write(Path(alice.home) / f"hpcdl-site-{fast_path}.json", json.dumps(site))
    try:
        yield config
    finally:
        os.unlink(config)


KERNEL_CODE = r'''
import json, os, sys, time, uuid
from jupyter_client.manager import KernelManager
from jupyter_hpcdl.containers.kernelspec import container_kernelspec, write_kernelspec

kernels = os.path.join(sys.argv[1], "kernels")
write_kernelspec(kernels, "hpcdl-mode", container_kernelspec(sys.argv[2], sys.executable))
os.environ["JUPYTER_PATH"] = sys.argv[1]
# in alice's home, as Jupyter Server's runtime dir is (a plain KernelManager would use the host's /tmp)
km = KernelManager(kernel_name="hpcdl-mode",
                   connection_file=os.path.join(sys.argv[1], f"kernel-{uuid.uuid4()}.json"))
km.start_kernel()
kc = km.client()
kc.start_channels()
out = {}
try:
    kc.wait_for_ready(timeout=120)
    said = []
    kc.execute_interactive("import os; print(os.environ['HPCDL_CONTAINER_MODE'], os.getuid(), "
                           "open('/etc/hpcdl-image.json').read().strip() != '')",
                           timeout=60, output_hook=lambda m: said.append(m["content"].get("text", "")))
    out["said"] = "".join(said).split()
    kc.execute("import time; print('sleeping', flush=True); time.sleep(120)")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the cell runs, so the interrupt meets it
        m = kc.get_iopub_msg(timeout=30)
        if m["msg_type"] == "stream" and "sleeping" in m["content"]["text"]:
            break
    t0 = time.monotonic()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=30)
    while reply["msg_type"] != "execute_reply" or reply["content"]["status"] == "ok":
        reply = kc.get_shell_msg(timeout=30)
    out["interrupted"] = reply["content"].get("ename")
    out["interrupt_s"] = time.monotonic() - t0
    kc.execute_interactive("print('alive', flush=True)", timeout=30)  # the same kernel goes on
    out["connection_file"] = km.connection_file
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=False)
print(json.dumps(out))
'''


@pytest.mark.timing
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fast_path, mode", MODES)
def test_a_kernel_runs_is_interrupted_and_shuts_down_in_each_mode(bed, alice, fast_path, mode):
    where = alice.tmpdir()
    try:
        with site_with(bed, alice, fast_path) as config:
            r = alice.run(bed["venv"] + "/bin/python", "-c", KERNEL_CODE, str(where), bed["image"], timeout=240,
                          HPCDL_SITE_CONFIG=str(config))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["said"] == [mode, str(alice.uid), "True"], "the kernel is not in alice's container in " + mode
        assert out["interrupted"] == "KeyboardInterrupt" and out["interrupt_s"] < 20, out
        kernel_id = Path(out["connection_file"]).stem
        deadline = time.monotonic() + 20
        while left := [" ".join(p.info["cmdline"] or []) for p in user_processes("alice")
                       if kernel_id in " ".join(p.info["cmdline"] or [])]:
            assert time.monotonic() < deadline, f"left after the kernel's shutdown: {left}"
            time.sleep(0.5)
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fast_path, mode", MODES)
def test_ranks_run_in_each_mode(bed, alice, fast_path, mode):
    with site_with(bed, alice, fast_path) as config:
        r = alice.run(alice.bed["venv"] + "/bin/python", "-c", CODE, timeout=560, HPCDL_SITE_CONFIG=str(config))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ranks"] == [mode, mode] and out["epochs"] == 1


def test_a_second_start_takes_the_front_door_and_a_changed_site_the_full_path_again(bed, alice):
    """``hpcdl-containers run``: the first start on a node resolves everything (the site's settings: traitlets);
    the next of the same shape starts from what it resolved, without those imports, with the same environment
    by name, working directory, exit code and stderr apart; a change of the site's file sends it the full way
    again (``python -X importtime`` shows what a start imported)."""
    site = json.loads(Path(bed["site_config"]).read_text())
    config = alice.write(Path(alice.home) / "hpcdl-site-front.json", json.dumps(site))
    code = ("import os, sys; print(os.environ['HPCDL_CONTAINER_MODE'], os.environ.get('HPCDL_PROBE'), os.getcwd()); "
            "print('to stderr', file=sys.stderr); sys.exit(int(os.environ['HPCDL_PROBE']))")

    def start(probe: str):
        return alice.run(bed["venv"] + "/bin/python", "-X", "importtime", "-m", "jupyter_hpcdl.containers", "run",
                         "-e", "HPCDL_PROBE", bed["image"], "--", "python3", "-c", code, timeout=120,
                         HPCDL_SITE_CONFIG=str(config), HPCDL_PROBE=probe)

    try:
        first, second = start("3"), start("4")
        config.write_text(json.dumps(site) + "\n")  # the same settings, a new stamp
        third = start("5")
    finally:
        os.unlink(config)
    for r, probe in ((first, "3"), (second, "4"), (third, "5")):
        assert r.returncode == int(probe), r.stderr[-2000:]
        assert r.stdout.split() == ["userns", probe, alice.home] and "to stderr" in r.stderr, r.stdout
    imported = [{line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
                for r in (first, second, third)]
    assert "traitlets" in imported[0] and "traitlets" in imported[2], "the full path resolves the site"
    assert "traitlets" not in imported[1] and "jupyter_hpcdl.containers.quickstart" in imported[1], \
        "the second start resolved everything again"
