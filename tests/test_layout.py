"""The planned layout: the hub's side lives in the top-level ``spawner/`` folder, and ``jupyter_hpcdl/spawner`` is a
link to it, so that a checkout (``PYTHONPATH``), an editable install and the wheel all import it as
``jupyter_hpcdl.spawner``. The wheel and the editable install are checked in tests/test_packaging.py."""
import importlib
import os
from pathlib import Path

from sources import PACKAGE, package_files

ROOT = PACKAGE.parent


def test_the_hub_side_is_the_top_level_spawner_folder():
    link = PACKAGE / "spawner"
    assert link.is_symlink(), "jupyter_hpcdl/spawner must be the link to ../spawner, not a copy"
    assert os.readlink(link) == "../spawner", "a relative link, so that every checkout and sdist tree resolves it"
    assert link.resolve() == ROOT / "spawner" and (ROOT / "spawner" / "spawner.py").is_file()


def test_the_hub_side_is_imported_from_that_folder_by_its_package_name():
    module = importlib.import_module("jupyter_hpcdl.spawner.usertail")
    assert module.__name__ == "jupyter_hpcdl.spawner.usertail"
    assert Path(module.__file__).resolve() == ROOT / "spawner" / "usertail.py"


def test_the_checkers_see_the_hub_side():
    names = {p.relative_to(PACKAGE).as_posix() for p in package_files()}
    assert {"spawner/spawner.py", "spawner/hub.py", "job/server.py"} <= names
    assert len(names) == len(package_files()), "each file once"
