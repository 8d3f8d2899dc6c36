"""jupyter-hpcdl: interactive distributed deep learning on HPC clusters."""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("jupyter-hpcdl")  # one version: labextension/package.json, read at build time
except PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"
