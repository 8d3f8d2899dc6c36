"""The configuration reference is written from the code: every setting is in it, with what it does."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from jupyter_hpcdl.configref import SECTIONS, own_settings, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_reference_is_the_codes():
    assert DOC.read_text() == render(), "docs/configuration.md is out of date: python -m jupyter_hpcdl.configref"


@pytest.mark.parametrize("module, name, where", SECTIONS)
def test_every_setting_is_in_it_and_says_what_it_does(module, name, where):
    cls = getattr(importlib.import_module(module), name)
    text = DOC.read_text()
    for setting, trait in own_settings(cls):
        assert f"`c.{name}.{setting}`" in text, f"{name}.{setting} is missing from the reference"
        assert (trait.help or "").strip(), f"{name}.{setting} has no help: say what it does"
