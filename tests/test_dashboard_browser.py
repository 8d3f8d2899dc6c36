"""The dashboard as a person sees it, in Debian's Chromium against a real JupyterLab with the extension installed:
outside a batch job the panel says so, its button opens the dashboard, two local ranks train and the charts update
live, a scaling run draws its plot; inside alice's two-node Slurm job (through the hub) the panel shows the job,
the walltime left (also in the status bar) and the ranks the notebook started in her containers."""
import re
import subprocess
from pathlib import Path

import pytest

from browser import PANEL_TAB, SHOTS, hub_login, open_panel, quiet_lab_settings
from hubclient import Hub
from jupyterserver import running_jupyter

LINES = ".hpcdl-dashboard .bqplot path.line"


@pytest.fixture
def local_lab(tmp_path):
    """JupyterLab outside any batch job, as the test runner (root), in a scratch home."""
    home = tmp_path / "home"
    quiet_lab_settings(home / "settings")
    with running_jupyter("jupyterlab", home, tmp_path / "lab.log",
                         f"--LabApp.user_settings_dir={home / 'settings'}",
                         f"--LabApp.workspaces_dir={home / 'workspaces'}",
                         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                         env={"HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": "2"}) as lab:
        yield lab


def _open_dashboard(page, kernel_status: re.Pattern):
    page.locator(".jp-hpcdl-open-dashboard").click()
    page.locator(".jp-StatusBar-Widget", has_text=kernel_status).wait_for(timeout=180_000)
    page.locator(".hpcdl-dashboard").wait_for(state="visible", timeout=120_000)


def _set_number(page, scope: str, label: str, value: int | str):
    box = page.locator(f"{scope} .widget-inline-hbox", has=page.locator("label", has_text=re.compile(f"^{label}$")))
    field = box.locator("input")
    field.fill(str(value))
    field.press("Tab")  # ipywidgets sends the value on change


def _line_paths(page) -> list[str]:
    return page.eval_on_selector_all(LINES, "els => els.map(e => e.getAttribute('d') || '')")


def _train_and_watch_charts_update(page, epochs: int, timeout: float) -> None:
    _set_number(page, ".hpcdl-dashboard", "epochs", epochs)
    page.locator(".hpcdl-dashboard button", has_text="Train").click()
    # the charts' lines, or the dashboard's own error (said in the failure instead of a bare timeout)
    page.wait_for_function(f"document.querySelectorAll('{LINES}').length >= 6 || "
                           "document.querySelector('.hpcdl-dashboard .hpcdl-error') !== null", timeout=timeout * 1000)
    errors = page.locator(".hpcdl-dashboard .hpcdl-error")
    assert errors.count() == 0, f"the dashboard failed to train: {errors.first.inner_text()}"
    first = _line_paths(page)
    page.wait_for_function(f"""(first) => {{ const now = [...document.querySelectorAll('{LINES}')]
                                             .map(e => e.getAttribute('d') || '');
                                           return now.length >= 6 && now.some((d, i) => d !== first[i]); }}""",
                           arg=first, timeout=timeout * 1000)
    # bqplot draws a figure's legend after its marks: wait for it, and say what was there if it never came
    legends = ".hpcdl-dashboard .bqplot .legendtext"
    try:
        page.wait_for_function(f"[...document.querySelectorAll('{legends}')]"
                               ".filter(e => e.textContent.trim() === 'rank 1').length >= 3", timeout=60_000)
    except pytest.importorskip("playwright.sync_api").TimeoutError:
        shown = page.eval_on_selector_all(legends, "els => els.map(e => e.textContent.trim())")
        raise AssertionError(f"a line per rank: each of the 3 charts should name rank 1; the legends say {shown}")


