"""Packaging the Jupyter way: the sdist carries the sources and the built extension, a wheel built from it needs no
Node, and that wheel installed into an empty environment gives JupyterLab and Jupyter Server the extension, enabled
and OK; the hub's side (the top-level spawner/ folder) is in the sdist and the wheel, and an editable install
imports it from the checkout. Also the test-bed guard of tests/conftest.py, which must be able to fail a run."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXT = "share/jupyter/labextensions/@jupyter-hpcdl/labextension"


def _run(argv, timeout=600, **kw) -> str:
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, argv))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return ANSI.sub("", r.stdout + r.stderr)


def test_testbed_guard_fails_a_run_without_the_bed(tmp_path):
    (tmp_path / "conftest.py").write_text((REPO / "tests/conftest.py").read_text())
    (tmp_path / "leftovers.py").write_text((REPO / "tests/leftovers.py").read_text())  # conftest.py imports it
    (tmp_path / "test_x.py").write_text("import pytest\n\n@pytest.mark.testbed\ndef test_needs_bed():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  testbed: bed\n  gpu: gpu\n")
    # A run of its own: not a pytest-xdist worker, even when this test runs in one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["HPCDL_TESTBED_STATE"] = str(tmp_path / "no-bed")
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)]
    required = subprocess.run(argv, capture_output=True, text=True, env={**env, "HPCDL_REQUIRE_TESTBED": "1"},
                              cwd=tmp_path, timeout=120)
    assert required.returncode == 1, required.stdout
    assert "HPCDL_REQUIRE_TESTBED=1 but the test bed is not up" in required.stdout and "1 error" in required.stdout
    optional = subprocess.run(argv, capture_output=True, text=True, env={**env, "HPCDL_REQUIRE_TESTBED": "0"},
                              cwd=tmp_path, timeout=120)
    assert optional.returncode == 0 and "1 skipped" in optional.stdout, optional.stdout


@pytest.mark.testbed
@pytest.mark.stream("rest")  # no scheduler
def test_sdist_wheel_without_node_installs_into_an_empty_environment(tmp_path):
    if not (REPO / "jupyter_hpcdl/labextension/package.json").exists():
        pytest.fail("the checkout has no built extension: testbed/install.sh builds it (pip wheel .)")
    version = json.loads((REPO / "labextension/package.json").read_text())["version"]
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", dist, REPO])
    (sdist,) = dist.glob("jupyter_hpcdl-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("labextension/src/index.ts", "labextension/package.json", "labextension/yarn.lock",
                   "jupyter_hpcdl/labextension/package.json", "jupyter_hpcdl/doctor/cli.py", "pyproject.toml",
                   "jupyter_hpcdl/spawner/spawner.py"):  # the top-level spawner/, through its link
        assert needed in names, f"{needed} missing from the sdist"
    assert not any(n.startswith("labextension/node_modules/") for n in names)

    # A wheel from the sdist with no Node anywhere on PATH: the extension in the sdist is used as is.
    no_node = {k: v for k, v in os.environ.items() if k != "PATH"} | {"PATH": "/nonexistent"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, sdist], env=no_node)
    (wheel,) = dist.glob("jupyter_hpcdl-*.whl")
    assert wheel.name.startswith(f"jupyter_hpcdl-{version}-")
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
        data = f"jupyter_hpcdl-{version}.data/data/"
        ext_pkg = json.loads(z.read(f"{data}{EXT}/package.json"))
        entry_points = z.read(f"jupyter_hpcdl-{version}.dist-info/entry_points.txt").decode()
    assert {"jupyter_hpcdl/spawner/__init__.py", "jupyter_hpcdl/spawner/spawner.py"} <= set(files), "no hub side"
    assert re.search(r"^hpcdl = jupyter_hpcdl\.spawner:HpcdlSpawner$", entry_points, re.M), entry_points
    assert ext_pkg["version"] == version and ext_pkg["name"] == "@jupyter-hpcdl/labextension"
    assert any(f.startswith(f"{data}{EXT}/static/remoteEntry.") for f in files)
    assert f"{data}etc/jupyter/jupyter_server_config.d/jupyter_hpcdl.json" in files
    assert not any(f.startswith("jupyter_hpcdl/labextension/") for f in files), "the extension is shipped twice"

    env_dir = tmp_path / "env"
    _run(["/usr/bin/python3", "-m", "venv", env_dir])
    pins = [line for line in (REPO / "testbed/constraints.txt").read_text().splitlines() if line.startswith("jupyterlab==")]
    _run([env_dir / "bin/python", "-m", "pip", "install", "-q", wheel, *pins], env=os.environ | {"PIP_NO_INPUT": "1"})
    out = _run([env_dir / "bin/jupyter", "labextension", "list"])
    assert re.search(rf"@jupyter-hpcdl/labextension v{re.escape(version)} enabled\s+OK", out), out
    out = _run([env_dir / "bin/jupyter", "server", "extension", "list"])
    assert re.search(r"jupyter_hpcdl\.job\.serverext enabled", out) and re.search(r"jupyter_hpcdl\.job\.serverext\s+OK", out), out
    out = _run([env_dir / "bin/python", "-c", "import jupyter_hpcdl; print(jupyter_hpcdl.__version__)"], cwd=tmp_path)
    assert out.strip() == version

    # An editable install of the checkout: the hub's side is imported from the top-level spawner/ folder.
    _run([env_dir / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "-e", REPO],
         env=os.environ | {"PIP_NO_INPUT": "1"})
    out = _run([env_dir / "bin/python", "-c", "import os, jupyter_hpcdl.spawner.usertail as m; "
                "print(os.path.realpath(m.__file__))"], cwd=tmp_path)
    assert out.strip() == str(REPO / "spawner" / "usertail.py"), out
    shutil.rmtree(env_dir)
