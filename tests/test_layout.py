"""The planned layout: the hub's side lives in the top-level ``spawner/`` folder, and ``jupyter_hpcdl/spawner`` is a
link to it, so that a checkout (``PYTHONPATH``), an editable install and the wheel all import it as
``jupyter_hpcdl.spawner``. The wheel and the editable install are checked in tests/test_packaging.py."""
import os
import subprocess
import sys

from sources import PACKAGE, package_files

ROOT = PACKAGE.parent


def test_the_hub_side_is_the_top_level_spawner_folder():
    link = PACKAGE / "spawner"
    assert link.is_symlink(), "jupyter_hpcdl/spawner must be the link to ../spawner, not a copy"
    assert os.readlink(link) == "../spawner", "a relative link, so that a clone resolves it wherever it is"
    assert link.resolve() == ROOT / "spawner" and (ROOT / "spawner" / "spawner.py").is_file()


def test_a_checkout_on_the_path_imports_the_hub_side_from_that_folder(tmp_path):
    """As a developer runs it (``PYTHONPATH`` at the checkout; the tests themselves import the installed wheel)."""
    out = subprocess.run([sys.executable, "-c", "import os, jupyter_hpcdl.spawner.usertail as m; "
                          "print(m.__name__, os.path.realpath(m.__file__))"], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["jupyter_hpcdl.spawner.usertail", str(ROOT / "spawner" / "usertail.py")]


def test_the_checkers_see_the_hub_side():
    names = {p.relative_to(PACKAGE).as_posix() for p in package_files()}
    assert {"spawner/spawner.py", "spawner/hub.py", "job/server.py"} <= names
    assert len(names) == len(package_files()), "each file once"
