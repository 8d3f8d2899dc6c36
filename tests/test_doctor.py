"""hpcdl-doctor: each finding's message from recorded facts (pure), and on the bed, a healthy site passes while each
piece broken in turn (the hub URL, an image, udocker's tools, the shared directory, the controller, the image's
stack) is found and said with what to do."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from traitlets.config import Config

from jupyter_hpcdl.doctor.assess import Expected, assess_node
from jupyter_hpcdl.doctor.cli import hub_api_url
from jupyter_hpcdl.doctor.facts import ImageFacts, NodeFacts, facts_from_json, request_from_json
from jupyter_hpcdl.doctor.report import FAIL, OK, SKIP, WARN, Finding, exit_code, render_json, render_text

EXPECT = Expected(hpcdl_version="0.1.0", pinned="0.28.1")
GOOD_VERSIONS = {"python": "3.11.2", "jupyter-hpcdl": "0.1.0", "tensorflow": None, "tensorflow-cpu": "2.15.1",
                 "horovod": "0.28.1", "ipykernel": "7.4.0", "ipyparallel": "9.2.0", "horovod_tf_error": "",
                 "tf_use_legacy_keras": None, "cuda_visible_devices": "0,1"}
GOOD_IMAGE = ImageFacts("hpcdl/base:latest", present=True, container="c1", versions=GOOD_VERSIONS)
GOOD = NodeFacts(node="node1", nonce="n", hub_url="http://10.0.0.1:8081/hub/api", hub_status=200, gpus_requested=2,
                 cuda_visible_devices="0,1", udocker_version="version: 1.3.17", tools_dir="/opt/t", mode="P1",
                 images=(GOOD_IMAGE,))


def by_check(findings: list[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.check == check]


def only(findings: list[Finding], check: str) -> Finding:
    (f,) = by_check(findings, check)
    return f


def failed(findings):
    return [f for f in findings if f.status == FAIL]


def with_versions(**changes) -> NodeFacts:
    return replace(GOOD, images=(replace(GOOD_IMAGE, versions={**GOOD_VERSIONS, **changes}),))


# -- pure: recorded facts -> findings --------------------------------------------------------------------------------
def test_healthy_node_passes_every_check():
    findings = assess_node(GOOD, EXPECT)
    assert not failed(findings) and exit_code(findings) == 0
    assert only(findings, "NVIDIA libraries").status == SKIP
    assert "TensorFlow 2.15.1, Horovod 0.28.1" in only(findings, "image versions").message


def test_unreachable_hub_names_the_url_and_the_setting():
    f = only(assess_node(replace(GOOD, hub_error="[Errno 111] Connection refused", hub_status=0), EXPECT),
             "hub callback")
    assert f.status == FAIL and "http://10.0.0.1:8081/hub/api" in f.message and "node1" in f.message
    assert "hub_connect_ip" in f.fix


def test_gpus_not_bound_by_the_scheduler():
    f = only(assess_node(replace(GOOD, cuda_visible_devices=None), EXPECT), "GPUs")
    assert f.status == FAIL and "asked for 2 GPU(s) but CUDA_VISIBLE_DEVICES is unset" in f.message
    assert "gres.conf" in f.fix
    f = only(assess_node(replace(GOOD, cuda_visible_devices="0"), EXPECT), "GPUs")
    assert f.status == FAIL and "'0'" in f.message


def test_gpus_not_passed_into_the_container():
    findings = by_check(assess_node(with_versions(cuda_visible_devices=None), EXPECT), "GPUs")
    assert [f.status for f in findings] == [OK, FAIL]
    assert "-e CUDA_VISIBLE_DEVICES" in findings[1].fix


def test_nvidia_setup_failure_and_success():
    broken = replace(GOOD, nvidia_driver=True, images=(replace(GOOD_IMAGE, nvidia_error="Error: host nvidia "
                                                                "libraries not found"),))
    f = only(assess_node(broken, EXPECT), "NVIDIA libraries")
    assert f.status == FAIL and "udocker setup --nvidia failed: Error: host nvidia libraries not found" in f.message
    working = replace(GOOD, nvidia_driver=True, images=(replace(GOOD_IMAGE, nvidia_error="",
                                                                 nvidia_smi="GPU 0: NVIDIA H200 (UUID: x)"),))
    assert only(assess_node(working, EXPECT), "NVIDIA libraries").status == OK
    blind = replace(GOOD, nvidia_driver=True, images=(replace(GOOD_IMAGE, nvidia_error="", nvidia_smi="No devices"),))
    assert only(assess_node(blind, EXPECT), "NVIDIA libraries").status == FAIL


@pytest.mark.parametrize("changes, status, words", [
    ({"jupyter-hpcdl": "0.0.9"}, FAIL, "has jupyter-hpcdl 0.0.9, the hub host 0.1.0"),
    ({"jupyter-hpcdl": None}, FAIL, "jupyter-hpcdl not installed"),
    ({"tensorflow-cpu": None}, FAIL, "has no TensorFlow"),
    ({"tensorflow-cpu": "2.17.0"}, FAIL, "Keras 3"),
    ({"tensorflow-cpu": "2.19.1", "tf_use_legacy_keras": "1"}, WARN, "outside what Horovod 0.28.1 is known to build"),
    ({"horovod": None}, FAIL, "has no Horovod"),
    ({"horovod": "0.27.0"}, WARN, "Horovod 0.27.0, jupyter-hpcdl is tested with 0.28.1"),
    ({"horovod_tf_error": "NotFoundError: undefined symbol"}, FAIL, "Horovod does not load with TensorFlow 2.15.1"),
    ({"ipyparallel": None}, FAIL, "lacks ipyparallel"),
])
def test_image_versions_against_what_the_kernel_side_expects(changes, status, words):
    findings = by_check(assess_node(with_versions(**changes), EXPECT), "image versions")
    assert any(f.status == status and words in f.message and f.fix for f in findings), findings


def test_an_image_the_catalogue_marks_without_the_stack_is_not_checked_for_it():
    bare = with_versions(**{"jupyter-hpcdl": None, "tensorflow-cpu": None, "horovod": None, "ipykernel": None,
                            "ipyparallel": None})
    assert failed(by_check(assess_node(bare, EXPECT), "image versions"))  # a training image without its stack fails
    marked = replace(EXPECT, without_stack=frozenset({"hpcdl/base:latest"}))
    f = only(assess_node(bare, marked), "image versions")
    assert f.status == OK and "without the training stack" in f.message


def test_image_not_pullable_or_not_starting():
    nope = replace(GOOD, images=(ImageFacts("hpcdl/nope:latest", pull_error="Error: no files downloaded"),))
    f = only(assess_node(nope, EXPECT, "http://reg:5000"), "image")
    assert f.status == FAIL and "could not be pulled from http://reg:5000" in f.message
    assert "hpcdl-containers pull hpcdl/nope:latest" in f.fix
    broken = replace(GOOD, images=(ImageFacts("hpcdl/base:latest", present=True, error="python3 exited 127"),))
    f = only(assess_node(broken, EXPECT), "image")
    assert f.status == FAIL and "does not start: python3 exited 127" in f.message


def test_udocker_failure_skips_the_images():
    findings = assess_node(replace(GOOD, udocker_error="udocker not found (udocker)"), EXPECT)
    assert only(findings, "udocker").status == FAIL and "pip install udocker" in only(findings, "udocker").fix
    assert only(findings, "images").status == SKIP and not by_check(findings, "image")


def test_reports_for_people_and_scripts():
    findings = [Finding("a", OK, "fine"), Finding("b", FAIL, "broken\nsecond line", "do this", "node2"),
                Finding("c", WARN, "meh", "maybe that")]
    text = render_text(findings)
    assert "[FAIL]  node2  b: broken / second line" in text and "-> do this" in text and "-> maybe that" in text
    assert text.splitlines()[-1] == "3 checks: 1 failed, 1 warnings"
    data = json.loads(render_json(findings))
    assert data["status"] == FAIL and data["findings"][1]["fix"] == "do this"
    assert exit_code(findings) == 1 and exit_code(findings[::2]) == 0


def test_what_a_node_reported_reaches_the_terminal_without_its_control_sequences():
    """A probe runs as a user on a node: its strings may carry escape sequences meant for the admin's terminal."""
    planted = "\x1b[2J\x1b]0;pwned\x07ok\r\x9b1A"
    text = render_text([Finding("udocker", FAIL, f"udocker {planted}", f"fix {planted}", "node\x1b[1m")])
    assert not any(c in text for c in "\x1b\x07\r\x9b"), repr(text)
    assert "-> fix \\x1b[2J\\x1b]0;pwned\\x07ok\\x0d\\x9b1A" in text and "node\\x1b[1m" in text


