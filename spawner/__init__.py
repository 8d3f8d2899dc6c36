"""The hub side of jupyter-hpcdl: HpcdlSpawner runs a user's JupyterLab as a batch job on GPU nodes, with kernels in
the user's udocker container. Importing it changes nothing in JupyterHub: ``hub.install()`` puts the hub-wide part
in (the hardened callback routes, the orphan sweep), called by each HpcdlSpawner and, best, by the hub's
configuration (docs/spawner.md). The batch-system adapters here are imported alone by the job's side,
which must not pay for JupyterHub: so HpcdlSpawner is loaded on first use."""


def __getattr__(name: str):
    if name == "HpcdlSpawner":
        from .spawner import HpcdlSpawner

        return HpcdlSpawner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
