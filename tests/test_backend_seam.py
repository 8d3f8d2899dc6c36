"""The framework seam (docs/architecture.md, "The framework seam"): only a training backend's package imports
TensorFlow, Keras or Horovod, and the registered backend gives all that the interface asks. Pure: nothing here
imports a framework."""
import ast
import importlib
import tomllib
from pathlib import Path

from jupyter_hpcdl.backends import BUILTIN, DEFAULT, GROUP, load_backend
from jupyter_hpcdl.backends.base import Backend

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jupyter_hpcdl"
BACKENDS = PACKAGE / "backends"
FRAMEWORKS = {"tensorflow", "keras", "tf_keras", "horovod"}


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
    outside = [hit for p in sorted(PACKAGE.rglob("*.py")) if BACKENDS not in p.parents for hit in framework_imports(p)]
    assert outside == [], "TensorFlow, Keras and Horovod belong behind jupyter_hpcdl.backends (a backend's package)"


def test_the_checker_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nimport tensorflow as tf\n\ndef f():\n    import horovod.tensorflow as hvd\n"
                      "    from tf_keras import layers\n    from . import keras\n")
    assert framework_imports(module, tmp_path) == ["m.py: tensorflow", "m.py: horovod.tensorflow", "m.py: tf_keras"]


def test_the_default_backend_is_registered_in_pyproject_as_it_is_built_in():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    assert declared == BUILTIN and DEFAULT in declared


def test_the_default_backend_gives_every_member_of_the_interface():
    backend = load_backend()
    members = [n for n in dir(Backend) if not n.startswith("_")] + list(Backend.__annotations__)
    assert backend.name == DEFAULT
    assert [m for m in members if not hasattr(backend, m)] == []


def test_rank_functions_are_found_by_module_path_on_the_ranks():
    """ipyparallel ships them by reference: each must be a module-level function of an importable module."""
    backend = load_backend()
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
