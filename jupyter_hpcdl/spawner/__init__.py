"""The hub side of jupyter-hpcdl: HpcdlSpawner runs a user's JupyterLab as a batch job on GPU nodes, with kernels in
the user's udocker container. Importing it also hardens batchspawner's callback route (see api.py)."""
from .spawner import HpcdlSpawner  # noqa: F401
