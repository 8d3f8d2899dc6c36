"""The hub's configuration of the batch system reaches the jobs a kernel submits: the server's script hands it on
(``HPCDL_SCHEDULER_CONFIG``), the job's side builds its adapter from it, and new allocations and batch runs carry
the site's directives and prologue (pure: the scripts are built and the hand-off is read back through a shell)."""
import json
import subprocess

import pytest

from jupyter_hpcdl.batchsystems.gridengine import GridEngine
from jupyter_hpcdl.batchsystems.scheduler import (CONFIG_ENV, JobRequest, handed_config, job_scheduler,
                                                  owners_scheduler)
from jupyter_hpcdl.batchsystems.slurm import Slurm
from jupyter_hpcdl.job.newjob import NewAllocation, batch_run_script, engines_job_template
from jupyter_hpcdl.spawner.script import ScriptContext, build_batch_script

REQ = JobRequest("gpu", 2, 2, 60, "base", "hpcdl/base:latest")
FILL = dict(cluster_id="c1", profile_dir="/home/a/.ipython/profile_default", program_and_args="engine")


def hub_grid_engine() -> GridEngine:
    return GridEngine(pe_multi_node="gpus-{gpus_per_node}", pe_single_node="threads",
                      extra_directives=["-P ml", "-l h={node1,node2}"], prologue=["module load cuda/12.2 # it's"])


def handed_env(sched, job_env: dict) -> dict:
    """The environment the server's script gives the job's side: its export lines run by a shell."""
    script = build_batch_script(REQ, sched, ScriptContext(python="/v/bin/python", output="/o", workdir="/w"))
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    out = subprocess.run(["bash", "-c", f"{exports}\nprintf %s \"${CONFIG_ENV}\""], env=job_env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {**job_env, CONFIG_ENV: out}


def shell_export(line: str) -> str:
    """The value a shell gives the variable of one ``export NAME=VALUE`` line."""
    name = line.split()[1].split("=", 1)[0]
    return subprocess.run(["bash", "-c", f"{line}\nprintf %s \"${name}\""], env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, check=True).stdout


def test_the_jobs_adapter_is_configured_as_the_hubs():
    hub = hub_grid_engine()
    env = handed_env(hub, {"JOB_ID": "7", "SGE_ROOT": "/var/lib/gridengine", "PATH": "/usr/bin:/bin"})
    job = job_scheduler(env)
    assert isinstance(job, GridEngine)
    assert job.trait_values(config=True) == hub.trait_values(config=True)
    told = {"scheduler": "gridengine", "scheduler_config": env[CONFIG_ENV]}  # what the owner tells a kernel
    assert owners_scheduler(told).trait_values(config=True) == hub.trait_values(config=True)
    assert owners_scheduler({"scheduler": "gridengine"}).pe_multi_node == GridEngine().pe_multi_node
    # without a hand-off (a job not started by the hub): the adapter's defaults
    assert job_scheduler({"JOB_ID": "7", "SGE_ROOT": "/x"}).trait_values(config=True) == \
        GridEngine().trait_values(config=True)


def test_new_allocations_and_batch_runs_carry_the_sites_directives_and_prologue():
    sge = hub_grid_engine()
    engines = engines_job_template(sge, NewAllocation(nodes=2, gpus_per_rank=1), 4, "/v/bin/python")
    lines = engines.format(**FILL).splitlines()  # as ipyparallel fills it: the site's braces stay braces
    assert "#$ -N hpcdl-engines-c1" in lines and "#$ -pe gpus-2 4" in lines
    assert lines[0] == "#!/bin/bash" and lines[-6:-4] == ["#$ -P ml", "#$ -l h={node1,node2}"]
    assert lines[-3:-1] == ["# the site's prologue", "module load cuda/12.2 # it's"]
    assert lines[-1].startswith("exec /v/bin/python -m jupyter_hpcdl.job.tasks")
    # the rank job's own side (its tasks) gets the hub's configuration too, through a shell as the script runs it
    assert json.loads(shell_export(lines[-4])) == json.loads(sge.job_config())
    run = batch_run_script(sge, NewAllocation(), 2, "/home/a/run", "/v/bin/python", "hpcdl/base:latest", ["true"],
                           "hpcdl-batch-x").splitlines()
    assert "#$ -pe threads 2" in run and f"export {CONFIG_ENV}=" in "\n".join(run)
    assert run.index("#$ -P ml") < run.index("module load cuda/12.2 # it's") < len(run) - 1
    slurm = batch_run_script(Slurm(extra_directives=["--qos=long"]), NewAllocation(), 2, "/home/a/run",
                             "/v/bin/python", "hpcdl/base:latest", ["true"], "hpcdl-batch-x").splitlines()
    assert "#SBATCH --qos=long" in slurm and "# the site's prologue" not in slurm


@pytest.mark.parametrize("text, says", [("{not json", "not JSON"), ('["GridEngine"]', "JSON object"),
                                        ('{"GridEngine": 3}', "JSON object")])
def test_a_broken_hand_off_is_named(text, says):
    with pytest.raises(ValueError, match=says):
        handed_config(text)
    with pytest.raises(ValueError, match=CONFIG_ENV):
        job_scheduler({"JOB_ID": "7", "SGE_ROOT": "/x", CONFIG_ENV: text})


def test_a_site_with_the_defaults_hands_nothing_on():
    assert Slurm().job_config() == "" and GridEngine(pe_single_node="smp").job_config() == ""
    script = build_batch_script(REQ, Slurm(), ScriptContext(python="/v/bin/python", output="/o", workdir="/w"))
    assert CONFIG_ENV not in script
