"""Workshop mode's pure parts: the attendee list, what runs as each attendee, the copy that keeps their edits, and
the instructor's rows and page from the hub's models and the queue, read once per refresh within a deadline."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import datetime, timezone

import pytest

from jupyter_hpcdl.batchsystems.scheduler import PENDING, RUNNING, JobInfo
from jupyter_hpcdl.batchsystems.slurm import _SEP, Slurm
from jupyter_hpcdl.commands import Result
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.workshop.attendees import parse_attendees
from jupyter_hpcdl.workshop.cli import attendee_steps
from jupyter_hpcdl.workshop.hub import HubAPI, HubError
from jupyter_hpcdl.workshop.place import place
from jupyter_hpcdl.workshop.room import Room
from jupyter_hpcdl.workshop.status import attendee_rows, render_lines, render_page


def test_the_attendee_list_takes_names_once_and_refuses_anything_else_by_line():
    assert parse_attendees("# room 4\nw01\n\nw02  # late\nw01\n") == ["w01", "w02"]
    with pytest.raises(ValueError, match="line 2: 'w02; rm -rf ~' is not a user name"):
        parse_attendees("w01\nw02; rm -rf ~\n")
    with pytest.raises(ValueError, match="names nobody"):
        parse_attendees("# nobody yet\n")


def test_each_attendee_runs_argv_lists_with_a_checked_image():
    steps = attendee_steps("/opt/venv/bin/python", "hpcdl/os:latest", "/shared/nb", "~/workshop")
    assert [what for what, _ in steps] == ["pull", "container", "material"]
    assert steps[0][1] == ["/opt/venv/bin/python", "-m", "jupyter_hpcdl.containers", "pull", "hpcdl/os:latest"]
    with pytest.raises(ValueError):
        attendee_steps("/opt/venv/bin/python", "hpcdl/os:latest; id", None, "~/workshop")


def test_the_copy_keeps_what_the_attendee_has_and_skips_hidden_files(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "home/workshop"
    (src / "data").mkdir(parents=True)
    (src / "01.ipynb").write_text("new")
    (src / "data/a.csv").write_text("1")
    (src / ".ipynb_checkpoints").mkdir()
    (src / ".ipynb_checkpoints/01-checkpoint.ipynb").write_text("x")
    dest.mkdir(parents=True)
    (dest / "01.ipynb").write_text("mine")
    assert place(src, dest) == {"copied": ["data/a.csv"], "kept": ["01.ipynb"]}
    assert (dest / "01.ipynb").read_text() == "mine" and not (dest / ".ipynb_checkpoints").exists()
    out = subprocess.run([sys.executable, "-m", "jupyter_hpcdl.workshop.place", str(src), str(dest)],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"copied": [], "kept": ["01.ipynb", "data/a.csv"]}


def _users() -> list[dict]:
    options = {"partition": "cpu", "nodes": 1, "gpus_per_node": 0, "image": "os", "walltime": "02:00:00"}
    return [{"name": "w02", "servers": {}},
            {"name": "w01", "servers": {"": {"ready": True, "started": "2026-12-05T10:00:00.000000Z",
                                             "user_options": options, "state": {"job_id": "42", "job_host": "n1"}}}},
            {"name": "w03", "servers": {"x<b>": {"ready": False, "pending": "spawn", "user_options": {},
                                                 "state": {"job_id": "43"}}}},
            {"name": "w04", "servers": {"": {"ready": True, "user_options": options}}}]  # no state: no scope


def test_rows_say_who_runs_what_from_the_hub_and_the_queue_and_the_page_escapes_them():
    jobs = {"42": JobInfo("42", RUNNING, "RUNNING", batch_host="node1"),
            "43": JobInfo("43", PENDING, "PENDING", "Resources")}
    now = datetime(2026, 12, 5, 10, 30, 15, tzinfo=timezone.utc)
    rows = attendee_rows(_users(), jobs, now)
    assert [(r.user, r.state) for r in rows] == [("w01", "running"), ("w02", "no server"), ("w03", "starting"),
                                                 ("w04", "running")]
    w01, _, w03, w04 = rows
    assert (w01.job_id, w01.job_state, w01.job_host, w01.time_left) == ("42", "running: RUNNING", "node1", "1:29:45")
    assert (w03.job_id, w03.job_state, w03.time_left) == ("43", "pending: PENDING (Resources)", "")
    assert w04.job_id == "" and "admin:server_state" in w04.error
    page = render_page(rows, "room<4>")
    assert "x&lt;b&gt;" in page and "<b>" not in page and "room&lt;4&gt;" in page
    assert "4 attendees, 2 servers running, 1 jobs waiting" in page and page.count("<tr>") == 5
    unread = attendee_rows(_users(), None, now, listing_error="squeue did not answer in 15 s")
    assert unread[0].job_id == "42" and unread[0].job_state == "" and "squeue did not answer" in unread[0].error
    lines = render_lines(rows)  # status on a terminal: a server's name an attendee chose reaches it escaped
    assert lines[0] == ("user=w01  state=running  partition=cpu  nodes=1  gpus_per_node=0  image=os  job_id=42  "
                        "job_state=running: RUNNING  job_host=node1  time_left=1:29:45")
    named = attendee_rows([{"name": "w05", "servers": {"\x1b[2J\x07": {"ready": True, "user_options": {}}}}], jobs, now)
    assert "server=\\x1b[2J\\x07" in render_lines(named)[0] and "\x1b" not in render_lines(named)[0]


def test_the_workshops_token_goes_to_the_hubs_api_only():
    api = HubAPI("http://127.0.0.1:9", "secret")
    for elsewhere in ("http://127.0.0.1:8000/user/w01/jupyter-hpcdl/allocation", "users/w01"):
        with pytest.raises(ValueError, match="not a path of the hub's API"):
            api.call("GET", elsewhere)
    assert not hasattr(api, "allocation")


class _Hub:
    """The hub's side of a room (the bed's test runs the real one): members with servers, optionally slow."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.reads = delay, 0

    def members_with_servers(self, group: str) -> list[dict]:
        self.reads += 1
        time.sleep(self.delay)
        return _users()


