"""Another user of the site against alice, on the bed: what each attack gets, not only the status codes.

- A job log that is a link to a file only root may read: the failed spawn's message shows why the log is not shown,
  never that file (the hub reads a log's end as its user, ``spawner/usertail.py``).
- bob listening on the port alice's job reported, as soon as it is reported: he cannot, and alice's server answers
  ``/user/alice/`` (the job listens before it reports; the server accepts on that socket).
- bob looking for the secrets of alice's running training session (her server's token, the controller's key, the
  rendezvous' secret) in every file, process and scheduler listing he can read, and knocking on the rendezvous, the
  controller, her owner socket and her session directory without them.
- The hubs themselves: not root, and their sudo rule (the one ``docs/admin.md`` gives) runs only what they run as a
  user, never a shell nor anything as root."""
from __future__ import annotations

import re
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

from test_spawner_hub import clean, hub, jobs, progress_messages, spawn  # noqa: F401 -- fixtures and helpers

pytestmark = pytest.mark.testbed

GRABBER = r'''
import socket, sys, time
port, seconds, ips = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
taken = []
for ip in ips:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((ip, port))
        s.listen()
        taken.append(s)
        print("took", ip, flush=True)
    except OSError as e:
        print("refused", ip, e, flush=True)
        s.close()
print("done", flush=True)
deadline = time.monotonic() + seconds
for s in taken:
    s.settimeout(0.5)
while taken and time.monotonic() < deadline:
    for s in taken:
        try:
            conn, _ = s.accept()
        except OSError:
            continue
        print("served", conn.recv(4096).split(b"\r\n")[0].decode(errors="replace"), flush=True)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n{\"bob\": true}\n")
        conn.close()
'''


def test_a_log_linked_to_a_root_only_file_is_not_shown(hub, alice, clean):
    """alice links her next jobs' logs to a file only root may read: her spawn fails (Slurm cannot write the log)
    and the message says the log is not shown, with nothing of that file."""
    secret = Path("/root") / f"hpcdl-secret-{secrets.token_hex(4)}"
    secret.write_text(f"root-only {secrets.token_hex(16)}\n")
    secret.chmod(0o600)
    logs = Path(alice.home) / ".jupyter-hpcdl" / "jobs"
    probe = alice.run("sbatch", "--parsable", "-p", "gpu", "-t", "1", "-o", "/dev/null", "--wrap", "true", check=True)
    last = int(probe.stdout.strip().split(";")[0])
    links = [logs / f"{n}.log" for n in range(last + 1, last + 11)]
    try:
        alice.run("mkdir", "-p", str(logs), check=True)
        for link in links:
            alice.run("ln", "-sfn", str(secret), str(link), check=True)
        status, body = spawn(hub, "alice", {"walltime": "00:10:00"})
        assert status in (201, 202), body
        messages = progress_messages(hub, "alice", timeout=180)
        assert re.search(r"job \d+ (ended|is no longer known)", messages[-1]), messages
        assert secret.read_text().split()[1] not in "\n".join(messages), "the hub showed alice a root-only file"
        assert "Last lines of its log" in messages[-1] and "not shown" in messages[-1], messages[-1]
        assert "a symbolic link" in messages[-1], messages[-1]
        hub.wait_gone("alice")
    finally:
        for link in links:
            link.unlink(missing_ok=True)
        secret.unlink()