@pytest.mark.ranks
def test_outside_a_job_the_panel_says_so_and_the_dashboard_trains_and_scales(local_lab, browser_page):
    url, token = local_lab
    page = browser_page
    page.goto(f"{url}/lab?reset&token={token}")
    page.locator(PANEL_TAB).wait_for(timeout=60_000)
    open_panel(page)
    page.locator(".jp-hpcdl-not-in-job").wait_for(timeout=30_000)
    assert "Not in a batch job" in page.inner_text(".jp-hpcdl-not-in-job")
    assert not page.locator(".jp-hpcdl-statusbar").is_visible(), "no walltime outside a job"

    _open_dashboard(page, re.compile(r"Python 3 \(ipykernel\) \| Idle"))
    _train_and_watch_charts_update(page, epochs=40, timeout=180)
    page.screenshot(path=str(SHOTS / "10-dashboard-live.png"))
    page.locator(".hpcdl-dashboard .hpcdl-status", has_text="done: 40 epochs").wait_for(timeout=240_000)
    bar = page.locator(".hpcdl-dashboard .widget-hprogress .progress-bar")
    assert bar.get_attribute("style").replace(" ", "").find("width:100%") >= 0
    assert page.locator(".hpcdl-dashboard .hpcdl-rank-table tr[data-rank]").count() == 2

    page.locator(".hpcdl-dashboard-tabs .lm-TabBar-tab", has_text="Scaling").click()
    page.locator(".hpcdl-scaling button", has_text="Run scaling").click()
    page.locator(".hpcdl-scaling .hpcdl-scaling-table").wait_for(timeout=300_000)
    assert page.eval_on_selector_all(".hpcdl-scaling .bqplot path.line",
                                     "els => els.filter(e => (e.getAttribute('d') || '').length > 4).length") >= 3
    page.locator(".hpcdl-scaling button", has_text="Export CSV + PNG").click()
    page.locator(".hpcdl-scaling .hpcdl-exported").wait_for(timeout=30_000)
    page.screenshot(path=str(SHOTS / "11-scaling.png"))
    page.locator(".hpcdl-dashboard-tabs .lm-TabBar-tab", has_text="Training").click()
    page.locator(".hpcdl-dashboard button", has_text="Close").click()
    page.locator(".hpcdl-dashboard .hpcdl-status", has_text="ranks stopped").wait_for(timeout=60_000)


@pytest.mark.testbed
def test_in_alices_job_the_panel_shows_the_allocation_and_the_ranks(bed, alice, browser_page):
    page, hub = browser_page, Hub(bed)
    quiet_lab_settings(Path(alice.home) / ".jupyter/lab/user-settings", owner="alice")
    status, body = hub.api("POST", "/hub/api/users/alice/server", {"nodes": 2, "gpus_per_node": 1,
                                                                    "walltime": "00:30:00"})
    assert status in (201, 202), body
    try:
        hub.wait_ready("alice")
        job = subprocess.run(["squeue", "-h", "-u", "alice", "-t", "RUNNING", "-o", "%i"], capture_output=True,
                             text=True, check=True).stdout.split()
        hub_login(page, bed, "alice")
        page.goto(bed["hub_url"] + "/user/alice/lab?reset")
        page.locator(PANEL_TAB).wait_for(timeout=120_000)
        open_panel(page)
        page.locator(".jp-hpcdl-job-id").wait_for(timeout=30_000)
        assert page.inner_text(".jp-hpcdl-job-id").strip() in job
        assert page.inner_text(".jp-hpcdl-partition").strip() == "gpu"
        assert re.sub(r"\s", "", page.inner_text(".jp-hpcdl-nodes")) in ("node1,node2", "node[1-2]")
        assert page.inner_text(".jp-hpcdl-gpus").strip() == "1 × 2 = 2"
        assert re.search(r"\b(29|30|0:29|0:30):\d\d", page.inner_text(".jp-hpcdl-time-left"))
        assert f"Job {page.inner_text('.jp-hpcdl-job-id').strip()}" in page.inner_text(".jp-hpcdl-statusbar")

        _open_dashboard(page, re.compile(r"container\) \| Idle"))
        _train_and_watch_charts_update(page, epochs=30, timeout=300)
        newest = ".jp-hpcdl-session-block:first-child"  # a block per session, the most recently reported first
        ranks = page.locator(f"{newest} .jp-hpcdl-ranks tr[data-rank]")  # what the notebook's session told the owner
        page.wait_for_function(f"document.querySelectorAll('{newest} .jp-hpcdl-ranks tr[data-rank]').length == 2",
                               timeout=30_000)
        assert page.get_attribute(newest, "data-session-id"), "each block names its session"
        assert {ranks.nth(i).inner_text().split()[1] for i in range(2)} == {"node1", "node2"}
        assert {ranks.nth(i).locator("td").nth(3).inner_text() for i in range(2)} == {"userns"}, \
            "each rank's container mode: the bed's nodes run the fast path"
        page.locator(".jp-hpcdl-containers", has_text="fast path (user namespaces)").wait_for(timeout=30_000)
        assert "user namespaces work here" in page.get_attribute(".jp-hpcdl-containers", "title")
        page.screenshot(path=str(SHOTS / "12-panel-in-job.png"))
        page.locator(".hpcdl-dashboard .hpcdl-status", has_text="done: 30 epochs").wait_for(timeout=300_000)
        page.locator(".hpcdl-dashboard button", has_text="Close").click()
        page.locator(".hpcdl-dashboard .hpcdl-status", has_text="ranks stopped").wait_for(timeout=60_000)
    finally:
        if hub.server("alice"):
            hub.stop("alice")
        for notebook in Path(alice.home).glob("Untitled*.ipynb"):
            notebook.unlink()
