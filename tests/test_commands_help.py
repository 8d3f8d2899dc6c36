"""Each command the package installs answers --help with its own name, and the workshop's documented example parses
in either order of its options."""
from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

SCRIPTS = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_command_answers_help_with_its_name(name, capsys):
    module, func = SCRIPTS[name].split(":")
    with pytest.raises(SystemExit) as done:
        getattr(importlib.import_module(module), func)(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"usage: {name} "), out[:300]


def test_the_workshops_example_parses_with_the_group_before_or_after_the_command():
    from jupyter_hpcdl.workshop.cli import _parser

    for argv in (["--hub-url", "http://hub", "--group", "ws", "status"], ["status", "--group", "ws"]):
        args = _parser().parse_args(argv)
        assert args.cmd == "status" and "ws" in (args.group, getattr(args, "command_group", None)), argv