def test_the_room_is_read_once_per_refresh_and_gives_up_naming_what_hung():
    listings = []

    async def squeue(argv, timeout):
        listings.append(argv)
        return Result(tuple(argv), 0, _SEP.join(["42", "RUNNING", "None", "N/A", "node1", "w01"]) + "\n", "")

    async def main():
        hub = _Hub()
        room = Room(hub, "workshop", JobQueue(Slurm(), interval=60, runner=squeue), max_age=60)
        first, again = await room.rows(), await room.rows()
        assert first is again and hub.reads == 1 and len(listings) == 1
        assert [r.job_state for r in first if r.user == "w01"] == ["running: RUNNING"]
        hung = Room(_Hub(delay=2), "workshop", JobQueue(Slurm(), interval=60, runner=squeue), deadline=0.3)
        t0 = time.monotonic()
        with pytest.raises(HubError, match="no reading of group workshop within 0 s.*squeue"):
            await hung.rows()
        assert time.monotonic() - t0 < 1.5

    asyncio.run(main())


def test_a_managed_service_ends_with_the_hub_that_started_it():
    """The hub starts its services in sessions of their own, so a hub that crashes or restarts would leave the
    service running on its port; a service that the hub manages asks to end with it."""
    import signal

    import psutil

    service = ("import time; from jupyter_hpcdl.workshop.service import end_with_parent; end_with_parent(); "
               "print('armed', flush=True); time.sleep(300)")
    hub = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                            f"p = subprocess.Popen([sys.executable, '-c', {service!r}], start_new_session=True); "
                            "print(p.pid, flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = psutil.Process(int(hub.stdout.readline()))
        assert hub.stdout.readline().strip() == "armed"
        hub.send_signal(signal.SIGKILL)
        hub.wait(30)
        child.wait(30)  # psutil.TimeoutExpired: the service outlived its hub
    finally:
        hub.kill()  # only what this test started (its worker runs other tests' processes meanwhile)
        hub.wait(30)
        if child is not None:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