def test_facts_travel_as_json():
    assert facts_from_json(GOOD.to_json()) == GOOD
    req = request_from_json(json.dumps({"nonce": "x", "hub_url": "u", "result": "/r", "images": ["a:b"], "new": 1}))
    assert req.images == ("a:b",) and req.gpus == 1


def test_hub_api_url_as_jupyterhub_derives_it():
    c = Config()
    assert hub_api_url(c) == "http://127.0.0.1:8081/hub/api"
    c.JupyterHub.hub_ip, c.JupyterHub.hub_port, c.JupyterHub.base_url = "10.1.2.3", 9000, "/jh/"
    assert hub_api_url(c) == "http://10.1.2.3:9000/jh/hub/api"
    c.JupyterHub.hub_connect_ip = "hub.example"
    assert hub_api_url(c) == "http://hub.example:9000/jh/hub/api"
    c.JupyterHub.hub_connect_url = "http://hub.internal:8081/hub/"
    assert hub_api_url(c) == "http://hub.internal:8081/hub/api"


# -- on the bed: a healthy site, then each piece broken in turn --------------------------------------------------------
def doctor(bed, *args: str, timeout: float = 400) -> tuple[int, dict]:
    argv = [f"{bed['venv']}/bin/hpcdl-doctor", "-f", f"{bed['hub_dir']}/jupyterhub_config.py", "--user", "alice",
            "--json", "--timeout", "120", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout)


