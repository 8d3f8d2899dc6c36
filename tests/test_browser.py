"""What a person sees, in a real browser (Playwright + Debian's Chromium): log in, fill the form (a refused value
shows its message; the script preview follows the fields), watch the progress, land in JupyterLab, run a cell in
the containerized kernel. Screenshots are kept under artifacts/screenshots."""
import re
from pathlib import Path

import pytest

from browser import SHOTS, hub_login, quiet_lab_settings
from hubclient import Hub

pytestmark = pytest.mark.testbed


def test_login_form_progress_lab_and_a_cell_in_the_container(bed, alice, browser_page):
    page, hub = browser_page, Hub(bed)
    quiet_lab_settings(Path(alice.home) / ".jupyter/lab/user-settings", owner="alice")
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

        page.fill("#hpcdl-nodes", "1")
        page.fill("#hpcdl-gpus", "2")
        page.fill("#hpcdl-walltime", "00:20:00")
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
        page.wait_for_function("document.querySelector('.jp-OutputArea-output').innerText.includes('0,1')",
                               timeout=60_000)
        assert output.inner_text().split() == [bed["identity"]["build"], "0,1"]
        page.screenshot(path=str(SHOTS / "05-cell.png"))
    finally:
        if hub.server("alice"):
            hub.stop("alice")
        for notebook in Path(alice.home).glob("Untitled*.ipynb"):
            notebook.unlink()
