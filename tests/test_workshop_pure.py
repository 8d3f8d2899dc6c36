"""Workshop mode's pure parts: the attendee list, what runs as each attendee, the copy that keeps their edits, and
the instructor's rows and page."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jupyter_hpcdl.workshop.attendees import parse_attendees
from jupyter_hpcdl.workshop.cli import attendee_steps
from jupyter_hpcdl.workshop.place import place
from jupyter_hpcdl.workshop.status import attendee_rows, render_page


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


def test_rows_say_who_runs_what_and_how_far_and_the_page_escapes_them():
    users = [{"name": "w02", "servers": {}},
             {"name": "w01", "servers": {"": {"ready": True, "user_options": {"partition": "cpu", "nodes": 1,
                                                                             "gpus_per_node": 0, "image": "os"}}}},
             {"name": "w03", "servers": {"x<b>": {"ready": False, "pending": "spawn", "user_options": {}}}}]
    allocations = {("w01", ""): {"job_id": "42", "nodes": ["node1"], "time_left": "1:59:00", "session": "training",
                                 "ranks": [{"loss": 0.5, "samples_per_s": 100.0}, {"loss": 0.7, "samples_per_s": 90.0}]}}
    rows = attendee_rows(users, allocations)
    assert [(r.user, r.state) for r in rows] == [("w01", "running"), ("w02", "no server"), ("w03", "starting")]
    w01 = rows[0]
    assert (w01.job_id, w01.job_nodes, w01.session, w01.ranks) == ("42", "node1", "training", 2)
    assert w01.loss == pytest.approx(0.6) and w01.samples_per_s == pytest.approx(190.0)
    page = render_page(rows, "room<4>")
    assert "x&lt;b&gt;" in page and "<b>" not in page and "room&lt;4&gt;" in page
    assert "3 attendees, 1 servers running, 1 training now" in page and page.count("<tr>") == 4


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
    try:
        pid = int(hub.stdout.readline())
        assert hub.stdout.readline().strip() == "armed"
        child = psutil.Process(pid)
        hub.send_signal(signal.SIGKILL)
        hub.wait(30)
        child.wait(30)  # psutil.TimeoutExpired: the service outlived its hub
    finally:
        hub.kill()
        for p in psutil.Process().children(recursive=True):
            p.kill()