def test_a_neighbour_cannot_take_the_port_the_job_reported(bed, hub, alice, bob, clean):
    """bob tries to listen on alice's server's port the moment the hub learns it (the test reads it from the
    progress stream, standing in for a neighbour who scans): he is refused, and alice's server answers."""
    status, body = spawn(hub, "alice", {"walltime": "00:10:00"})
    assert status in (201, 202), body
    messages = progress_messages(hub, "alice", until=r"reported port \d+", timeout=180)
    port = int(re.search(r"reported port (\d+)", messages[-1]).group(1))
    # where the job listens (another address of the node on that port is another socket, not reached by the hub)
    ips = ["0.0.0.0", *sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                               if c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.family == socket.AF_INET})]
    assert len(ips) == 2, f"the job does not listen on port {port} when it reports it: {ips}"
    grabber = subprocess.Popen(
        ["runuser", "-u", "bob", "--", "/usr/bin/python3", "-c", GRABBER, str(port), "60", *ips],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/")
    try:
        hub.wait_ready("alice")
        status, answer = hub.api("GET", "/user/alice/api/status")
        out, _ = grabber.communicate(timeout=120)  # refused everywhere: it ends at once; else it serves for 60 s
    finally:
        grabber.kill()
    got = out.splitlines()
    tries = [line for line in got if line.startswith(("took", "refused"))]
    assert len(tries) == len(ips) and all(t.startswith("refused") for t in tries), f"bob took port {port}: {got}"
    assert not any(line.startswith("served") for line in got), got
    assert status == 200 and isinstance(answer, dict) and "started" in answer and "bob" not in answer, answer
    hub.stop("alice")
    assert jobs("alice") == []


# alice's kernel: a training session of two local ranks, whose secrets and addresses it leaves where only root
# and alice can read them, then it lives until the test says bob is done.
SESSION_CODE = r'''
import json, os, time
from jupyter_hpcdl.training import TrainingSession
s = TrainingSession(ranks=2, where="local")
s.start()
try:
    cfg = s._rankworld.client._config
    key = cfg["key"].decode() if isinstance(cfg["key"], bytes) else cfg["key"]
    probe = {"ipp_key": key, "registration": cfg["registration"], "scheme": cfg.get("signature_scheme", "hmac-sha256"),
             "rendezvous": f"{s._rankworld.rendezvous.bind}:{s._rankworld.rendezvous.port}",
             "rdv_secret": s._rankworld.rendezvous.secret,
             "owner_socket": os.environ.get("HPCDL_ALLOCATION_FILE", ""), "session_dir": s.private_dir}
    path = os.path.expanduser("~/.hpcdl-probe.json")
    fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, json.dumps(probe).encode()); os.close(fd); os.rename(path + ".part", path)
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.expanduser("~/.hpcdl-probe-done")) and time.monotonic() < deadline:
        time.sleep(0.5)
finally:
    s.close()
print("closed", flush=True)
'''

# bob, given what to look for on stdin (the test hands him the secrets only to search for them, and the key once,
# as a control that his probe of the controller would see an answer).
BOB = r'''
import json, os, socket, stat, subprocess, sys, urllib.request, urllib.error
import zmq
from jupyter_client.session import Session
ask = json.load(sys.stdin)
secrets = {k: ask["secrets"][k] for k in ask["secrets"]}
found = []
for root in ask["roots"]:
    for top, dirs, files in os.walk(root, onerror=lambda e: None):
        dirs[:] = [d for d in dirs if d != ".udocker"]  # container roots: image files, which nothing writes to
        for name in files:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_size > 4 << 20:
                    continue
                with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)) as fh:
                    data = fh.read()
            except OSError:
                continue
            found += [f"{k} in {path}" for k, v in secrets.items() if v.encode() in data]
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for what in ("cmdline", "environ"):
            try:
                data = open(f"/proc/{pid}/{what}", "rb").read()
            except OSError:
                continue
            found += [f"{k} in /proc/{pid}/{what}" for k, v in secrets.items() if v.encode() in data]
listing = subprocess.run(["scontrol", "show", "job", "-dd", ask["job"]], capture_output=True, text=True, timeout=30)
found += [f"{k} in scontrol show job" for k, v in secrets.items() if v in listing.stdout + listing.stderr]

def rendezvous(path):
    try:
        with urllib.request.urlopen(f"http://{ask['rendezvous']}{path}", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

def controller(key):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(ask["registration"])
    session = Session(key=key.encode(), signature_scheme=ask["scheme"])
    session.send(sock, "connection_request")
    answered = bool(sock.poll(10000))
    sock.close()
    return answered

try:
    socket.socket(socket.AF_UNIX).connect(ask["owner_socket"])
    owner = "connected"
except OSError as e:
    owner = type(e).__name__
print(json.dumps({"found": found, "rendezvous_guess": rendezvous("/global/rank_0"),
                  "rendezvous_wrong": rendezvous("/" + "x" * ask["rdv_secret_len"] + ":1/global/rank_0"),
                  "controller_wrong_key": controller("not-" + ask["key_shape"]),
                  "controller_with_key": controller(ask["control_key"]),
                  "owner": owner,
                  "session_dir": os.access(ask["session_dir"], os.R_OK) or os.access(ask["session_dir"], os.X_OK)}))
'''


def _server_token(user: str) -> str:
    for p in psutil.process_iter(["username", "cmdline"]):
        if p.info["username"] == user and any("jupyterhub-singleuser" in a or "jupyter_hpcdl.job" in a
                                              for a in p.info["cmdline"] or []):
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("JUPYTERHUB_API_TOKEN"):
                return env["JUPYTERHUB_API_TOKEN"]
    raise AssertionError(f"no process of {user}'s server has its API token")


def test_a_neighbour_finds_no_secret_of_a_running_session_and_is_not_answered_without_it(bed, hub, alice, bob, clean):
    """While alice trains (a session of two ranks in her server's job), bob searches every file he can read in the
    homes, the temporary and spool directories, every process's command line and environment he can read, and the
    scheduler's view of her job, for her server's API token, the controller's key and the rendezvous' secret: he finds
    none. Without them the rendezvous answers him 403 and the controller not at all (with the key, as a control, it
    answers); alice's owner socket and session directory are closed to him."""
    import json
    import threading
    import time

    status, body = spawn(hub, "alice", {"walltime": "00:15:00"})
    assert status in (201, 202), body
    hub.wait_ready("alice")
    probe_file, done_file = Path(alice.home) / ".hpcdl-probe.json", Path(alice.home) / ".hpcdl-probe-done"
    for f in (probe_file, done_file):
        f.unlink(missing_ok=True)
    out: dict = {}

    def in_kernel():
        try:
            out["text"] = hub.run_in_kernel("alice", SESSION_CODE, timeout=600)
        except Exception as e:  # said by the assertions below
            out["error"] = repr(e)

    kernel = threading.Thread(target=in_kernel)
    kernel.start()
    try:
        deadline = time.monotonic() + 400
        while not probe_file.exists() and kernel.is_alive() and time.monotonic() < deadline:
            time.sleep(1)
        assert probe_file.exists(), f"alice's session did not start: {out}"
        probe = json.loads(probe_file.read_text())
        job = jobs("alice")[0][0]
        ask = {"secrets": {"server token": _server_token("alice"), "controller key": probe["ipp_key"],
                           "rendezvous secret": probe["rdv_secret"]},
               "roots": ["/home", "/tmp", "/var/tmp", "/dev/shm", "/run", "/var/spool", "/var/log", bed["state"]],
               "job": job, "rendezvous": probe["rendezvous"], "rdv_secret_len": len(probe["rdv_secret"]),
               "registration": probe["registration"], "scheme": probe["scheme"], "key_shape": secrets.token_hex(8),
               "control_key": probe["ipp_key"], "owner_socket": probe["owner_socket"] or "/nonexistent",
               "session_dir": probe["session_dir"]}
        r = bob.run("python", "-c", BOB, input=json.dumps(ask), timeout=300)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.splitlines()[-1])
    finally:
        done_file.touch()
        shutil.chown(done_file, "alice", "alice")
        kernel.join(timeout=120)
        probe_file.unlink(missing_ok=True)
        done_file.unlink(missing_ok=True)
    assert got["found"] == [], f"bob read alice's secrets: {got['found']}"
    assert got["rendezvous_guess"] == 403 and got["rendezvous_wrong"] == 403, got
    assert got["controller_with_key"] is True, "the control failed: the probe of the controller gets no answer at all"
    assert got["controller_wrong_key"] is False, "alice's controller answered bob, who has not its key"
    assert got["owner"] in ("PermissionError", "FileNotFoundError"), got
    assert got["session_dir"] is False, f"bob can look into alice's session directory {probe['session_dir']}"
    assert "closed" in out.get("text", ""), out
    hub.stop("alice")
    assert jobs("alice") == []


