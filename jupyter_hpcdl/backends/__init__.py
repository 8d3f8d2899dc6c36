"""Training backends behind one interface (:class:`.base.Backend`): everything that knows a framework (TensorFlow,
Keras, Horovod) is in a backend's package, and the rest of jupyter_hpcdl reaches it through :func:`load_backend`.
A backend registers itself in the ``jupyter_hpcdl.backends`` entry point group as ``name = "module:object"``; a
session names one (``TrainingSession(backend=...)``), else the site's choice in ``HPCDL_BACKEND`` holds, else
"horovod"."""
from __future__ import annotations

import functools
import os
from importlib import import_module
from importlib.metadata import entry_points

from .base import Backend

GROUP = "jupyter_hpcdl.backends"
DEFAULT = "horovod"
#: The site's (or user's) default backend where a caller names none: e.g. set in the job's environment.
BACKEND_ENV = "HPCDL_BACKEND"
#: The backends this package brings, found also where it runs uninstalled (a source tree on PYTHONPATH, whose entry
#: points are not registered); pyproject.toml registers the same.
BUILTIN = {"horovod": "jupyter_hpcdl.backends.horovod:BACKEND",
           "torch": "jupyter_hpcdl.backends.pytorch:BACKEND"}


def load_backend(name: str | None = None) -> Backend:
    """The backend registered as ``name``; without one, the one ``HPCDL_BACKEND`` names, else "horovod"."""
    return _load(name or os.environ.get(BACKEND_ENV) or DEFAULT)


def installed() -> dict[str, str]:
    """Every backend that can be loaded here: its name and ``module:object``."""
    return {**BUILTIN, **{ep.name: ep.value for ep in entry_points(group=GROUP)}}


@functools.cache
def _load(name: str) -> Backend:
    found = installed()
    target = found.get(name)
    if target is None:
        known = ", ".join(sorted(found))
        raise ValueError(f"no training backend {name!r}: the backends installed here are {known} (name one of them "
                         f"with backend=..., or in {BACKEND_ENV}; another backend's package registers itself in the "
                         f"entry point group {GROUP!r})")
    module, _, attr = target.partition(":")
    backend = getattr(import_module(module), attr)
    if backend.name != name:  # the ranks and the launcher find it again by its name
        raise ValueError(f"the training backend registered as {name!r} ({target}) calls itself {backend.name!r}: "
                         "register it under its own name")
    return backend


__all__ = ["BACKEND_ENV", "Backend", "DEFAULT", "GROUP", "installed", "load_backend"]