def statuses(report: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in report["findings"]:
        out.setdefault(f["check"], []).append(f["status"])
    return out


def find(report: dict, check: str, status: str = FAIL) -> dict:
    hits = [f for f in report["findings"] if f["check"] == check and f["status"] == status]
    assert hits, f"no {status} {check!r} in {json.dumps(report, indent=1)}"
    return hits[0]


def bed_images(bed: dict) -> list[str]:
    """The image references of the bed hub's catalogue."""
    config = (Path(bed["hub_dir"]) / "jupyterhub_config.py").read_text()
    return re.findall(r'"ref": "([^"]+)"', config)


def no_jobs_of_alice() -> bool:
    return not subprocess.run(["squeue", "-h", "-u", "alice"], capture_output=True, text=True).stdout.strip()


@pytest.mark.testbed
def test_healthy_bed_passes(bed, alice):
    rc, report = doctor(bed)
    assert rc == 0 and report["status"] == OK, json.dumps(report, indent=1)
    s = statuses(report)
    for check in ("batch system", "hub API", "sudo rule", "shared home", "hub callback", "udocker", "GPUs"):
        assert s[check] == [OK], check
    n_images = len(bed_images(bed))
    for check in ("image", "image versions"):  # one finding for each image of the catalogue
        assert s[check] == [OK] * n_images, check
    assert s["NVIDIA libraries"] == [SKIP]
    assert not list(Path(alice.home, ".jupyter-hpcdl/doctor").glob("*")), "the exchange directory was left behind"
    assert no_jobs_of_alice()


@pytest.mark.testbed
def test_a_hub_account_without_the_sudo_rule_is_told_what_is_missing(bed):
    """The bed's hub account (the owner of its configuration) has the rule; bob, named as the hub's account, has
    none: the doctor names each command he may not run as alice and the command that prints the rule."""
    rc, report = doctor(bed, "--no-job")
    assert rc == 0 and find(report, "sudo rule", OK)["message"].startswith("hpcdl-hub may run"), report
    rc, report = doctor(bed, "--no-job", "--hub-user", "bob")
    f = find(report, "sudo rule")
    assert rc == 1 and "bob may not run as alice" in f["message"] and "/usr/bin/sbatch" in f["message"], f
    assert "jupyter_hpcdl.spawner.usertail" in f["message"] and "spawner.sudoers --hub-user bob" in f["fix"], f


@pytest.mark.testbed
def test_wrong_callback_url_and_unknown_image(bed):
    rc, report = doctor(bed, "--hub-url", "http://127.0.0.1:9/hub/api", "--image", "hpcdl/nope:latest",
                        "--image", bed["image"])
    assert rc == 1
    assert "Connection refused" in find(report, "hub API")["message"]
    f = find(report, "hub callback")
    assert f["where"] == "node1" and "http://127.0.0.1:9/hub/api is not reachable from node1" in f["message"]
    f = find(report, "image")
    assert "hpcdl/nope:latest is not in the user's udocker repository and could not be pulled" in f["message"]
    assert "publish hpcdl/nope:latest" in f["fix"]
    assert find(report, "image", OK)["message"].startswith(bed["image"])  # the other image still passes


@pytest.mark.testbed
def test_missing_udocker_tools(bed, alice, alice_dir):
    site = json.loads(Path(bed["site_config"]).read_text())
    site["ContainerSite"]["tools_dir"] = "/nonexistent/udocker-tools"
    path = alice.write(alice_dir / "site.json", json.dumps(site))
    rc, report = doctor(bed, "--site-config", str(path))
    assert rc == 1
    f = find(report, "udocker")
    assert "udocker tools missing in /nonexistent/udocker-tools" in f["message"]
    assert "hpcdl-udocker-tools" in f["message"] + f["fix"]
    assert statuses(report)["images"] == [SKIP]


@pytest.mark.testbed
def test_no_result_from_the_node_and_an_unusable_exchange_directory(bed, alice):
    """The nodes lack the environment (the job's Python is missing): the job runs, no result comes back. And a
    directory the user cannot write is refused before any job, as the user (not as root)."""
    rc, report = doctor(bed, "--python", "/nonexistent/venv/bin/python")
    assert rc == 1
    f = find(report, "shared home")
    assert "result never appeared" in f["message"] and "/nonexistent/venv/bin/python exists on the nodes" in f["fix"]
    assert no_jobs_of_alice() and not list(Path(alice.home, ".jupyter-hpcdl/doctor").glob("*"))
    private = Path(tempfile.mkdtemp(prefix="hpcdl-doctor-root-"))  # root's, 0700
    try:
        rc, report = doctor(bed, "--exchange-dir", str(private))
        assert rc == 1
        f = find(report, "shared home")
        assert "cannot prepare the exchange directory" in f["message"] and "as alice" in f["message"], f
        assert not list(private.iterdir()) and no_jobs_of_alice()
    finally:
        shutil.rmtree(private)


def test_exchange_files_are_handled_as_the_user():
    """As root, a link the user planted cannot redirect the doctor: the child that writes has the user's rights."""
    import pwd as pwdlib

    from jupyter_hpcdl.doctor.exchange import ExchangeError, prepare, run_as
    if os.geteuid() != 0 or "nobody" not in {p.pw_name for p in pwdlib.getpwall()}:
        pytest.skip("needs root and the user nobody")
    tmp_path = Path(tempfile.mkdtemp(prefix="hpcdl-exchange-"))
    try:
        _exchange_trap(tmp_path, prepare, run_as, ExchangeError)
    finally:
        shutil.rmtree(tmp_path)


def _exchange_trap(tmp_path, prepare, run_as, ExchangeError):
    victim = tmp_path / "root-only"
    victim.write_text("keep")
    victim.chmod(0o600)
    tmp_path.chmod(0o755)
    (tmp_path / "x").mkdir(mode=0o777)
    (tmp_path / "x").chmod(0o777)
    (tmp_path / "x" / "n1").mkdir()
    (tmp_path / "x" / "n1" / "request.json").symlink_to(victim)  # a trap in the directory
    with pytest.raises(ExchangeError):
        run_as("nobody", prepare, str(tmp_path / "x"), "n1", "{}")
    assert victim.read_text() == "keep"
    with pytest.raises(ExchangeError, match="Permission denied"):
        run_as("nobody", lambda: open(victim).read())
    assert run_as("nobody", prepare, str(tmp_path / "x"), "n2", "{}").endswith("/x/n2")


@pytest.mark.testbed
def test_frozen_controller(bed):
    pid = int(Path(bed["state"], "run/slurmctld.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        rc, report = doctor(bed, "--cli-timeout", "3")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert rc == 1
    f = find(report, "batch system")
    assert "did not answer in 3 s" in f["message"] and "scontrol ping" in f["fix"]
    assert statuses(report)["node checks"] == [SKIP]


@pytest.mark.testbed
def test_image_without_the_stack(bed, alice, alice_dir):
    """The bed's bare OS image (Debian's Python, nothing else) as the catalogue, in a private udocker repository."""
    site = json.loads(Path(bed["site_config"]).read_text())
    site["ContainerSite"]["udocker_dir"] = str(alice_dir / "udocker")
    path = alice.write(alice_dir / "site.json", json.dumps(site))
    rc, report = doctor(bed, "--site-config", str(path), "--image", bed["os_image"])
    assert rc == 1
    assert find(report, "image", OK)["message"].startswith(f"{bed['os_image']}: pulled from the registry")
    messages = [f["message"] for f in report["findings"] if f["check"] == "image versions" and f["status"] == FAIL]
    assert any("has jupyter-hpcdl not installed" in m for m in messages)
    assert any("has no TensorFlow" in m for m in messages) and any("has no Horovod" in m for m in messages)
    assert any("lacks ipykernel, ipyparallel" in m for m in messages)


TORCH_VERSIONS = {**GOOD_VERSIONS, "torch": "2.13.0+cpu", "torch_gloo": True, "torch_nccl": False, "torch_error": "",
                  "torch_ddp": "", "backends": ["horovod", "torch"]}


def with_torch(**changes) -> NodeFacts:
    return replace(GOOD, images=(replace(GOOD_IMAGE, ref="hpcdl/torch:latest",
                                         versions={**TORCH_VERSIONS, **changes}),))


def test_an_image_the_catalogue_gives_two_backends_is_checked_for_both():
    f = only(assess_node(with_torch(), EXPECT), "image versions")
    assert f.status == OK and "Horovod 0.28.1" in f.message and "PyTorch 2.13.0+cpu (Gloo" in f.message, f.message


@pytest.mark.parametrize("changes, words", [
    ({"torch": None}, "has no PyTorch"),
    ({"torch_error": "OSError: libgomp.so.1"}, "torch.distributed does not load: OSError"),
    ({"torch_gloo": False}, "has no Gloo"),
    ({"torch_ddp": "rank 1: exit 1: RuntimeError: Connection refused"}, "one DistributedDataParallel step"),
    ({"horovod": None}, "has no Horovod"),  # the other backend the image is meant to hold
])
def test_a_pytorch_image_without_a_working_stack_fails_with_the_fix(changes, words):
    findings = failed(by_check(assess_node(with_torch(**changes), EXPECT), "image versions"))
    assert any(words in f.message and f.fix for f in findings), findings


def test_the_pytorch_probe_runs_a_ddp_step_and_reports_it():
    """The probe script itself (as the doctor runs it in a container), here with this environment's Python."""
    torch = pytest.importorskip("torch")
    from jupyter_hpcdl.backends import load_backend

    done = subprocess.run([sys.executable, "-c", load_backend("torch").probe_script], capture_output=True, text=True,
                          timeout=300)
    line = next(x for x in done.stdout.splitlines() if x.startswith("HPCDL-VERSIONS "))
    v = json.loads(line.split(" ", 1)[1])
    assert v["torch"] == torch.__version__ and v["torch_gloo"] and v["torch_ddp"] == "", v
