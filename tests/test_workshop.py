"""Workshop mode on the bed: an instructor prepares ten attendees from a list (image, container, the notebooks in each
home, the workshop's group), they all spawn with the group's limits (the CPU partition, the small image), the
instructor (bob, through the ``instructor`` role) sees them on the workshop service's page (read from the hub's API
and the queue, never from an attendee's server: one that records every request's headers is sent no credential while
the instructor looks) while an attendee may not, and the clean-up leaves no server, job or
member behind."""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hubclient import Hub

pytestmark = pytest.mark.testbed
REPO = Path(__file__).resolve().parents[1]
GROUP = "workshop"


def workshop(bed, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": Hub(bed).token}
    return subprocess.run([f"{bed['venv']}/bin/hpcdl-workshop", "--hub-url", bed["hub_url"], "--group", GROUP, *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def user_token(hub: Hub, user: str) -> str:
    status, body = hub.api("POST", f"/hub/api/users/{user}/tokens", {"note": "workshop test", "expires_in": 900})
    assert status == 201, body
    return body["token"]


# An attendee's server is code the attendee controls: this one (their own Jupyter config) records every request's
# headers, as a curious attendee might, to see whether the instructor's page hands it a token.
RECORDER = r'''
import json, os
def _record(handler):
    with open(os.path.expanduser("~/hpcdl-headers.jsonl"), "a") as f:
        f.write(json.dumps({"path": handler.request.path, "headers": dict(handler.request.headers)}) + "\n")
c.ServerApp.tornado_settings = {"log_function": _record}
'''


def recorder(name: str):
    """The header recorder in ``name``'s Jupyter config, and where it writes."""
    home = Path(pwd.getpwnam(name).pw_dir)
    config, log = home / ".jupyter" / "jupyter_server_config.py", home / "hpcdl-headers.jsonl"
    config.parent.mkdir(exist_ok=True)
    config.write_text(RECORDER)
    for path in (config.parent, config):
        os.chown(path, pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid)
    log.unlink(missing_ok=True)
    return config, log


def marker(bed, name: str, mark: str) -> None:
    """A request through the proxy to ``name``'s server that the recorder notes (no credentials)."""
    try:
        urllib.request.urlopen(urllib.request.Request(f"{bed['hub_url']}/user/{name}/api/status",
                                                      headers={"X-Hpcdl-Mark": mark}), timeout=30).close()
    except urllib.error.HTTPError:
        pass  # refused without credentials, as it should be: the recorder saw it first


@pytest.fixture
def attendees(bed, tmp_path):
    names = bed["workshop_users"][:10]
    listing = tmp_path / "room.txt"
    listing.write_text("# the room\n" + "\n".join(names) + "\n\n" + names[0] + "  # twice: once is enough\n")
    yield names, listing
    for name in names:  # the header recorder, also when the test failed half-way
        (Path(pwd.getpwnam(name).pw_dir) / ".jupyter" / "jupyter_server_config.py").unlink(missing_ok=True)
    done = workshop(bed, "cleanup")  # also when the test failed half-way
    assert done.returncode == 0, done.stderr


def test_ten_attendees_prepared_spawn_within_the_limits_are_seen_by_the_instructor_and_cleaned_up(bed, attendees):
    names, listing = attendees
    hub = Hub(bed)
    material = Path("/tmp/hpcdl-workshop-material")  # readable by the attendees (the test's tmp_path is not)
    subprocess.run(["rm", "-rf", str(material)], check=True)
    subprocess.run(["cp", "-r", str(REPO / "notebooks"), str(material)], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(material)], check=True)
    first = Path(pwd.getpwnam(names[0]).pw_dir) / "workshop"
    subprocess.run(["rm", "-rf", str(first)], check=True)

    done = workshop(bed, "prepare", "--attendees", str(listing), "--image", "hpcdl/os:latest",
                    "--material", str(material), "--python", f"{bed['venv']}/bin/python")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["user"] for r in lines] == names and all(r["ok"] and r["copied"] + r["kept"] >= 5 for r in lines)
    notebook = first / "01-first-training.ipynb"
    assert notebook.stat().st_uid == pwd.getpwnam(names[0]).pw_uid
    notebook.write_text(notebook.read_text().replace("A first interactive training", "My edited training"))
    again = workshop(bed, "prepare", "--attendees", str(listing), "--image", "hpcdl/os:latest",
                     "--material", str(material), "--python", f"{bed['venv']}/bin/python")
    assert again.returncode == 0, again.stderr
    assert "My edited training" in notebook.read_text(), "a second prepare overwrote an attendee's edits"
    assert sorted(hub.api("GET", f"/hub/api/groups/{GROUP}")[1]["users"]) == names

    config, headers = recorder(names[2])
    # the group's limits: the CPU partition and the small image, 2 hours at most
    status, body = hub.api("POST", f"/hub/api/users/{names[0]}/server", {"partition": "gpu"})
    assert status == 400 and "choose one of: cpu" in body["message"], body
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda n: hub.api("POST", f"/hub/api/users/{n}/server", {}, timeout=120), names))
    assert all(status in (201, 202) for status, _ in answers), answers
    for name in names:
        server = hub.wait_ready(name, timeout=600)
        assert server["user_options"]["partition"] == "cpu" and server["user_options"]["image"] == "os"
    queued = subprocess.run(["squeue", "-h", "-u", ",".join(names), "-o", "%u %P %T"], capture_output=True,
                            text=True, check=True).stdout.split("\n")
    assert sorted(line.split()[0] for line in queued if line) == names
    assert all(line.split()[1:] == ["cpu", "RUNNING"] for line in queued if line), queued

    # the instructor's page: bob may see it, an attendee may not
    for name in names:
        hub.wait_routed(name)
    marker(bed, names[2], "before")  # from here on, the recorder must see no credential of anyone
    path = "/services/hpcdl-workshop/api/status"
    deadline = time.monotonic() + 60
    while True:
        status, report = hub.api("GET", path, token=user_token(hub, "bob"))
        rows = report.get("attendees", []) if isinstance(report, dict) else []
        if status == 200 and len(rows) == 10 and all(r["job_id"] for r in rows):
            break
        assert time.monotonic() < deadline, (status, report)
        time.sleep(2)
    assert sorted(r["user"] for r in rows) == names
    jobs = {line.split()[0]: line.split()[1] for line in subprocess.run(
        ["squeue", "-h", "-u", ",".join(names), "-o", "%i %B"], capture_output=True, text=True, check=True).stdout.splitlines()}
    assert {r["job_id"]: r["job_host"] for r in rows} == jobs, "the rows' jobs are not the attendees' jobs"
    assert all(r["state"] == "running" and r["partition"] == "cpu" and r["job_state"] == "running: RUNNING"
               and not r["error"] for r in rows), rows
    left = [sum(int(part) * 60 ** i for i, part in enumerate(reversed(r["time_left"].split(":")))) for r in rows]
    assert all(0 < s <= 2 * 3600 for s in left), f"walltime left beyond the group's 2 hours: {left}"
    status, page = hub.api("GET", "/services/hpcdl-workshop/", token=user_token(hub, "bob"))
    assert status == 200 and page.count("<tr>") == 11 and "10 servers running" in page
    status, _ = hub.api("GET", path, token=user_token(hub, names[1]))
    assert status == 403, "an attendee could read the instructor's page"
    listed = workshop(bed, "status", timeout=120)
    assert listed.returncode == 0 and listed.stdout.count("partition=cpu") == 10, listed.stdout + listed.stderr
    marker(bed, names[2], "after")
    deadline = time.monotonic() + 30  # the server notes a request once it has answered it
    while True:
        seen = [json.loads(line) for line in headers.read_text().splitlines()]
        marks = [i for i, r in enumerate(seen) if r["headers"].get("X-Hpcdl-Mark") in ("before", "after")]
        if len(marks) == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(marks) == 2, f"the control failed: the recorder did not see both marks: {seen}"
    between = seen[marks[0]:marks[1] + 1]
    credentials = [r for r in between if {"Authorization", "Cookie"} & set(r["headers"]) or "token" in r["path"]]
    assert credentials == [], f"a credential reached an attendee's server while the instructor looked: {credentials}"

    # the clean-up: no server, no job, no member
    done = workshop(bed, "cleanup")
    assert done.returncode == 0 and "stopped 10 server(s) of 10 attendee(s)" in done.stdout, done.stdout + done.stderr
    assert hub.api("GET", f"/hub/api/groups/{GROUP}")[1]["users"] == []
    assert subprocess.run(["squeue", "-h", "-u", ",".join(names)], capture_output=True, text=True).stdout == ""
