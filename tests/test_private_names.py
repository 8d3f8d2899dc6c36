"""No module of the package reaches into another's private (``_underscore``) names: it imports none of them, reads
none through an imported module or name, and the training session's parts and their users go through each other's
public interfaces (a session's internals are its own). Read from the source, nothing imported."""
import ast
from pathlib import Path

from sources import package_files

PACKAGE = Path(__file__).resolve().parent.parent / "jupyter_hpcdl"
#: The session's own modules: none reads a private attribute of anything but ``self`` or ``cls``.
#: Private names of the standard library and of other projects that the package uses knowingly, each where it says
#: why: ``os._exit`` (a child that must not run the parent's exit handlers), Jupyter Server's port binding
#: (``job/serverext.py``: serving on the job's held socket), Keras' compile arguments (the user's compiled model).
FOREIGN = {"_exit", "_find_http_port", "_bind_http_server_tcp", "_get_compile_args"}
SESSION_PARTS = ["session", "rankworld", "fitting", "checkpoints", "everyrank", "reporting", "results", "experiments",
                 "placement", "placement_allocation", "placement_new"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(source: str, module: str, is_package: bool = False, parts_only: bool = False) -> list[str]:
    """Where ``source`` (the module ``module``) uses another module's private names: ``from m import _x`` and
    ``m._x`` for a module or name ``m`` imported from the package, and ``session._x``; with ``parts_only``, any
    ``x._y`` but on ``self`` or ``cls``."""
    tree = ast.parse(source)
    ours = set()  # local names bound to the package's modules or to what they define
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = _absolute(node, module, is_package)
            if origin.split(".")[0] != "jupyter_hpcdl":
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"from {origin} import {alias.name}"))
                ours.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jupyter_hpcdl":
                    ours.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
        if name in ours or name == "session" or (parts_only and name not in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{module}:{line}: {text}" for line, text in sorted(found)]


def test_the_check_finds_what_it_looks_for():
    source = ("from . import rank as r\nfrom .spec import _hidden, make_spec\nimport jupyter_hpcdl.job.owner as o\n"
              "import os\nr._x\nmake_spec._y\no._z\nos._exit\nself._fine\ndef f(session):\n    session._new_world()\n"
              "other._a\n")
    assert private_uses(source, "jupyter_hpcdl.training.x") == [
        "jupyter_hpcdl.training.x:2: from jupyter_hpcdl.training.spec import _hidden",
        "jupyter_hpcdl.training.x:5: r._x", "jupyter_hpcdl.training.x:6: make_spec._y",
        "jupyter_hpcdl.training.x:7: o._z", "jupyter_hpcdl.training.x:11: session._new_world"]
    assert private_uses(source, "jupyter_hpcdl.training.x", parts_only=True)[-2:] == [
        "jupyter_hpcdl.training.x:11: session._new_world", "jupyter_hpcdl.training.x:12: other._a"]
    assert private_uses("from .. import _x\n", "jupyter_hpcdl.training", is_package=True) == [
        "jupyter_hpcdl.training:1: from jupyter_hpcdl import _x"]


def test_no_module_uses_another_modules_private_names():
    found = []
    for path in package_files(PACKAGE):
        module = _module(path)
        found += private_uses(path.read_text(), module, path.name == "__init__.py",
                              parts_only=module.rpartition(".")[2] in SESSION_PARTS
                              and module.startswith("jupyter_hpcdl.training."))
    assert found == []


def test_no_module_reads_a_private_attribute_of_anything_but_itself():
    """Across the package, ``x._y`` only on ``self`` or ``cls`` (e.g. the dashboard's scaling panel drives the
    dashboard through its public methods), but for the foreign names above."""
    found = []
    for path in package_files(PACKAGE):
        found += [use for use in private_uses(path.read_text(), _module(path), path.name == "__init__.py",
                                              parts_only=True) if use.rpartition(".")[2] not in FOREIGN]
    assert found == []


def test_the_scaling_experiment_drives_the_session_through_public_names_only():
    tree = ast.parse((PACKAGE / "training" / "experiments.py").read_text())
    assert [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _private(n.attr)] == []
