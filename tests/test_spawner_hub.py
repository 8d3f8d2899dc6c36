"""The spawner with the real hub, proxy, Slurm and udocker of the test bed."""
import http.cookiejar
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import config  # the hub's timing settings on the bed
from hubclient import Hub

pytestmark = pytest.mark.testbed
KERNEL_REPORT = ("import os, json; print(json.dumps({'image': json.load(open('/etc/hpcdl-image.json')), "
                 "'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), 'uid': os.getuid(), 'cwd': os.getcwd()}))")


@pytest.fixture(scope="module")
def hub(bed):
    return Hub(bed)


def jobs(user):
    out = subprocess.run(["squeue", "-h", "-u", user, "-o", "%i %T %r"], capture_output=True, text=True, check=True).stdout
    return [line.split() for line in out.splitlines()]


@pytest.fixture
def clean(hub):
    """Every test starts and ends with no server and no job of alice and bob."""
    yield
    for user in ("alice", "bob"):
        info = hub.api("GET", f"/hub/api/users/{user}")[1]
        for name in list(info["servers"]):
            status, _ = hub.api("DELETE", f"/hub/api/users/{user}/server" + (f"s/{name}" if name else ""))
            if status >= 500:  # JupyterHub refuses to stop a server while its start-up check is pending: end the job
                subprocess.run(["scancel", "-u", user], check=False)
            hub.wait_gone(user, name=name, timeout=240)
    for user in ("alice", "bob"):
        subprocess.run(["scancel", "-u", user], check=False)
    deadline = time.monotonic() + 60
    while (jobs("alice") or jobs("bob")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not jobs("alice") and not jobs("bob")


def spawn(hub, user, options, name=""):
    path = f"/hub/api/users/{user}/server" + (f"s/{name}" if name else "")
    return hub.api("POST", path, options, timeout=120)


def progress_messages(hub, user, name="", until=None, timeout=120):
    """Messages of the spawn's progress event stream (until one matches ``until`` or the spawn is ready)."""
    path = f"/hub/api/users/{user}/server" + (f"s/{name}" if name else "") + "/progress"
    req = urllib.request.Request(hub.url + path, headers={"Authorization": f"token {hub.token}"})
    messages = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            messages.append(event.get("message", ""))
            if event.get("ready") or event.get("failed") or (until and re.search(until, messages[-1])):
                break
    return messages


def test_spawn_runs_lab_on_a_node_with_kernels_in_the_container(bed, hub, clean):
    status, body = spawn(hub, "alice", {"nodes": 1, "gpus_per_node": 2, "walltime": "00:20:00", "image": "base"})
    assert status in (201, 202), body
    server = hub.wait_ready("alice")
    assert server["user_options"]["gpus_per_node"] == 2
    (job_id, state, _), = jobs("alice")
    assert state == "RUNNING"
    report = json.loads(hub.run_in_kernel("alice", KERNEL_REPORT))
    assert report["image"] == bed["identity"], "the kernel is not running inside alice's container"
    assert len(report["cuda"].split(",")) == 2 and report["uid"] == 1001
    script = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True).stdout
    token = _server_token(job_id)
    assert token and token not in script and "TOKEN" not in script
    hub.stop("alice")
    assert jobs("alice") == []


