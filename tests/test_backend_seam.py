"""The framework seam (docs/architecture.md, "The framework seam"): only a training backend's package imports
TensorFlow, Keras or Horovod, and the registered backend gives all that the interface asks. Pure: nothing here
imports a framework."""
import ast
import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jupyter_hpcdl import backends
from jupyter_hpcdl.backends import BACKEND_ENV, BUILTIN, DEFAULT, GROUP, load_backend
from jupyter_hpcdl.backends.base import Backend
from sources import package_files

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jupyter_hpcdl"
BACKENDS = PACKAGE / "backends"
FRAMEWORKS = {"tensorflow", "keras", "tf_keras", "horovod", "torch", "torchvision"}
#: Which backend's package may import which framework.
OWN = {"horovod": {"tensorflow", "keras", "tf_keras", "horovod"}, "pytorch": {"torch", "torchvision"}}


def framework_imports(path: Path, root: Path = ROOT) -> list[str]:
    """The framework modules ``path`` imports, anywhere in it (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in FRAMEWORKS]
    return found


def test_only_the_backends_import_a_framework():
    outside = [hit for p in package_files(PACKAGE) if BACKENDS not in p.parents for hit in framework_imports(p)]
    assert outside == [], "TensorFlow, Keras and Horovod belong behind jupyter_hpcdl.backends (a backend's package)"


def test_each_framework_stays_in_its_own_backend():
    strays = [hit for p in package_files(BACKENDS) for hit in framework_imports(p)
              if hit.split(": ")[1].split(".")[0] not in OWN.get(p.relative_to(BACKENDS).parts[0], set())]
    assert strays == [], "a backend imports another's framework, or a neutral module of backends/ imports one"


def test_the_checker_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nimport tensorflow as tf\n\ndef f():\n    import horovod.tensorflow as hvd\n"
                      "    from tf_keras import layers\n    from . import keras\n")
    assert framework_imports(module, tmp_path) == ["m.py: tensorflow", "m.py: horovod.tensorflow", "m.py: tf_keras"]


def test_the_built_in_backends_are_registered_in_pyproject_as_they_are_built_in():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    assert declared == BUILTIN and DEFAULT in declared and "torch" in declared


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_built_in_backend_gives_every_member_of_the_interface(name):
    backend = load_backend(name)
    members = [n for n in dir(Backend) if not n.startswith("_")] + list(Backend.__annotations__)
    assert backend.name == name
    assert [m for m in members if not hasattr(backend, m)] == []


def test_loading_a_backend_in_the_kernel_imports_no_framework():
    """The kernel loads the session's backend (to ship its rank functions) but must not import the framework."""
    code = ("import sys\nfrom jupyter_hpcdl.backends import load_backend\nfor n in ('horovod', 'torch'):\n"
            "    load_backend(n)\nprint(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (FRAMEWORKS,))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_rank_functions_are_found_by_module_path_on_the_ranks(name):
    """ipyparallel ships them by reference: each must be a module-level function of an importable module."""
    backend = load_backend(name)
    rank_members = [n for n, t in Backend.__annotations__.items() if str(t).startswith("Callable")]
    assert rank_members
    for name in rank_members:
        fn = getattr(backend, name)
        assert getattr(importlib.import_module(fn.__module__), fn.__qualname__) is fn, name


def test_an_unknown_backend_is_named():
    try:
        load_backend("no-such-framework")
    except ValueError as e:
        assert "no-such-framework" in str(e) and DEFAULT in str(e)
    else:
        raise AssertionError("an unknown backend loaded")


class RecordingBackend:
    """A second backend, as another package would register it: only what these tests reach."""

    name = "recording"

    def __init__(self):
        self.shards = []

    def load_shard(self, data, rank, size):
        self.shards.append((data, rank, size))
        return backends.load_backend("horovod").load_shard(data, rank, size)


RECORDING = RecordingBackend()


@pytest.fixture
def recording(monkeypatch):
    """``recording`` registered beside the built-in backend, as an entry point would register it."""
    monkeypatch.setitem(BUILTIN, "recording", f"{__name__}:RECORDING")
    RECORDING.shards.clear()
    backends._load.cache_clear()
    yield RECORDING
    backends._load.cache_clear()


def test_a_session_uses_the_backend_it_names_or_the_sites(recording, monkeypatch, tmp_path):
    from jupyter_hpcdl.training import TrainingSession

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert TrainingSession().backend.name == DEFAULT
    assert TrainingSession(backend="recording").backend is recording
    monkeypatch.setenv(BACKEND_ENV, "recording")  # the site's choice, e.g. in the job's environment
    assert TrainingSession().backend is recording and load_backend() is recording
    assert TrainingSession(backend="horovod").backend.name == "horovod"


def test_a_session_with_an_unknown_backend_fails_at_once_saying_what_to_do(monkeypatch, tmp_path):
    from jupyter_hpcdl.training import TrainingSession

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError) as e:
        TrainingSession(backend="torch-nope")
    assert "torch-nope" in str(e.value) and DEFAULT in str(e.value) and BACKEND_ENV in str(e.value)
    assert list(tmp_path.iterdir()) == [], "a session that failed to be made left its directory behind"
    monkeypatch.setenv(BACKEND_ENV, "typo")
    with pytest.raises(ValueError, match="'typo'"):
        load_backend()


