"""Moved to :mod:`jupyter_hpcdl.training.batchrun`; this name stays for code and job scripts written before."""
from jupyter_hpcdl._moved import alias

alias(__name__, "jupyter_hpcdl.training.batchrun")
