"""The hub's sudo rule: the builder's text, the copy in docs/admin.md, and what it refuses to write."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from jupyter_hpcdl.spawner.sudoers import SudoRule, rule_for, sudoers_text, user_commands

DOC = Path(__file__).resolve().parents[1] / "docs" / "admin.md"
EXAMPLE = SudoRule("jupyterhub", "/opt/jupyter-hpcdl/venv/bin/python", ("/usr/bin/sbatch", "/usr/bin/scancel"),
                   ("/usr/bin/mkdir", "/usr/bin/rm"))


def test_the_admin_guide_shows_the_rule_the_builder_writes():
    block = re.search(r"<!-- sudoers: .*?-->\n```\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/admin.md has no sudoers block"
    assert block.group(1) == sudoers_text(EXAMPLE)


def test_the_rule_covers_every_command_the_hub_runs_as_a_user_and_never_root():
    text = sudoers_text(EXAMPLE)
    for argv in user_commands(EXAMPLE):
        assert " ".join(argv) in text, argv
    assert "(ALL, !root) NOPASSWD: SETENV:" in text and "ALL = (ALL) " not in text
    if shutil.which("visudo"):
        r = subprocess.run(["visudo", "-cf", "-"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("rule, message", [
    (SudoRule("hub, ALL", "/py", ("/usr/bin/sbatch",), ()), "sudoers would read as syntax"),
    (SudoRule("hub", "/py -c import os", ("/usr/bin/sbatch",), ()), "sudoers would read as syntax"),
    (SudoRule("hub", "python", ("/usr/bin/sbatch",), ()), "must be an absolute path"),
])
def test_a_name_sudoers_would_misread_is_refused(rule, message):
    with pytest.raises(ValueError, match=message):
        sudoers_text(rule)


def test_the_schedulers_commands_are_found_where_sudo_looks_or_named_missing():
    if not shutil.which("sbatch", path="/usr/bin"):
        with pytest.raises(ValueError, match="sbatch is not on sudo's secure_path"):
            rule_for("hub", ["slurm"])
    else:
        assert rule_for("hub", ["slurm"]).job_commands == ("/usr/bin/sbatch", "/usr/bin/scancel")
