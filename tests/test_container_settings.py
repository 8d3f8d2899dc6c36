"""The site's container settings read without traitlets (the run path) agree with ContainerSite's (traitlets)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jupyter_hpcdl.containers.settings import SiteSettings, load_settings
from jupyter_hpcdl.containers.site import ContainerSite, load_site

SITE = {"ContainerSite": {"tools_dir": "/opt/tools", "allowed_mounts": ["~", "/scratch"], "fast_path": "off",
                          "registry": "http://127.0.0.1:5000", "allowed_modes": ["P1"], "allow_root": True,
                          "system_mounts": ["/etc/hosts", "/etc/passwd"], "udocker_dir": "~/.ud",
                          "execution_mode": "P1", "udocker": "/usr/bin/udocker"}}


def test_defaults_are_the_same_in_both():
    assert ContainerSite().settings() == SiteSettings()


def test_a_json_site_reads_the_same_in_both(tmp_path):
    path = tmp_path / "site.json"
    path.write_text(json.dumps(SITE))
    plain = load_settings(str(path))
    assert plain == load_site(str(path)).settings()
    assert plain.policy() == load_site(str(path)).policy() and plain.install() == load_site(str(path)).install()
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"ContainerSite": {"fast_path": "userns"}, "Other": {"x": 1}}))
    assert load_settings(str(partial)) == load_site(str(partial)).settings()


def test_a_python_site_goes_through_traitlets(tmp_path):
    path = tmp_path / "site_config.py"
    path.write_text("c.ContainerSite.allowed_mounts = ['~', '/work']\n")
    assert load_settings(str(path)).allowed_mounts == ("~", "/work")


def test_bad_settings_say_what_is_wrong(tmp_path, capsys):
    for body, says in [({"ContainerSite": {"fast_path": "fast"}}, "fast_path must be one of"),
                       ({"ContainerSite": {"allowed_modes": ["Z9"]}}, "unknown udocker modes"),
                       ({"ContainerSite": {"allowed_mounts": "/scratch"}}, "allowed_mounts has the wrong type"),
                       ({"ContainerSite": {"allowed_mounts": [1]}}, "allowed_mounts has the wrong type"),
                       ({"ContainerSite": []}, "expected")]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(body))
        with pytest.raises(ValueError, match=says):
            load_settings(str(path))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_settings(str(tmp_path / "broken.json"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(str(tmp_path / "missing.json"))
    (tmp_path / "extra.json").write_text(json.dumps({"ContainerSite": {"fast_pth": "off"}}))
    assert load_settings(str(tmp_path / "extra.json")) == SiteSettings()
    assert "no setting 'fast_pth'" in capsys.readouterr().err


def test_the_containers_cli_does_not_import_traitlets():
    code = ("import sys, jupyter_hpcdl.containers.cli, jupyter_hpcdl.containers.udocker; "
            "print('traitlets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