def test_the_hubs_are_not_root_and_their_sudo_rule_allows_only_what_they_run_as_a_user(bed):
    """Both hubs run as the bed's hub account; as it, sudo runs the hub's commands as alice, and refuses a shell,
    another command, and anything as root."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
    import bed as testbed

    for place in testbed.hubs():
        pid = testbed.hub(place).pid()
        assert pid and psutil.Process(pid).username() == testbed.HUB_ACCOUNT, f"{place.dirname} runs as root"

    def sudo(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", f"--reuid={testbed.HUB_ACCOUNT}", f"--regid={testbed.HUB_ACCOUNT}",
                               "--init-groups", "--", "sudo", "-n", *argv], capture_output=True, text=True,
                              timeout=60, cwd="/")

    python = f"{bed['venv']}/bin/python"
    allowed = sudo("-u", "alice", "--preserve-env=LANG", "--", "scancel", "--version")
    assert allowed.returncode == 0, allowed.stderr
    tail = sudo("-u", "alice", python, "-s", "-P", "-m", "jupyter_hpcdl.spawner.usertail", "/nonexistent")
    assert "password is required" not in tail.stderr and "not allowed" not in tail.stderr, tail.stderr
    for argv in (["-u", "alice", "/bin/cat", "/etc/hostname"], ["-u", "alice", "/bin/sh", "-c", "id"],
                 ["-u", "alice", python, "-c", "print('x')"], ["-u", "root", "scancel", "--version"],
                 ["-u", testbed.HUB_ACCOUNT, "/bin/sh", "-c", "id"]):
        refused = sudo(*argv)
        assert refused.returncode != 0 and refused.stdout == "", (argv, refused.stdout)
        assert re.search(r"password is required|not allowed|may not run", refused.stderr), (argv, refused.stderr)
