"""jupyter-hpcdl: interactive distributed deep learning on HPC clusters."""
__version__ = "0.1.0"
