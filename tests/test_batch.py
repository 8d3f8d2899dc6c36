"""Batch runs without a batch system (``hpcdl-launch --local`` and ``BatchRun`` in local mode, real processes and a
real Horovod world), the batch script's builder, and the owner's job status route."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from jupyter_hpcdl.job.allocation import AllocationOwner
from jupyter_hpcdl.job.ownerapi import handle
from jupyter_hpcdl.training.batchrun import ENDED, BatchRun, runs, state_from_exit
from jupyter_hpcdl.job.newjob import NewAllocation, batch_run_script
from jupyter_hpcdl.batchsystems.gridengine import GridEngine
from jupyter_hpcdl.batchsystems.slurm import Slurm

PY = sys.executable
ENV = {**{k: v for k, v in os.environ.items() if k != "HPCDL_BACKEND"},  # each test names its backend
       "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TF_CPP_MIN_LOG_LEVEL": "3"}
#: A Horovod rank: joins the world, sums the ranks, rank 1 exits with the code given (0 by default).
RANK = textwrap.dedent("""
    import sys
    import horovod.tensorflow as hvd
    hvd.init()
    import tensorflow as tf
    total = int(hvd.allreduce(tf.constant(hvd.rank()), op=hvd.Sum))
    print(f"rank {hvd.rank()} of {hvd.size()} sum {total}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and hvd.rank() == 1 else 0)
""")


@pytest.fixture
def rank_script(tmp_path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK)
    return path


def launch(*args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jupyter_hpcdl.job.launch", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.ranks
def test_local_ranks_join_one_world_and_label_their_lines(tmp_path, rank_script):
    done = launch("--local=3", "--label", f"--status-file={tmp_path / 'status.json'}", "--", PY, str(rank_script))
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if " of " in line)
    assert lines == [f"{r}: rank {r} of 3 sum 3" for r in range(3)]
    assert sorted(line for line in done.stdout.splitlines() if "to stderr" in line) == \
        [f"{r}: to stderr" for r in range(3)]  # stderr too, with its rank
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["exit_code"] == 0 and status["why"] == "every rank exited with 0"


@pytest.mark.timing
@pytest.mark.ranks
def test_a_failing_rank_ends_the_run_with_its_code_and_the_others_are_ended(tmp_path, rank_script):
    done = launch("--local=2", f"--status-file={tmp_path / 'status.json'}", "--", PY, str(rank_script), "3")
    assert done.returncode == 3
    assert json.loads((tmp_path / "status.json").read_text())["why"] == "rank 1 exited with 3"
    # a rank that fails at once while the other would sleep: the sleeper is ended, not waited for
    script = tmp_path / "one_fails.py"
    sleeps = 300
    script.write_text(f"import os, sys, time\nif os.environ['HOROVOD_RANK'] == '0': sys.exit(5)\ntime.sleep({sleeps})\n")
    t0 = time.monotonic()
    done = launch("--local=2", "--", PY, str(script))
    took = time.monotonic() - t0
    assert done.returncode == 5 and took < sleeps, f"the run took {took:.0f} s: the sleeping rank was waited for"
    assert "rank 0 exited with 5" in done.stderr


@pytest.mark.ranks
def test_the_time_limit_and_a_cancel_end_every_rank(tmp_path):
    done = launch("--local=2", "--time-limit=2", f"--status-file={tmp_path / 's.json'}", "--", "sleep", "300")
    assert done.returncode == 124 and "time limit (2 s) ran out" in done.stderr
    assert json.loads((tmp_path / "s.json").read_text())["exit_code"] == 124
    proc = subprocess.Popen([PY, "-m", "jupyter_hpcdl.job.launch", "--local=2", f"--status-file={tmp_path / 'c.json'}",
                             "--", "sleep", "300"], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(psutil.Process(proc.pid).children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = psutil.Process(proc.pid).children()
    assert len(ranks) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert json.loads((tmp_path / "c.json").read_text())["why"] == "stopped by SIGTERM"
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


def test_a_rank_ended_by_the_launcher_is_a_failure_and_only_a_stopped_launcher_is_cancelled():
    # srun ends the other ranks with SIGTERM when one fails: its code is then 143, and the run FAILED
    assert state_from_exit(143, "srun exited with 143") == "FAILED"
    assert state_from_exit(143, "stopped by SIGTERM") == "CANCELLED"
    assert state_from_exit(130, "stopped by SIGINT") == "CANCELLED"
    assert [state_from_exit(c, "") for c in (0, 124, 3, None)] == ["COMPLETED", "TIMEOUT", "FAILED", "FAILED"]


def test_the_launcher_says_what_to_fix():
    assert "give the command after --" in launch("--local=2").stderr
    assert "1 to 256 ranks" in launch("--local=0", "--", "true").stderr
    assert "positive number of seconds" in launch("--local=1", "--time-limit=0", "--", "true").stderr
    outside = subprocess.run([PY, "-m", "jupyter_hpcdl.job.launch", "--image=x", "--", "true"], capture_output=True,
                             text=True, env={k: v for k, v in ENV.items() if not k.startswith("SLURM_")})
    assert outside.returncode == 2 and "--local N" in outside.stderr


def test_pytorch_ranks_start_from_a_python_script_and_anything_else_is_refused(monkeypatch, tmp_path):
    refused = subprocess.run([PY, "-m", "jupyter_hpcdl.job.launch", "--local=2", "--", "bash", "-c", "true"],
                             capture_output=True, text=True, env={**ENV, "HPCDL_BACKEND": "torch"}, timeout=120)
    assert refused.returncode == 2 and "'python3 script.py ARGS'" in refused.stderr, refused.stderr
    named = launch("--backend=torch", "--local=2", "--", "bash", "-c", "true")  # named: the same refusal
    assert named.returncode == 2 and "'python3 script.py ARGS'" in named.stderr, named.stderr
    unknown = launch("--backend=jax", "--local=2", "--", "true")
    assert unknown.returncode == 2 and "--backend: no training backend 'jax'" in unknown.stderr, unknown.stderr
    monkeypatch.setenv("HPCDL_BACKEND", "torch")
    monkeypatch.setenv("HPCDL_BATCH_ROOT", str(tmp_path / "runs"))
    with pytest.raises(ValueError, match="start from a Python script"):
        BatchRun.submit(command=["bash", "-c", "true"], ranks=2, where="local")
    with pytest.raises(ValueError, match="no training backend 'jax'.*installed here are horovod, torch"):
        BatchRun.submit(command=["true"], ranks=2, where="local", backend="jax")
    assert not (tmp_path / "runs").exists(), "a refused run left its directory"


TORCHRUN_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "torchrun_digits.py"


@pytest.mark.ranks
def test_a_torchrun_script_runs_unchanged_as_the_launchers_ranks_and_as_a_batch_run(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    done = subprocess.run([PY, "-m", "jupyter_hpcdl.job.launch", "--local=2", "--label", "--", PY, str(TORCHRUN_SCRIPT),
                           "--epochs", "1"], env={**ENV, "HPCDL_BACKEND": "torch"}, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "0: final loss" in done.stdout and "1: final loss" not in done.stdout
    assert not list(Path.home().glob(".hpcdl-torch-*")), "the launcher left its store behind"
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    monkeypatch.delenv("HPCDL_BACKEND", raising=False)  # named by the run, not by the kernel's environment
    monkeypatch.setenv("HPCDL_BATCH_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("HPCDL_ALLOCATION_FILE", raising=False)
    run = BatchRun.submit(TORCHRUN_SCRIPT, ["--epochs", "1"], ranks=2, name="torch", backend="torch")
    assert run.wait(every=0.5, show=False).exit_code == 0
    assert "final loss" in run.result().rank_output(0)


@pytest.mark.ranks
def test_a_local_batch_run_is_submitted_watched_and_collected(tmp_path, rank_script, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    monkeypatch.setenv("HPCDL_BATCH_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("HPCDL_ALLOCATION_FILE", raising=False)
    run = BatchRun.submit(rank_script, ["0"], ranks=2, name="sum")
    assert run.where == "local" and run.directory.parent == tmp_path / "runs"
    final = run.wait(every=0.5)  # by default, as long as the walltime (30 min) and the queue may take
    assert final.phase == ENDED and final.state == "COMPLETED" and final.exit_code == 0
    assert "running" in capsys.readouterr().out  # it said where the run was on the way
    result = run.result()
    assert result.ok and "rank 1 of 2 sum 1\n" in result.rank_output(1)
    assert "rank 0 of 2" not in result.rank_output(1)
    again = BatchRun.attach(run.directory)  # as a new kernel would
    assert again.job_id == run.job_id and again.status().exit_code == 0
    failing = BatchRun.submit(rank_script, ["7"], ranks=2, name="fails")
    assert failing.wait(timeout=120, every=0.5, show=False).state == "FAILED"
    assert failing.result().exit_code == 7 and failing.result().why == "rank 1 exited with 7"
    assert [r.job_id for r in runs()] == [failing.job_id, run.job_id]


@pytest.mark.ranks
def test_a_local_run_is_cancelled_whole_and_a_wait_gives_up_with_where_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCDL_BATCH_ROOT", str(tmp_path / "runs"))
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    run = BatchRun.submit(command=["sleep", "300"], ranks=2, name="sleeper")
    with pytest.raises(TimeoutError, match=r"running.*still not ended after 1 s.*cancel\(\)"):
        run.wait(timeout=1, every=0.2, show=False)
    with pytest.raises(RuntimeError, match="has not ended yet"):
        run.result()
    launcher = psutil.Process(int(run.job_id.removeprefix("local-")))
    ranks = launcher.children()
    run.cancel(grace=5)
    assert run.status().state == "CANCELLED" and run.result().exit_code == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive


def test_bad_input_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCDL_BATCH_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("HPCDL_ALLOCATION_FILE", raising=False)
    for kwargs, says in [({"script": tmp_path / "missing.py"}, "there is no script"),
                         ({"script": None}, "give the script"),
                         ({"command": ["true"], "script": __file__}, "not both"),
                         ({"command": ["true"], "ranks": 0}, "ranks must be a whole number from 1 to 256"),
                         ({"command": ["true"], "walltime": "soon"}, "walltime must be"),
                         ({"command": ["true"], "name": "a b"}, "not a valid name"),
                         ({"command": ["true"], "directory": tmp_path / "a b"}, "cannot carry other characters"),
                         ({"command": ["true"], "where": "cloud"}, "where must be one of"),
                         ({"command": ["true"], "where": "slurm"}, "allocation's owner")]:
        with pytest.raises((ValueError, RuntimeError), match=says):
            BatchRun.submit(**kwargs)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ValueError, match="not a batch run's directory"):
        BatchRun.attach(tmp_path)


def test_the_batch_script_carries_checked_values_and_the_command_quoted():
    script = batch_run_script(Slurm(), NewAllocation(nodes=2, walltime="00:10:00", partition="gpu", gpus_per_rank=1), 4,
                              "/home/alice/hpcdl-batch/digits-1", "/opt/venv/bin/python", "hpcdl/base:latest",
                              ["python3", "/home/alice/train.py", "--name", "it's; rm -rf ~"], "hpcdl-batch-digits")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "#SBATCH --nodes=2" in lines and "#SBATCH --ntasks=4" in lines
    assert "#SBATCH --time=00:10:00" in lines and "#SBATCH --gpus-per-task=1" in lines
    assert "#SBATCH --output=/home/alice/hpcdl-batch/digits-1/output.log" in lines
    assert lines[-1] == ("exec /opt/venv/bin/python -m jupyter_hpcdl.job.launch --backend=horovod "
                         "--image=hpcdl/base:latest --label "
                         "--status-file=/home/alice/hpcdl-batch/digits-1/status.json -- python3 /home/alice/train.py "
                         "--name 'it'\"'\"'s; rm -rf ~'")
    sge = batch_run_script(GridEngine(), NewAllocation(nodes=2, walltime="00:10:00", partition="gpu", gpus_per_rank=1),
                           4, "/home/alice/hpcdl-batch/digits-1", "/opt/venv/bin/python", "hpcdl/base:latest",
                           ["python3", "/home/alice/train.py"], "hpcdl-batch-digits").splitlines()
    assert sge[1:-1] == ["#$ -N hpcdl-batch-digits", "#$ -o /home/alice/hpcdl-batch/digits-1/output.log", "#$ -j y",
                         "#$ -r n", "#$ -S /bin/bash", "#$ -wd /home/alice/hpcdl-batch/digits-1", "#$ -pe mpi-2 4",
                         "#$ -l h_rt=600,gpu=1", "#$ -q gpu"]
    assert sge[-1] == lines[-1].split(" -- ")[0] + " -- python3 /home/alice/train.py"
    ok = (Slurm(), NewAllocation(), 2, "/home/a/run", "/usr/bin/python3", "hpcdl/base:latest", ["true"], "hpcdl-batch-x",
          "torch")
    for index, bad, says in [(1, NewAllocation(partition="gpu\n#SBATCH --uid=0"), "not a valid name"),
                             (2, 0, "ranks must be"), (3, "/home/a/run dir", "cannot carry"),
                             (3, "relative/run", "cannot carry"), (3, "/home/a/../b", "cannot carry"),
                             (5, "Bad Image", "not valid"), (6, [], "non-empty list"),
                             (7, "name\nx", "not a valid name"), (8, "torch; id", "not a valid name")]:
        args = list(ok)
        args[index] = bad
        with pytest.raises(ValueError, match=says):
            batch_run_script(*args)


def test_the_owner_reports_only_jobs_it_submitted_and_says_when_it_cannot_ask(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    owner = AllocationOwner(environ={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1"})
    status, reply = asyncio.run(handle(owner, "GET", "/jobs/4242", {}))
    assert status == 400 and "not submitted through this allocation's owner" in reply["message"]
    owner._known.add("4242")  # as a batch run's submission leaves it; a scheduler that is not there is "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here
    owner.environ["PATH"] = str(tmp_path)
    status, reply = asyncio.run(handle(owner, "GET", "/jobs/4242", {}))
    assert status == 200 and reply["phase"] == "unknown" and "scontrol" in reply["reason"]
