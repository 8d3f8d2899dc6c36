"""Training backends behind one interface (:class:`.base.Backend`): everything that knows a framework (TensorFlow,
Keras, Horovod) is in a backend's package, and the rest of jupyter_hpcdl reaches it through :func:`load_backend`.
A backend registers itself in the ``jupyter_hpcdl.backends`` entry point group as ``name = "module:object"``."""
from __future__ import annotations

import functools
from importlib import import_module
from importlib.metadata import entry_points

from .base import Backend

GROUP = "jupyter_hpcdl.backends"
DEFAULT = "horovod"
#: The backends this package brings, found also where it runs uninstalled (a source tree on PYTHONPATH, whose entry
#: points are not registered); pyproject.toml registers the same.
BUILTIN = {"horovod": "jupyter_hpcdl.backends.horovod:BACKEND"}


@functools.cache
def load_backend(name: str = DEFAULT) -> Backend:
    """The backend registered as ``name``."""
    found = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    target = found.get(name) or BUILTIN.get(name)
    if target is None:
        raise ValueError(f"no training backend {name!r} (registered: {', '.join(sorted({*found, *BUILTIN}))})")
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


__all__ = ["Backend", "DEFAULT", "GROUP", "load_backend"]
