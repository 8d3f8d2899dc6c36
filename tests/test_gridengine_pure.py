"""Grid Engine's adapter alone, on outputs recorded from Son of Grid Engine 8.1.9 (Debian 12's gridengine-*) on the
bed (tests/recorded/gridengine/), and the site hooks every adapter shares."""
import asyncio
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_hpcdl.spawner import envfile
from jupyter_hpcdl.commands import Result
from jupyter_hpcdl.batchsystems.gridengine import GridEngine, phase
from jupyter_hpcdl.batchsystems.scheduler import JobRequest
from jupyter_hpcdl.spawner.orphans import JobMark, is_orphan
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.batchsystems.scheduler import ENDED, PENDING, RUNNING
from jupyter_hpcdl.spawner.script import ScriptContext, build_batch_script
from jupyter_hpcdl.batchsystems.slurm import Slurm

REC = Path(__file__).parent / "recorded" / "gridengine"
REQ = JobRequest("gpu", 1, 2, 90, "base", "hpcdl/base:latest", account="proj1")


def rec(name: str) -> str:
    return (REC / name).read_text()


def test_states_become_phases():
    assert [phase(s) for s in ("qw", "hqw", "hRwq", "r", "t", "Rr", "dr", "s", "St", "Eqw", "dqw")] == \
        [PENDING, PENDING, PENDING, RUNNING, RUNNING, RUNNING, RUNNING, PENDING, PENDING, ENDED, ENDED]


def test_header_asks_one_gpu_per_slot_in_the_single_node_pe():
    sge = GridEngine()
    lines = sge.header(REQ, "jupyterhub-hpcdl", "/home/alice/.jupyter-hpcdl/jobs/$JOB_ID.log", "/home/alice",
                       "jupyterhub-hpcdl:hub:alice:")
    assert lines == ["#$ -N jupyterhub-hpcdl", "#$ -q gpu", "#$ -o /home/alice/.jupyter-hpcdl/jobs/$JOB_ID.log",
                     "#$ -j y", "#$ -wd /home/alice", "#$ -r n", "#$ -S /bin/bash", "#$ -pe smp 2",
                     "#$ -l h_rt=01:30:00,gpu=1", "#$ -A proj1", "#$ -ac hpcdl_mark=jupyterhub-hpcdl:hub:alice:"]


def test_header_several_nodes_uses_the_per_node_pe_and_memory_per_slot():
    sge = GridEngine(pe_multi_node="gpu{gpus_per_node}", extra_directives=["-P ml", "-l scratch=10G"])
    req = JobRequest("gpu", 2, 4, 60, "base", "x", memory_gb=64, gpu_type="a100", reservation="17")
    lines = sge.header(req, "n", "/o", "/w")
    assert "#$ -pe gpu4 8" in lines and "#$ -l h_rt=01:00:00,gpu=1,gpu_type=a100,mem_free=16384M" in lines
    assert "#$ -ar 17" in lines and lines[-2:] == ["#$ -P ml", "#$ -l scratch=10G"]


def test_site_hooks_are_one_line_each():
    with pytest.raises(Exception, match="must be one line"):
        Slurm(prologue=["module load cuda\nrm -rf /"])


