"""A newcomer's first contact, in a real browser (Playwright + Debian's Chromium): log in, try the form (a refused
value shows its message; the script preview follows the fields), then Start with every default, watch the
progress, land in JupyterLab, run a cell in the containerized kernel, get the notebooks from the panel and run the
first one top to bottom: its dashboard draws and its summary says one rank trained in the job. A screenshot at each
step, under artifacts/screenshots (``bash testbed/screenshots`` puts the docs' copies in docs/images)."""
import json
import pwd
import re
import shutil
from pathlib import Path

import pytest

from browser import SHOTS, hub_login, open_panel, quiet_lab_settings
from hubclient import Hub

pytestmark = pytest.mark.testbed


def test_a_newcomer_starts_with_the_defaults_and_runs_the_first_notebook_in_the_browser(bed, alice, browser_page):
    page, hub = browser_page, Hub(bed)
    quiet_lab_settings(Path(alice.home) / ".jupyter/lab/user-settings", owner="alice")
    notebooks = Path(alice.home) / "hpcdl-notebooks"
    had_notebooks = notebooks.exists()
    try:
        hub_login(page, bed, "alice")
        page.wait_for_selector("#hpcdl-partition", timeout=60_000)
        assert "8 / 8" in page.inner_text(".hpcdl-availability")
        page.screenshot(path=str(SHOTS / "01-form.png"), full_page=True)

        page.fill("#hpcdl-gpus", "3")
        page.wait_for_function("document.getElementById('hpcdl-script').textContent.includes('--gres=gpu:3')")
        assert page.inner_text("#hpcdl-gpu-hours") == "3"

        page.fill("#hpcdl-nodes", "9")
        page.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
        page.wait_for_selector(".spawn-error-msg", timeout=30_000)
        assert "nodes: 9 is out of range; allowed: 1 to 2" in page.inner_text(".spawn-error-msg")
        page.screenshot(path=str(SHOTS / "02-refused.png"), full_page=True)

        page.goto(bed["hub_url"] + "/hub/spawn")  # the form afresh: every default accepted, as a newcomer would
        page.wait_for_selector("#hpcdl-partition", timeout=60_000)
        page.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
        page.wait_for_function("(document.getElementById('progress-log') || {textContent: ''}).textContent"
                               ".includes('Submitted job')", timeout=60_000)
        page.screenshot(path=str(SHOTS / "03-progress.png"), full_page=True)
        page.wait_for_url(re.compile(r".*/user/alice/lab.*"), timeout=180_000)
        page.goto(bed["hub_url"] + "/user/alice/lab?reset")  # a fresh workspace: the launcher, no restored tabs

        card = page.locator(".jp-LauncherCard", has_text="container").first
        card.wait_for(timeout=120_000)
        page.screenshot(path=str(SHOTS / "04-lab.png"))
        card.click()
        editor = page.locator(".jp-Notebook .jp-Cell .cm-content").first
        editor.wait_for(timeout=60_000)
        # run only once the kernel in the container is connected and idle (as a person would see it)
        page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"container\) \| Idle")).wait_for(timeout=120_000)
        editor.click()
        page.keyboard.insert_text("import json, os; print(json.load(open('/etc/hpcdl-image.json'))['build'], "
                                  "os.environ['CUDA_VISIBLE_DEVICES'])")
        page.keyboard.press("Shift+Enter")
        output = page.locator(".jp-OutputArea-output").first
        output.wait_for(timeout=120_000)
        page.wait_for_function("document.querySelector('.jp-OutputArea-output').innerText.trim().split(/\\s+/)"
                               ".length == 2", timeout=60_000)
        assert output.inner_text().split() == [bed["identity"]["build"], "0"], "the form's default: one GPU"
        page.screenshot(path=str(SHOTS / "05-cell.png"))

        # the notebooks, from the panel: copied into her home, the first opened on her container's kernel
        open_panel(page)
        page.locator(".jp-hpcdl-get-notebooks").click()
        page.locator(".jp-hpcdl-note", has_text="notebooks in").wait_for(timeout=30_000)
        page.locator(".lm-TabBar-tab.lm-mod-current", has_text="01-first-training.ipynb").wait_for(timeout=30_000)
        assert (notebooks / "01-first-training.ipynb").stat().st_uid == pwd.getpwnam("alice").pw_uid
        assert (notebooks / "horovod_keras_digits.py").is_file(), "notebook 5's script comes along"
        page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"container\) \| Idle")).wait_for(timeout=180_000)
        page.screenshot(path=str(SHOTS / "06-notebooks.png"))

        # run all cells: the ranks start in the job (one per GPU: one), the dashboard trains, the summary prints
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        page.locator(".hpcdl-dashboard .bqplot path.line").first.wait_for(state="attached", timeout=300_000)
        summary = page.locator(".jp-OutputArea-output", has_text='"notebook": "01-first-training"')
        summary.wait_for(timeout=600_000)
        result = json.loads(summary.inner_text())
        assert result["where"] == "allocation" and result["ranks"] == 1 and result["epochs"] == 4, result
        assert result["loss_last_epoch"] < result["loss_first_epoch"], result
        assert [r["container"] for r in result["per_rank"].values()] == ["userns"], result
        page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"container\) \| Idle")).wait_for(timeout=180_000)
        lines = page.locator(".hpcdl-dashboard .bqplot path.line").first
        lines.scroll_into_view_if_needed()  # (JupyterLab draws only the cells in view)
        lines.wait_for(state="visible", timeout=60_000)
        page.screenshot(path=str(SHOTS / "07-first-notebook.png"))
    finally:
        if hub.server("alice"):
            hub.stop("alice")
        for notebook in Path(alice.home).glob("Untitled*.ipynb"):
            notebook.unlink()
        if not had_notebooks:
            shutil.rmtree(notebooks, ignore_errors=True)
