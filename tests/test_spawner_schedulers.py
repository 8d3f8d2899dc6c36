"""The same spawner tests against both real batch systems of the bed: one site, two hubs that differ only in
``c.SiteProfile.scheduler`` (Slurm on :8000, Son of Grid Engine on :8100). Jobs are read through the adapter, so
nothing here names a scheduler's command."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from traitlets.config import Config

from hubclient import Hub
from jupyter_hpcdl.commands import run
from jupyter_hpcdl.batchsystems.scheduler import JobRequest
from jupyter_hpcdl.batchsystems.scheduler import ENDED, Scheduler, load_scheduler
from test_spawner_hub import KERNEL_REPORT, _server_token, _Session, progress_messages, spawn

pytestmark = pytest.mark.testbed
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import bed as testbed  # noqa: E402
import config as bedconfig  # noqa: E402


@dataclass
class Site:
    name: str
    hub: Hub
    sched: Scheduler
    place: bedconfig.HubPlace
    nodes: int  # in the gpu partition
    gpus: int  # in all
    hub_dir: str

    def jobs(self, user: str) -> dict[str, str]:
        """The user's jobs that have not ended: id → the scheduler's state."""
        out = asyncio.run(run(self.sched.queue_argv(), timeout=30)).check("reading the queue").stdout
        return {j.job_id: j.state for j in self.sched.parse_queue(out).values() if j.user == user and j.phase != ENDED}

    def cancel_all(self, user: str) -> None:
        for job_id in self.jobs(user):
            asyncio.run(run(["runuser", "-u", user, "--", *self.sched.cancel_argv(job_id)], timeout=30))

    def session(self, user: str) -> _Session:
        s = _Session(self.hub.url)
        s.get("/hub/login")
        password = (Path(self.hub_dir) / "password").read_text().strip()
        assert s.post("/hub/login", {"username": user, "password": password})[0] == 200
        return s


@pytest.fixture(scope="module", params=["slurm", pytest.param("gridengine", marks=pytest.mark.stream("rest"))])
def site(request, bed):
    if request.param == "slurm":
        s = Site("slurm", Hub(bed), load_scheduler("slurm"), bedconfig.HUB, len(bed["nodes"]),
                 len(bed["nodes"]) * bed["gpus_per_node"], bed["hub_dir"])
    else:
        s = Site("gridengine", Hub({"hub_url": bed["sge_hub_url"], "hub_dir": bed["sge_hub_dir"]}),
                 load_scheduler("gridengine", config=Config({"GridEngine": {"pe_multi_node": bed["sge_pe_multi_node"]}})),
                 bedconfig.SGE_HUB, len(bed["sge_hosts"]),
                 len(bed["sge_hosts"]) * bed["gpus_per_node"], bed["sge_hub_dir"])
    for user in ("alice", "bob"):
        s.hub.api("POST", f"/hub/api/users/{user}")  # 201, or 409 when the user is known already
    return s


@pytest.fixture
def clean(site):
    yield
    for user in ("alice", "bob"):
        for name in list(site.hub.api("GET", f"/hub/api/users/{user}")[1]["servers"]):
            status, _ = site.hub.api("DELETE", f"/hub/api/users/{user}/server" + (f"s/{name}" if name else ""))
            if status >= 500:
                site.cancel_all(user)
            site.hub.wait_gone(user, name=name, timeout=240)
        site.cancel_all(user)
    deadline = time.monotonic() + 60
    while (site.jobs("alice") or site.jobs("bob")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not site.jobs("alice") and not site.jobs("bob")


def blocker(site: Site, user) -> str:
    """A job of ``user``'s that holds every GPU of the gpu partition."""
    req = JobRequest("gpu", site.nodes, site.gpus // site.nodes, 10, "base", "hpcdl/base:latest")
    script = "\n".join(["#!/bin/bash", *site.sched.header(req, "blocker", "/dev/null", user.home), "sleep 600"]) + "\n"
    out = user.run(*site.sched.submit_argv([]), input=script, check=True).stdout
    return site.sched.parse_submit(out)


def test_spawn_runs_lab_with_kernels_in_the_container_and_keeps_the_token_private(bed, site, alice, bob, clean):
    status, body = spawn(site.hub, "alice", {"nodes": 1, "gpus_per_node": 1, "walltime": "00:20:00", "image": "base"})
    assert status in (201, 202), body
    site.hub.wait_ready("alice")
    (job_id, state), = site.jobs("alice").items()
    report = json.loads(site.hub.run_in_kernel("alice", KERNEL_REPORT))
    assert report["image"] == bed["identity"] and report["uid"] == 1001, "the kernel is not in alice's container"
    assert len((report["cuda"] or "").split(",")) == 1 and report["cuda"], "the job's GPU did not reach the kernel"
    # What every other user can read of the job (its details, its environment where the scheduler shows it).
    details = bob.run(*site.sched.job_argv(job_id)).stdout
    token = _server_token(job_id, "alice")
    assert token and token not in details
    assert not list(Path(alice.home, ".jupyter-hpcdl/jobs").glob("env-*.json")), "the job's secrets were left behind"
    if site.place.internal_ssl:
        _check_mutual_tls(site, alice, bob, job_id, token)
    site.hub.stop("alice")
    assert site.jobs("alice") == {}
    if site.place.internal_ssl:
        assert not list(Path(alice.home, ".jupyter-hpcdl/tls").glob("*/*")), "the server's key outlived it"


#: Run as bob on alice's node: alice's server on PORT, asked with alice's token (on stdin) in plain HTTP, over TLS
#: with no client certificate, and over TLS with a certificate of bob's own making; prints what bob got back.
NEIGHBOUR = r"""
import datetime, json, os, socket, ssl, sys, tempfile
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
port, token = int(sys.argv[1]), sys.stdin.read().strip()
ask = (f"GET /user/alice/api/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: token {token}\r\n"
       "Connection: close\r\n\r\n").encode()

def talk(context):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        if context is not None:
            s = context.wrap_socket(s)
        s.sendall(ask)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got.decode(errors="replace")
    except OSError as e:
        return f"refused: {type(e).__name__}: {e}"
    finally:
        s.close()

def client(cert=None):
    c = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    c.check_hostname, c.verify_mode = False, ssl.CERT_NONE  # bob takes any server
    if cert:
        c.load_cert_chain(*cert)
    return c

key = ec.generate_private_key(ec.SECP256R1())
name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hub-internal")])
now = datetime.datetime.now(datetime.timezone.utc)
own = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
       .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
       .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
d = tempfile.mkdtemp()
with open(f"{d}/c.pem", "wb") as f:
    f.write(own.public_bytes(serialization.Encoding.PEM))
with open(f"{d}/k.pem", "wb") as f:
    f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))
print(json.dumps({"plain": talk(None), "no certificate": talk(client()),
                  "own certificate": talk(client((f"{d}/c.pem", f"{d}/k.pem")))}))
"""


def _check_mutual_tls(site: Site, alice, bob, job_id: str, token: str) -> None:
    """internal_ssl: alice's server answers only a client with a certificate of the hub's CA; its key reached the
    job as alice's alone."""
    log = Path(alice.home, ".jupyter-hpcdl/jobs", f"{job_id}.log").read_text(errors="replace")
    port = int(re.search(r"server on \S+:(\d+) \(TLS, client certificates required\)", log).group(1))
    tls = Path(alice.home, ".jupyter-hpcdl/tls/default")
    assert oct(tls.stat().st_mode & 0o777) == "0o700" and tls.stat().st_uid == alice.uid
    for f in tls.iterdir():
        assert oct(f.stat().st_mode & 0o777) == "0o600" and f.stat().st_uid == alice.uid, f
    assert not Path(alice.home, ".jupyter-hpcdl/jobs/tls-default.json").exists(), "the hub's bundle was left behind"
    got = json.loads(bob.run(f"{bob.bed['venv']}/bin/python", "-c", NEIGHBOUR, str(port), input=token,
                             check=True).stdout)
    for how, answer in got.items():
        assert "HTTP/1.1" not in answer and "alice" not in answer, f"bob, {how}, got an answer: {answer[:300]}"
    # The same request with the certificate of the hub's proxy (root reads the hub's files) is answered: the server
    # serves TLS with a certificate the hub's CA vouches for, on 127.0.0.1.
    certs = Path(site.hub_dir, "internal-ssl")
    context = ssl.create_default_context(cafile=str(certs / "proxy-client-ca_trust.crt"))
    context.load_cert_chain(str(certs / "proxy-client/proxy-client.crt"), str(certs / "proxy-client/proxy-client.key"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(f"GET /user/alice/api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: token {token}\r\n"
                  "Connection: close\r\n\r\n".encode())
        answer = b"".join(iter(lambda: s.recv(65536), b"")).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 200"), answer[:300]


def test_a_queued_spawn_says_why_and_stop_cancels_it(site, alice, bob, clean):
    held = blocker(site, bob)
    status, _ = spawn(site.hub, "alice", {"nodes": 1, "gpus_per_node": 1, "walltime": "00:10:00"}, name="q")
    assert status == 202
    # The reason comes with the scheduler's first pass over the job: wait for it.
    messages = progress_messages(site.hub, "alice", "q", until=r"queued \(\w+, reason: (Resources|Priority|.*full|.*gpu)")
    assert any(re.search(r"Submitted job \d+ to partition gpu: 1 node\(s\) × 1 GPU\(s\) for 00:10:00", m) for m in messages)
    assert re.search(r"Job \d+ is queued", messages[-1]), messages
    site.hub.stop("alice", "q")
    assert site.jobs("alice") == {}
    assert held in site.jobs("bob")
    assert not Path(alice.home, ".jupyter-hpcdl/jobs/env-q.json").exists(), "a cancelled job's secrets were left"


def test_a_hub_restart_keeps_a_running_server(bed, site, clean):
    spawn(site.hub, "alice", {"gpus_per_node": 1, "walltime": "00:20:00"})
    site.hub.wait_ready("alice")
    before = site.jobs("alice")
    testbed.hub(site.place).stop()
    testbed.hub(site.place).start()
    assert site.hub.server("alice")["ready"], "the running server was not picked up"
    site.hub.wait_routed("alice")
    assert json.loads(site.hub.run_in_kernel("alice", KERNEL_REPORT))["image"] == bed["identity"]
    assert site.jobs("alice") == before, "the job was not followed (or a new one was submitted)"


def test_the_form_shows_the_schedulers_availability_and_script(site, clean):
    page = site.session("alice").get("/hub/spawn")
    nodes, gpus = site.nodes, site.gpus
    assert re.search(rf'<tr data-partition="gpu">.*?<td>\s*{nodes} / {nodes}</td>\s*<td>\s*{gpus} / {gpus}</td>', page, re.S), \
        "availability"
    partition_line = f"{site.sched.directive} {site.sched.options(JobRequest('gpu', 1, 1, 60, 'base', 'x'), 'n', '/o', '/w')[1]}"
    assert partition_line in page, partition_line  # the script's preview, in this scheduler's words


def engines_of(user: str) -> list[str]:
    """The user's ipyparallel engines still running (zombies do not count)."""
    found = []
    for proc in psutil.process_iter(["username", "cmdline", "status"]):
        if proc.info["username"] == user and proc.info["status"] != psutil.STATUS_ZOMBIE \
                and "ipyparallel.engine" in " ".join(proc.info["cmdline"] or ()):
            found.append(f"{proc.pid} {' '.join(proc.info['cmdline'])[-120:]}")
    return found


def ended(site: Site, user: str, job_id: str, within: float = 60) -> bool:
    """Whether ``job_id`` leaves the queue within ``within`` seconds (a job being ended takes a moment: Slurm's
    COMPLETING, Grid Engine's epilogue)."""
    deadline = time.monotonic() + within
    while job_id in site.jobs(user):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


TRAINING_CODE = """
import json
from jupyter_hpcdl.training.batchrun import BatchRun
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard

out = {}
session = TrainingSession(ranks=2, where="allocation")
try:
    world = session.start()
    session.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    fit = session.fit(epochs=2)
    out.update(world=sorted((w["rank"], w["size"], w["node"], w["cuda_visible_devices"]) for w in world),
               loss=fit.loss, time_left=session.time_left())
finally:
    session.close()
new = TrainingSession(ranks=2, where="new", start_timeout=240,
                      new_allocation=NewAllocation(nodes=2, walltime=10, partition="gpu", gpus_per_rank=1))
try:
    world = new.start()
    out.update(new_job=new.job_id, new_world=sorted((w["rank"], w["size"], w["node"], w["cuda_visible_devices"])
                                                    for w in world), new_time_left=new.time_left())
    new.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    out.update(new_loss=new.fit(epochs=2).loss)
finally:
    new.close()
code = "import sys, horovod.tensorflow as hvd; hvd.init(); print('rank', hvd.rank(), 'of', hvd.size(), flush=True); sys.exit(3 * hvd.rank())"
refused = []
for ask in (dict(partition="nosuch"), dict(nodes=99, partition="gpu")):  # outside the form's limits: nothing is made
    try:
        BatchRun.submit(command=["true"], ranks=2, walltime=5, name="refused", **ask)
    except ValueError as e:
        refused.append(str(e))
from jupyter_hpcdl.containers.kernelspec import kernel_image
out.update(refused=refused, kernel_image=kernel_image())
run = BatchRun.submit(command=["python3", "-c", code], ranks=2, nodes=2, walltime=5, partition="gpu", name="both")
ended = run.wait(timeout=300, every=2, show=False)
result = run.result()
out.update(batch_job=run.job_id, batch_state=ended.state, batch_code=result.exit_code, batch_output=result.output)
print(json.dumps(out))
"""


@pytest.mark.timeout(1200)
def test_the_notebooks_training_new_allocation_and_batch_run_work_the_same(site, clean):
    """A training session across the two nodes of the job, one in a new allocation of two nodes and a batch run on
    two nodes, from the kernel in the container: the same code on both batch systems, which the allocation's owner
    asks through its adapter."""
    status, body = spawn(site.hub, "alice", {"nodes": 2, "gpus_per_node": 1, "walltime": "00:30:00", "image": "base"})
    assert status in (201, 202), body
    site.hub.wait_ready("alice")
    try:
        out = site.hub.run_in_kernel("alice", TRAINING_CODE, timeout=900)
    finally:
        site.hub.stop("alice")
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    for world in (result["world"], result["new_world"]):  # one rank on each node, each with its node's GPU
        assert [(rank, size) for rank, size, _, _ in world] == [(0, 2), (1, 2)], result
        assert len({node for _, _, node, _ in world}) == 2, f"the ranks did not span the two nodes: {world}"
        assert all(gpu and "," not in gpu for *_, gpu in world), f"each rank one GPU: {world}"
    assert result["loss"][-1] < result["loss"][0], result
    assert 0 < result["time_left"] <= 30 * 60, "the walltime left, as the scheduler says"
    assert 0 < result["new_time_left"] <= 10 * 60 and result["new_loss"][-1] < result["new_loss"][0], result
    assert ended(site, "alice", result["new_job"]), "the new allocation outlived its session"
    assert ended(site, "alice", result["batch_job"]), "the batch run's job did not end with its ranks"
    deadline = time.monotonic() + 60
    while (left := engines_of("alice")) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"engines outlived their jobs: {left}"
    assert "rank 0 of 2" in result["batch_output"] and "rank 1 of 2" in result["batch_output"], result["batch_output"]
    assert result["batch_code"] in (3, 137, 143) and result["batch_state"] == "FAILED", result
    # the form's limits hold for the jobs the kernel submits, with the form's messages; ranks run in its image
    partition, nodes = result["refused"]
    assert "partition: 'nosuch' is not offered; choose one of: gpu" in partition and "kernel submits" in partition
    assert "nodes: 99 is out of range" in nodes, result["refused"]
    assert result["kernel_image"] == "hpcdl/base:latest", result
