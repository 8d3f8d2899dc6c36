"""Moved to :mod:`jupyter_hpcdl.job.serverext`; this name stays for Jupyter configurations written before."""
from jupyter_hpcdl._moved import alias

alias(__name__, "jupyter_hpcdl.job.serverext")
