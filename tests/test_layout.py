"""Where code runs shows in the package's layout (the job's side in ``jupyter_hpcdl.job``, batch runs with the
training session); the names from before the move still work, for user code and for job scripts queued across an
upgrade."""
import importlib
import subprocess
import sys

import pytest

MOVED = {"jupyter_hpcdl.tasks": "jupyter_hpcdl.job.tasks", "jupyter_hpcdl.launch": "jupyter_hpcdl.job.launch",
         "jupyter_hpcdl.jobclient": "jupyter_hpcdl.job.client", "jupyter_hpcdl.newjob": "jupyter_hpcdl.job.newjob",
         "jupyter_hpcdl.batch": "jupyter_hpcdl.training.batchrun",
         "jupyter_hpcdl.serverext": "jupyter_hpcdl.job.serverext",
         "jupyter_hpcdl.spawner.jobside": "jupyter_hpcdl.job.server"}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_name_is_the_moved_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_public_names_of_a_notebook():
    from jupyter_hpcdl.batch import BatchRun
    from jupyter_hpcdl.newjob import NewAllocation
    from jupyter_hpcdl.training import BatchRun as run_class, NewAllocation as alloc_class, TrainingSession, runs

    assert (BatchRun, NewAllocation) == (run_class, alloc_class) and callable(runs) and TrainingSession


@pytest.mark.parametrize("old", ["jupyter_hpcdl.tasks", "jupyter_hpcdl.job.tasks"])
def test_an_old_name_runs_the_moved_program(old):
    """``python -m OLD`` outside a job: the moved program runs and says why it cannot."""
    env = {"PATH": "/usr/bin:/bin"}  # no batch job's variables
    proc = subprocess.run([sys.executable, "-m", old, "--", "true"], capture_output=True, text=True, timeout=60, env=env)
    assert (proc.returncode, proc.stderr.strip()) == (2, "jupyter_hpcdl.job.tasks: not inside a batch job")