def _process_with(*words: str, start: str = "", user: str = "alice") -> psutil.Process | None:
    for p in psutil.process_iter(["username", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if p.info["username"] == user and cmdline.startswith(start) and all(w in cmdline for w in words):
            return p
    return None


def test_a_kernel_whose_launcher_died_stays_in_the_job_and_ends_with_it(bed, hub, clean):
    """Slurm's linuxproc tracking (as on any node without cgroups) loses a process whose parent died: the job's main
    process is its subreaper, so the kernel stays in the job's tree and is ended with the server."""
    status, body = spawn(hub, "alice", {"nodes": 1, "gpus_per_node": 1, "image": "base"})
    assert status in (201, 202), body
    hub.wait_ready("alice")
    hub.wait_routed("alice")
    status, kernel = hub.api("POST", "/user/alice/api/kernels", {"name": "hpcdl"}, timeout=120)
    assert status == 201, kernel
    deadline = time.monotonic() + 60
    while not (payload := _process_with("ipykernel_launcher", kernel["id"], start="python3 -m")) or \
            not (launcher := _process_with("jupyter_hpcdl.containers run", kernel["id"])):
        assert time.monotonic() < deadline, "the container kernel did not start"
        time.sleep(0.5)
    launcher.kill()
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while (parent := payload.parent()) and "jupyter_hpcdl.containers" in " ".join(parent.cmdline()):
        assert time.monotonic() < deadline
        time.sleep(0.2)  # the engine between (P1's proot) may take a moment to go
    assert parent is not None and "jupyter_hpcdl.job.server" in " ".join(parent.cmdline()), \
        f"the orphaned kernel left the job: its parent is {parent and parent.cmdline()}"
    hub.stop("alice")
    payload.wait(30)  # psutil.TimeoutExpired if the kernel outlived its job


def test_queued_spawn_says_why_and_stop_cancels_it(hub, bob, clean):
    blocker = bob.run("sbatch", "--parsable", "--nodes=1", "--gres=gpu:1", "--time=10", "--wrap=sleep 600", check=True)
    assert blocker.stdout.strip()
    status, _ = spawn(hub, "alice", {"nodes": 2, "gpus_per_node": 4, "walltime": "00:10:00"}, name="big")
    assert status == 202
    # Slurm may list the job before its scheduler gives a reason ("none given"): wait for the reason itself
    messages = progress_messages(hub, "alice", "big", until=r"queued \(pending, reason: (Resources|Priority)")
    assert any(re.search(r"Submitted job \d+ to partition gpu: 2 node\(s\) × 4 GPU\(s\) for 00:10:00", m) for m in messages)
    assert re.search(r"Job \d+ is queued \(pending, reason: (Resources|Priority)", messages[-1]), messages
    hub.stop("alice", "big")
    assert jobs("alice") == []


def running_blocker(user, node: str, timeout: float = 60) -> str:
    """A job of ``user``'s that holds every GPU of ``node``, once it runs; returns its id. (A test that goes on
    while the job still pends races the scheduler: another job may take the node first, or the job may be launched
    at the moment it is cancelled, which can leave its process behind.)"""
    job = user.run("sbatch", "--parsable", "--nodes=1", f"--nodelist={node}", "--gres=gpu:4", "--time=10",
                   "--wrap=exec sleep 600", check=True).stdout.strip()
    deadline = time.monotonic() + timeout
    try:
        while (state := subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                                       timeout=30).stdout.strip()) != "RUNNING":
            if state not in ("PENDING", "CONFIGURING") or time.monotonic() > deadline:
                raise AssertionError(f"{user.name}'s blocking job {job} on {node} did not start in "
                                     f"{timeout:.0f} s ({state or 'gone'})")
            time.sleep(0.5)
    except BaseException:
        subprocess.run(["scancel", job], timeout=30)
        raise
    return job


def spawn_running_and_queued(hub, bob) -> str:
    """alice's default server running, and her server "queued" pending behind a job of bob's that holds node2's
    GPUs; returns bob's job id (cancel it to let "queued" start)."""
    spawn(hub, "alice", {"gpus_per_node": 1, "walltime": "00:20:00"})
    hub.wait_ready("alice")
    blocker = running_blocker(bob, "node2")
    spawn(hub, "alice", {"nodes": 2, "gpus_per_node": 3, "walltime": "00:10:00"}, name="queued")
    progress_messages(hub, "alice", "queued", until=r"queued")
    return blocker


def test_hub_restart_picks_up_a_running_and_a_pending_server(bed, hub, bob, clean):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
    import bed as testbed

    blocker = spawn_running_and_queued(hub, bob)
    before = {j[0]: j[1] for j in jobs("alice")}
    assert sorted(before.values()) == ["PENDING", "RUNNING"]

    testbed.hub().stop()
    testbed.hub().start()
    assert hub.server("alice")["ready"], "the running server was not picked up"
    hub.wait_routed("alice")
    assert json.loads(hub.run_in_kernel("alice", KERNEL_REPORT))["image"] == bed["identity"]
    subprocess.run(["scancel", blocker], check=True)
    hub.wait_ready("alice", name="queued", timeout=180)
    after = {j[0]: j[1] for j in jobs("alice")}
    assert after == {k: "RUNNING" for k in before}, "the pending job was not followed (or a new one was submitted)"


def test_a_hub_that_crashes_leaves_no_service_holding_its_port(bed, hub):
    """JupyterHub starts its managed services in sessions of their own: killed, it would leave the instructor's page
    (hpcdl-workshop) running on its port, and the new hub's copy would fail to bind it again and again. The page
    answers again from the new hub's copy alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
    import bed as testbed

    old = testbed.hub().pid()
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(old) and psutil.Process(old).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the killed hub is still there"
        time.sleep(0.2)
    testbed.hub().start()
    deadline = time.monotonic() + 30
    while hub.api("GET", "/services/hpcdl-workshop/api/status")[0] in (502, 503) and time.monotonic() < deadline:
        time.sleep(1)

    def services():
        return [p.info for p in psutil.process_iter(["pid", "ppid", "cmdline"])
                if "jupyter_hpcdl.workshop.service" in " ".join(p.info["cmdline"] or [])]

    deadline = time.monotonic() + 10  # the kernel's SIGTERM to the old copy, and its exit, take a moment
    while [s["ppid"] for s in services()] != [testbed.hub().pid()] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [s["ppid"] for s in services()] == [testbed.hub().pid()], \
        f"not the new hub's copy alone: {services()} (hub {testbed.hub().pid()})"


@pytest.mark.timing
def test_a_job_ended_outside_the_hub_is_noticed_and_explained(bed, hub, alice, clean):
    spawn(hub, "alice", {"walltime": "00:20:00"})
    hub.wait_ready("alice")
    (job_id, _, _), = jobs("alice")
    subprocess.run(["scancel", job_id], check=True)
    t0 = time.monotonic()
    hub.wait_gone("alice", timeout=30)
    # the hub polls every poll_interval (up to 10 % later), the spawner answers from a queue read at most
    # queue_interval old (a read in flight may take scheduler_timeout), and wait_gone asks every second
    bound = config.POLL_INTERVAL * 1.1 + config.QUEUE_INTERVAL + config.SCHEDULER_TIMEOUT + 1
    took = time.monotonic() - t0
    assert took < bound, f"noticed after {took:.0f} s, not within one poll ({bound:.0f} s)"
    page = _user_session(bed, "alice").get("/hub/spawn")
    assert re.search(rf"Your last server ended: job {job_id} ended: CANCELLED", page), page[:2000]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({}, optional={
    "nodes": st.one_of(st.integers(-3, 9), st.text(max_size=12)),
    "gpus_per_node": st.one_of(st.integers(-1, 9), st.sampled_from(["2;id", "$(id)", "1\n#SBATCH --uid=0"])),
    "walltime": st.sampled_from(["00:10:00", "99:00:00", "1:00\nrm -rf ~", "`id`", "", "0"]),
    "partition": st.sampled_from(["gpu", "debug", "gpu --uid=0", ""]),
    "image": st.sampled_from(["base", "docker.io/library/ubuntu", "../../etc"]),
    "cmd": st.just(["/bin/sh", "-c", "id"]),
}))
def test_fuzzed_rest_options_are_refused_or_submitted_exactly(hub, bed, options):
    status, body = spawn(hub, "alice", options)
    try:
        if status == 400:
            assert body["message"].startswith("Not started: ") and jobs("alice") == []
            return
        assert status in (201, 202), (status, body)
        hub.wait_ready("alice")
        (job_id, _, _), = jobs("alice")
        script = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True).stdout
        for line in script.splitlines():
            if line.startswith("#SBATCH"):
                assert re.fullmatch(r"#SBATCH --[a-z-]+(=[A-Za-z0-9_.:/%-]+)?", line), line
    finally:
        if hub.server("alice"):
            hub.stop("alice")
    assert jobs("alice") == []


def _server_token(job_id: str, user: str = "alice") -> str | None:
    """The API token of ``user``'s server in batch job ``job_id`` (Slurm's or Grid Engine's: the Grid Engine hub's
    tests may run a server of alice's meanwhile)."""
    for p in psutil.process_iter(["username", "cmdline"]):
        if p.info["username"] == user and any("jupyterhub-singleuser" in a for a in p.info["cmdline"] or []):
            try:
                env = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            values = dict(item.split(b"=", 1) for item in env if b"=" in item)
            if job_id.encode() in (values.get(b"SLURM_JOB_ID"), values.get(b"JOB_ID")) and b"JUPYTERHUB_API_TOKEN" in values:
                return values[b"JUPYTERHUB_API_TOKEN"].decode()
    return None


def test_callback_accepts_only_the_port_from_the_servers_own_token(hub, bob, clean):
    spawn(hub, "alice", {"walltime": "00:20:00"})
    hub.wait_ready("alice")
    (job_id, *_), = jobs("alice")
    token = _server_token(job_id)
    marker = Path(f"/tmp/hpcdl-pwned-{os.getpid()}")
    for route in ("/hub/api/batchspawner", "/hub/api/hpcdl/callback"):
        for body in ({"batch_cancel_cmd": f"touch {marker}"}, {"port": 1, "exec_prefix": ["touch", str(marker)]},
                     {"port": "8888"}, {"port": 1, "ip": "10.1.2.3"}):
            status, reply = hub.api("POST", route, body, token=token)
            assert status == 400 and "accepts exactly" in reply["message"] or "port must be" in reply["message"], reply
    status, bob_token = hub.api("POST", "/hub/api/users/bob/tokens", {"note": "test"})
    status, reply = hub.api("POST", "/hub/api/hpcdl/callback", {"port": 1234}, token=bob_token["token"])
    assert status == 409, reply
    before = hub.server("alice")["url"]
    hub.stop("alice")
    assert jobs("alice") == [] and not marker.exists()
    assert before.endswith("/user/alice/")


def test_bob_cannot_reach_alices_server(hub, clean):
    spawn(hub, "alice", {"walltime": "00:20:00"})
    hub.wait_ready("alice")
    _, bob_token = hub.api("POST", "/hub/api/users/bob/tokens", {"note": "test"})
    status, _ = hub.api("GET", "/user/alice/api/kernels", token=bob_token["token"])
    assert status in (403, 404)
    status, _ = hub.api("GET", "/user/alice/api/kernels")  # alice's own token may
    assert status == 200
    # the token the bed's client gives alice's server (a process alice controls) reaches her servers, nothing else
    status, _ = hub.api("GET", "/hub/api/users", token=hub.user_token("alice"))
    assert status == 403
    status, _ = hub.api("POST", "/hub/api/users/bob/tokens", {"note": "test"}, token=hub.user_token("alice"))
    assert status in (403, 404)


class _Session:
    def __init__(self, base):
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def xsrf(self):
        return next((c.value for c in self.jar if c.name == "_xsrf"), "")

    def get(self, path):
        with self.opener.open(self.base + path, timeout=60) as r:
            return r.read().decode()

    def post(self, path, fields):
        data = urllib.parse.urlencode({**fields, "_xsrf": self.xsrf()}).encode()
        try:
            with self.opener.open(urllib.request.Request(self.base + path, data=data), timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def _user_session(bed, user):
    s = _Session(bed["hub_url"])
    s.get("/hub/login")
    password = (Path(bed["hub_dir"]) / "password").read_text().strip()
    status, _ = s.post("/hub/login", {"username": user, "password": password})
    assert status == 200
    return s


def test_form_offers_availability_and_preview_and_refuses_bad_values(bed, clean):
    s = _user_session(bed, "alice")
    page = s.get("/hub/spawn")
    assert re.search(r'<tr data-partition="gpu">.*?<td>\s*2 / 2</td>\s*<td>\s*8 / 8</td>', page, re.S), "availability"
    assert "#SBATCH --partition=gpu" in page and 'id="hpcdl-gpu-hours">1.0<' in page
    assert '<option value="alice-project">' in page
    status, page = s.post("/hub/spawn", {"partition": "gpu", "nodes": "9", "gpus_per_node": "1",
                                          "walltime": "00:10:00", "account": "hpcdl", "image": "base"})
    assert "nodes: 9 is out of range; allowed: 1 to 2" in page
    assert jobs("alice") == []
    preview = json.loads(s.get("/hub/api/hpcdl/preview?nodes=2&gpus_per_node=3&walltime=02:00:00&_xsrf=" + s.xsrf()))
    assert preview["gpu_hours"] == 12.0 and "#SBATCH --gres=gpu:3" in preview["script"]
    assert "#SBATCH --comment=jupyterhub-hpcdl:testbed:alice:" in preview["script"]
    # a server alice does not have: 404, and no server is made by asking
    try:
        s.get("/hub/api/hpcdl/preview?server_name=nosuch&nodes=1&_xsrf=" + s.xsrf())
        raise AssertionError("a preview for a server alice does not have was answered")
    except urllib.error.HTTPError as e:
        assert e.code == 404
    servers = Hub(bed).api("GET", "/hub/api/users/alice?include_stopped_servers=1")[1]["servers"]
    assert "nosuch" not in servers


def test_a_partition_with_gpu_types_offers_them_and_its_job_gets_the_type(bed, hub, clean):
    """The bed's "typed" partition (the same nodes, their GPUs of Slurm type "sim"): the form offers the type, the
    preview shows it, and a spawn from the form with what it shows runs on GPUs of that type."""
    s = _user_session(bed, "alice")
    page = s.get("/hub/spawn")
    assert re.search(r'<option value="sim" data-partition="typed"', page), "the form offers the partition's type"
    preview = json.loads(s.get("/hub/api/hpcdl/preview?partition=typed&nodes=1&gpus_per_node=2&walltime=00:20:00"
                               "&_xsrf=" + s.xsrf()))
    assert "#SBATCH --gres=gpu:sim:2" in preview["script"], preview["script"]
    s.post("/hub/spawn", {"partition": "typed", "nodes": "1", "gpus_per_node": "2", "gpu_type": "sim",
                          "walltime": "00:20:00", "account": "hpcdl", "image": "base"})
    hub.wait_ready("alice")
    (job_id, state, _), = jobs("alice")
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    assert state == "RUNNING" and "Partition=typed" in shown and re.search(r"gpu:sim[:=]2", shown), shown


def test_a_job_that_fails_says_why_with_its_log(hub, clean):
    """bob's udocker holds no image: the job fails while preparing the container, and the spawn says so."""
    status, _ = spawn(hub, "bob", {"walltime": "00:10:00"})
    assert status == 202
    messages = progress_messages(hub, "bob", timeout=180)
    assert re.search(r"job \d+ ended: FAILED.*exit code 2", messages[-1]), messages
    assert "Last lines of its log" in messages[-1]
    assert "image 'hpcdl/base:latest' is not in your udocker repository" in messages[-1]
    hub.wait_gone("bob")
    assert jobs("bob") == []