def test_a_backend_registered_under_another_name_is_refused(recording, monkeypatch):
    monkeypatch.setitem(BUILTIN, "alias", f"{__name__}:RECORDING")
    with pytest.raises(ValueError, match="registered as 'alias'.*calls itself 'recording'"):
        load_backend("alias")


def test_weak_scaling_shards_with_the_sessions_backend_on_the_ranks(recording):
    import numpy as np

    from jupyter_hpcdl.training.experiments import weak_data

    x, y = np.arange(12.0).reshape(6, 2), np.arange(6)
    shard = weak_data((x, y), 2, "recording")  # what the ranks call, shipped by value
    part_x, part_y = shard(3, 4)  # rank 3 of 4 reads what rank 1 of 2 had
    assert [(r, s) for _, r, s in recording.shards] == [(1, 2)]
    assert len(part_x) == len(part_y) == 3


#: A module of one backend's package (not the interface, ``base``, or the neutral helpers beside it).
ONE_BACKEND = re.compile(r"(jupyter_hpcdl\.)?backends\.(?!(base|gpu|publication|progress|scriptrun)(\.|$))")


def module_level_backends(path: Path) -> list[str]:
    """What ``path`` does at import that fixes a backend: a call of ``load_backend`` outside functions (in the module
    or a class body) or an import from one backend's package."""
    found = []

    def visit(statements) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.ClassDef):
                visit(node.body)
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and getattr(sub.func, "id", getattr(sub.func, "attr", "")) == "load_backend":
                    found.append(f"{path.name}:{sub.lineno}: load_backend() at import")
                if isinstance(sub, ast.ImportFrom) and ONE_BACKEND.match(sub.module or ""):
                    found.append(f"{path.name}:{sub.lineno}: from ..{sub.module}")

    visit(ast.parse(path.read_text()).body)
    return found


def test_the_checker_sees_a_backend_fixed_at_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from ..backends import load_backend\nfrom ..backends.horovod import rank\n"
                      "from ..backends.base import NpzFile\n"
                      "side = load_backend()\nclass A:\n    b = backends.load_backend('x')\n"
                      "def f():\n    return load_backend()\n")
    assert module_level_backends(module) == ["m.py:2: from ..backends.horovod", "m.py:4: load_backend() at import",
                                             "m.py:6: load_backend() at import"]


def test_the_sessions_parts_hold_no_backend_of_their_own():
    """The session and its parts reach the ranks through the world's backend, never one fixed at import (the
    digits example's Keras model, ``training/examples.py``, is the one module that names a backend: it is that
    backend's example)."""
    found = [hit for p in sorted((PACKAGE / "training").glob("*.py")) if p.name != "examples.py"
             for hit in module_level_backends(p)]
    assert found == []


def test_the_torch_backend_refuses_an_mpi_world_before_any_engine_starts(monkeypatch, tmp_path):
    from jupyter_hpcdl.training import TrainingSession

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match="world='gloo'"):
        TrainingSession(backend="torch", world="mpi")
    assert list(tmp_path.iterdir()) == []


def test_the_torch_store_is_a_file_only_the_user_reaches(monkeypatch, tmp_path):
    """PyTorch's TCPStore answers anyone on its port: the ranks meet in a file of a mode-0700 directory instead,
    and the world's environment names no address or port of a store."""
    from jupyter_hpcdl.backends.pytorch.store import FileRendezvous, rank_env
    from jupyter_hpcdl.job.world import plan_slots

    monkeypatch.setenv("HOME", str(tmp_path))
    store = FileRendezvous()
    assert os.path.dirname(store.path) == store.directory and store.directory.startswith(str(tmp_path))
    assert os.stat(store.directory).st_mode & 0o777 == 0o700 and store.port == 0
    envs = [rank_env(slot, store.rank_address("10.0.0.1"), "ib0", 60) for slot in plan_slots([("n1", 2), ("n2", 2)])]
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "0", "4"), ("1", "1", "0", "4"), ("2", "0", "1", "4"), ("3", "1", "1", "4")]
    assert {e["HPCDL_TORCH_STORE"] for e in envs} == {store.path} and {e["GLOO_SOCKET_IFNAME"] for e in envs} == {"ib0"}
    assert not [k for e in envs for k in e if k.startswith("MASTER_")]
    assert float(envs[0]["HPCDL_TORCH_TIMEOUT"]) >= 300  # the join and each collective have a deadline
    store.stop()
    assert not os.path.exists(store.directory)


def test_the_launchers_pytorch_ranks_run_a_python_script_through_the_join():
    from jupyter_hpcdl.backends.pytorch.store import LAUNCHED, rank_command

    assert rank_command(["python3", "train.py", "--lr", "1"]) == ["python3", "-m", LAUNCHED, "train.py", "--lr", "1"]
    assert rank_command(["/v/bin/python3.11", "-m", "pkg.train"]) == ["/v/bin/python3.11", "-m", LAUNCHED, "-m",
                                                                      "pkg.train"]
    for bad in (["bash", "-c", "true"], ["python3"], ["python3", "-c", "print(1)"], ["python3", "-m"], []):
        with pytest.raises(ValueError, match="start from a Python script"):
            rank_command(bad)
    assert load_backend("horovod").rank_command(["bash", "-c", "x"]) == ["bash", "-c", "x"]
