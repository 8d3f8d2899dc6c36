"""Where code runs shows in the package's layout, and imports only go down: no loop between modules, and no package
importing one above it (the order below, also in docs/architecture.md). Imports inside functions count (they are
dependencies all the same); those under ``if TYPE_CHECKING:`` do not."""
import ast
import subprocess
import sys
from pathlib import Path

from sources import package_files

PACKAGE = Path(__file__).resolve().parent.parent / "jupyter_hpcdl"
#: Low to high. A module may import its own package and any package before it; the package's top-level modules
#: (``atomic``, ``jobvalues``, ``controls``, ``configref``) come first. The hub's side (``spawner``) is below the
#: job's side, which checks a kernel's jobs against the same site profile. The training backends (the only code that
#: knows TensorFlow, Keras and Horovod) are below everything that uses them: ``diagnose``, the job's launcher, the
#: training session, the doctor.
LAYERS = ["(top)", "batchsystems", "containers", "spawner", "backends", "diagnose", "job", "training", "dashboard",
          "doctor", "workshop"]


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for child in node.body for n in ast.walk(child))
    return ids


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports."""
    modules = {_name(p): p for p in package_files(PACKAGE)}
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[:len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "(top)"


def test_every_package_has_its_place_in_the_order():
    assert {_layer(m) for m in import_graph()} <= set(LAYERS)


def test_no_module_imports_a_package_above_its_own():
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                    if LAYERS.index(_layer(d)) > LAYERS.index(_layer(m)))
    assert upward == [], "imports go down only (tests/test_imports.py LAYERS): move what both need below both"


def test_no_import_loop_between_modules():
    graph, loops, done = import_graph(), [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            loops.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert loops == []


def test_the_checker_sees_a_loop_and_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "jupyter_hpcdl"
    for rel, text in {"__init__.py": "", "atomic.py": "from .job import x\n", "job/__init__.py": "",
                      "job/x.py": "from ..training import y\n", "training/__init__.py": "",
                      "training/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..dashboard import z\n"
                                       "def f():\n    from ..job import x\n",
                      "dashboard/__init__.py": "", "dashboard/z.py": ""}.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    graph = import_graph()
    assert graph["jupyter_hpcdl.training.y"] == {"jupyter_hpcdl.job.x"}, "TYPE_CHECKING imports do not count"
    assert "jupyter_hpcdl.job.x" in graph["jupyter_hpcdl.atomic"]
    for check in (test_no_module_imports_a_package_above_its_own, test_no_import_loop_between_modules):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} passed a package with a loop and an upward import")


def test_the_public_names_of_a_notebook():
    from jupyter_hpcdl.training import BatchRun, EnginesFailed, NewAllocation, TrainingSession, runs

    assert callable(runs) and TrainingSession and BatchRun and NewAllocation and EnginesFailed


def test_a_job_program_outside_a_job_says_why_it_cannot_run():
    env = {"PATH": "/usr/bin:/bin"}  # no batch job's variables
    proc = subprocess.run([sys.executable, "-m", "jupyter_hpcdl.job.tasks", "--", "true"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert (proc.returncode, proc.stderr.strip()) == (2, "jupyter_hpcdl.job.tasks: not inside a batch job")
