"""Another user of the site against alice, on the bed: what each attack gets, not only the status codes.

- A job log that is a link to a file only root may read: the failed spawn's message shows why the log is not shown,
  never that file (the hub reads a log's end as its user, ``spawner/usertail.py``).
- bob listening on the port alice's job reported, as soon as it is reported: he cannot, and alice's server answers
  ``/user/alice/`` (the job listens before it reports; the server accepts on that socket)."""
from __future__ import annotations

import re
import secrets
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
