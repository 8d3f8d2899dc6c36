"""Playwright with Debian's Chromium (never a downloaded browser), shared by the browser tests; screenshots are kept
under artifacts/screenshots."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
PANEL_TAB = '.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="jupyter-hpcdl-panel"]'
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def chromium_page(profile: Path, width: int = 1280, height: int = 900):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: testbed/install.sh installs Debian's chromium")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True, args=ARGS,
                                                   viewport={"width": width, "height": height})
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()


def quiet_lab_settings(settings_dir: Path, owner: str | None = None) -> None:
    """No news toast in JupyterLab (it would ask the network)."""
    d = settings_dir / "@jupyterlab/apputils-extension"
    d.mkdir(parents=True, exist_ok=True)
    (d / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    if owner:
        subprocess.run(["chown", "-R", f"{owner}:{owner}", str(settings_dir.parents[1])], check=True)


def hub_login(page, bed: dict, user: str) -> None:
    password = (Path(bed["hub_dir"]) / "password").read_text().strip()
    page.goto(bed["hub_url"] + "/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_load_state()


def open_panel(page) -> None:
    """The HPC allocation panel in JupyterLab's left sidebar."""
    page.locator(PANEL_TAB).click()
    page.locator("#jupyter-hpcdl-panel").wait_for(state="visible", timeout=30_000)
