"""The package's Python files as the checkout holds them, the hub's side included: ``jupyter_hpcdl/spawner`` is a
link to the top-level ``spawner/`` folder (docs/architecture.md), and ``Path.rglob`` does not follow links."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jupyter_hpcdl"


def package_files(package: Path = PACKAGE) -> list[Path]:
    """Every ``*.py`` under ``package``, links to folders followed, named by their path inside the package."""
    found = []
    for top, dirs, files in os.walk(package, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(top, f) for f in sorted(files) if f.endswith(".py")]
    return found
