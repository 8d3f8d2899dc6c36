"""Moved to :mod:`jupyter_hpcdl.job.tasks`; this name stays for code and job scripts written before."""
from jupyter_hpcdl._moved import alias

alias(__name__, "jupyter_hpcdl.job.tasks")