def test_script_runs_prologue_and_epilogue_and_keeps_the_servers_code(tmp_path):
    sched = Slurm(prologue=["echo pro >> log"], epilogue=["echo epi >> log"])
    ctx = ScriptContext(python=sys.executable, output="/o", workdir="/w", singleuser_cmd=("false",))
    script = build_batch_script(REQ, sched, ctx)
    # The job's side fails at once here (no hub): the epilogue still runs, and the script exits with its code.
    script = script.replace(f"{sys.executable} -m jupyter_hpcdl.job.server", "sh -c 'exit 7'")
    path = tmp_path / "job.sh"
    path.write_text(script)
    proc = subprocess.run(["bash", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 7 and (tmp_path / "log").read_text() == "pro\nepi\n"


def test_submit_takes_values_from_the_environment_and_prints_the_id():
    sge = GridEngine()
    assert sge.submit_argv(["PATH", "HOME"]) == ["qsub", "-terse", "-v", "PATH,HOME"]
    assert sge.parse_submit("42\n") == "42"
    with pytest.raises(ValueError, match="no job id"):
        sge.parse_submit('Your job 42 ("x") has been submitted\n')


def test_queue_listing_running_and_pending():
    jobs = GridEngine().parse_queue(rec("qstat-running-pending.xml"))
    assert set(jobs) == {"1", "2", "3"}
    assert (jobs["1"].phase, jobs["1"].state, jobs["1"].batch_host, jobs["1"].user) == (RUNNING, "r", "vm", "alice")
    assert (jobs["2"].phase, jobs["2"].batch_host) == (PENDING, "")


def test_a_name_that_breaks_the_xml_does_not_empty_the_listing():
    text = rec("qstat-odd-name.xml").replace("x%lt;y&gt;&amp;z", "x<y")  # as if qstat had not escaped it at all
    jobs = GridEngine().parse_queue(text)
    assert list(jobs) == ["7"] and jobs["7"].phase == RUNNING
    with pytest.raises(ValueError, match="does not parse"):
        GridEngine().parse_queue("<job_info><queue_info>")


def test_details_give_the_pending_reason_and_the_error():
    sge = GridEngine()
    pending = sge.parse_job(rec("qstat-j-pending.xml"))
    assert pending.phase == PENDING and "offers only hc:gpu=0.000000" in pending.reason
    error = sge.parse_job(rec("qstat-j-error.xml"))
    assert (error.phase, error.state) == (ENDED, "Eqw")
    assert "can't chdir to /nonexistent/dir" in error.reason
    assert sge.parse_job(rec("qstat-j-running.xml")).phase == RUNNING
    # a job Grid Engine is taking down (its task's status no longer "running", its start time kept) is not pending
    ending = rec("qstat-j-running.xml").replace("<JAT_status>128</JAT_status>", "<JAT_status>65536</JAT_status>")
    assert sge.parse_job(ending).phase == RUNNING
    assert sge.parse_job("<?xml version='1.0'?>\n<unknown_jobs >\n <ST_name>999</ST_name>\n</unknown_jobs>\n") is None


def test_accounting_gives_the_exit_code():
    info = GridEngine().parse_job(rec("qacct-exit3.txt"))
    assert (info.job_id, info.phase, info.state, info.exit_code, info.batch_host) == ("4", ENDED, "FAILED", "3", "vm")
    assert GridEngine().job_forgotten("error: job id 999 not found\n")


def test_named_jobs_and_the_mark_are_read_from_xml():
    sge = GridEngine()
    assert sge.parse_job_ids(rec("qstat-running-pending.xml"), "jupyterhub-hpcdl") == ["1", "2", "3"]
    assert sge.parse_job_ids(rec("qstat-running-pending.xml"), "other") == []
    mark = sge.parse_comment(rec("qstat-j-mark.xml"))
    assert JobMark.parse(mark) == JobMark("jupyterhub", "alice", "my gpu")
    job = sge.parse_queue(rec("qstat-odd-name.xml"))["7"]
    assert is_orphan(job, mark, "jupyterhub") == JobMark("jupyterhub", "alice", "my gpu")
    assert sge.parse_comment(rec("qstat-j-pending.xml")) == ""  # another context variable is not the mark


def test_availability_counts_free_and_used_gpus():
    avail = GridEngine().parse_availability(rec("qstat-f-r-gpu.xml"))
    assert avail["gpu"].nodes == 1 and avail["gpu"].idle_nodes == 0
    assert (avail["gpu"].gpus, avail["gpu"].idle_gpus) == (4, 0)  # one job: 2 slots x gpu=2


def test_queue_asks_why_a_job_waits_and_reads_accounting_once_it_is_gone():
    sge = GridEngine()
    answers = {"qstat -u * -xml": rec("qstat-running-pending.xml"), "qstat -j 2 -xml": rec("qstat-j-pending.xml"),
               "qstat -j 4 -xml": "<?xml version='1.0'?>\n<unknown_jobs >\n <ST_name>4</ST_name>\n</unknown_jobs>\n",
               "qacct -j 4": rec("qacct-exit3.txt")}
    asked = []

    async def runner(argv, timeout):
        asked.append(" ".join(argv))
        return Result(argv, 0, answers[" ".join(argv)], "")

    async def go():
        queue = JobQueue(sge, interval=60, runner=runner)
        waiting = await queue.job("2")
        again = await queue.job("2")
        gone = await queue.job("4")
        return waiting, again, gone

    waiting, again, gone = asyncio.run(go())
    assert "offers only hc:gpu" in waiting.reason and again.reason == waiting.reason
    assert asked.count("qstat -j 2 -xml") == 1  # once per reading of the queue
    assert (gone.phase, gone.exit_code) == (ENDED, "3")


def test_env_file_is_private_and_read_once(tmp_path):
    path = str(tmp_path / "jobs" / "env-default.json")
    proc = subprocess.run([sys.executable, "-m", "jupyter_hpcdl.spawner.envfile", path],
                          input=json.dumps({"JUPYTERHUB_API_TOKEN": "s3cret"}), text=True, capture_output=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert envfile.load(path) == {"JUPYTERHUB_API_TOKEN": "s3cret"} and not os.path.exists(path)


def test_grid_engine_script_passes_secrets_by_file_not_by_environment():
    sge = GridEngine()
    assert sge.private_env is False
    ctx = ScriptContext(python="/p", output="/o/$JOB_ID.log", workdir="/w", env_file="/home/alice/.jupyter-hpcdl/jobs/env-default.json")
    script = build_batch_script(REQ, sge, ctx)
    assert "--env-file=/home/alice/.jupyter-hpcdl/jobs/env-default.json" in script
    assert 'export HPCDL_JOB_ID="${JOB_ID:-}" HPCDL_NODE="${HOSTNAME:-}"' in script


def test_the_job_side_finds_its_scheduler_and_its_hosts():
    from jupyter_hpcdl.job.launch import _parse_hosts
    from jupyter_hpcdl.batchsystems.scheduler import job_scheduler

    assert job_scheduler({"SLURM_JOB_ID": "5"}).name == "slurm"
    assert job_scheduler({"JOB_ID": "7", "SGE_ROOT": "/var/lib/gridengine"}).name == "gridengine"
    assert job_scheduler({"HOME": "/home/alice"}) is None
    hosts = GridEngine().parse_pe_hostfile("vm 2 gpu@vm UNDEFINED\nnode7 1 gpu@node7 UNDEFINED\n")
    assert hosts == [("vm", 2), ("node7", 1)] and _parse_hosts("vm:2,node7:1") == hosts
    with pytest.raises(ValueError, match="parallel environment"):
        GridEngine().parse_pe_hostfile("")


def test_a_task_alone_is_quoted_for_the_remote_shell():
    argv = GridEngine().task_argv("node7", ["HPCDL_RENDEZVOUS"], ["python3", "-c", "print('a b'); import sys"])
    assert argv[:5] == ["qrsh", "-inherit", "-v", "HPCDL_RENDEZVOUS", "node7"]
    assert shlex.split(argv[5]) == ["python3", "-c", "print('a b'); import sys"]  # one word each, as given
    assert Slurm().step_argv(4, ["x"], label=True) == ["srun", "--kill-on-bad-exit=1", "--distribution=block", "--ntasks=4",
                                                 "--label", "x"]


def test_an_accounting_that_cannot_be_read_ends_the_job_not_the_queue():
    sge = GridEngine()
    unknown = "<?xml version='1.0'?>\n<unknown_jobs >\n <ST_name>9</ST_name>\n</unknown_jobs>\n"

    async def runner(argv, timeout):
        if argv[0] == "qacct":
            return Result(argv, 1, "", "error: accounting file /var/lib/gridengine/default/common/accounting: Permission denied")
        return Result(argv, 0, rec("qstat-running-pending.xml") if argv[1] == "-u" else unknown, "")

    async def go():
        queue = JobQueue(sge, interval=60, runner=runner)
        return await queue.job("9"), queue.reachable

    info, reachable = asyncio.run(go())
    assert reachable and info.phase == ENDED and "accounting could not be read" in info.reason


def test_accounting_without_a_failed_value_and_details_that_do_not_parse():
    text = rec("qacct-exit3.txt").replace("failed       0    ", "failed")
    assert GridEngine().parse_job(text).exit_code == "3"

    async def runner(argv, timeout):
        return Result(argv, 0, rec("qstat-running-pending.xml") if argv[1] == "-u" else "<djob_info><element>", "")

    async def go():
        queue = JobQueue(GridEngine(), interval=60, runner=runner)
        return await queue.job("2"), await queue.job("5")

    waiting, gone = asyncio.run(go())
    assert waiting.phase == PENDING and waiting.reason == ""  # the listing's answer stands
    assert gone.phase == "unknown"  # an unreadable answer about a job that left the queue: not "ended"


def test_launch_in_a_job_it_cannot_start_ranks_in_says_so(monkeypatch, capsys):
    from jupyter_hpcdl.job import launch

    monkeypatch.setattr(os, "environ", {"PBS_JOBID": "12.server", "PATH": "/usr/bin"})
    assert launch.main(["--image=hpcdl/base:latest", "--", "true"]) == 2
    assert "inside a pbs job is not supported yet" in capsys.readouterr().err


def test_a_running_jobs_time_left_queue_and_gpus_come_from_its_details():
    sge = GridEngine()
    started = 1796175338  # JAT_start_time of the recorded job, which asked for h_rt=600 and gpu=2 per slot
    found = sge.parse_resources(rec("qstat-j-running.xml"), now=started + 90)
    assert (found.time_left_s, found.partition, found.gpus_per_task, found.gpus_per_node) == (510, "gpu", 2, None)
    assert found.time_left == "0:08:30"
    assert sge.parse_resources(rec("qstat-j-running.xml"), now=started + 900).time_left_s == 0
    assert sge.parse_resources(rec("qstat-j-pending.xml"), now=started).time_left_s is None, "not started"
    unknown = "<?xml version='1.0'?>\n<unknown_jobs >\n <ST_name>9</ST_name>\n</unknown_jobs>\n"
    assert sge.parse_resources(unknown, now=started) is None
    assert sge.resources_argv("12") == ["qstat", "-j", "12", "-xml"]


def test_slurm_says_time_left_partition_and_gpus_in_one_line():
    found = Slurm().parse_resources("1-02:00:00|gpu|gres/gpu:2\n", now=0)
    assert (found.time_left_s, found.partition, found.gpus_per_node) == (93600, "gpu", 2)
    assert Slurm().parse_resources("UNLIMITED|cpu|N/A", now=0).time_left_s is None
    assert Slurm().parse_resources("", now=0) is None
