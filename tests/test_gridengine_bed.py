"""Grid Engine's adapter against the real Son of Grid Engine of the bed, as alice: the same queue, the same parsers
and the same mark that the spawner uses; jobs on one host and across the bed's two."""
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from jupyter_hpcdl.commands import run
from jupyter_hpcdl.batchsystems.gridengine import GridEngine
from jupyter_hpcdl.batchsystems.scheduler import JobRequest
from jupyter_hpcdl.spawner.orphans import JobMark
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.batchsystems.scheduler import ENDED, PENDING, RUNNING

pytestmark = [pytest.mark.testbed, pytest.mark.stream("rest")]  # beside the Slurm tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
import config as bedconfig  # noqa: E402

SGE = GridEngine(pe_multi_node=bedconfig.SGE_PE_MULTI_NODE)  # configured as the bed's Grid Engine hub is
NAME = "hpcdl-sge-test"


async def as_alice(argv, timeout=30, input=None):
    return await run(["runuser", "-u", "alice", "--", *argv], timeout=timeout, input=input)


def script(alice, gpus: int, body: str, workdir: str = "", comment: str = "", nodes: int = 1) -> str:
    req = JobRequest("gpu", nodes, gpus, 10, "base", "hpcdl/base:latest")
    header = SGE.header(req, NAME, f"{alice.home}/sge-$JOB_ID.log", workdir or alice.home, comment)
    return "\n".join(["#!/bin/bash", *header, body]) + "\n"


async def submit(alice, text: str) -> str:
    result = (await as_alice(SGE.submit_argv(["PATH"]), input=text)).check("qsub")
    return SGE.parse_submit(result.stdout)


async def wait_phase(queue: JobQueue, job_id: str, phases: set, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        info = await queue.job(job_id, max_age=0.5)
        if info is not None and info.phase in phases:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} not {phases} after {timeout} s: {info}")
        await asyncio.sleep(0.5)


@pytest.fixture
def queue(alice):
    q = JobQueue(SGE, interval=0.5, runner=as_alice, timeout=30)
    yield q
    asyncio.run(as_alice(["qdel", "-u", "alice"]))


def test_a_job_runs_with_its_gpus_and_carries_the_hubs_mark(bed, alice, queue):
    mark = JobMark("testhub", "alice", "sge run")

    async def go():
        job_id = await submit(alice, script(alice, 2, 'echo "slots=$NSLOTS"; sleep 120', comment=mark.comment()))
        info = await wait_phase(queue, job_id, {RUNNING})
        comment = await as_alice(SGE.comment_argv(job_id))
        named = await as_alice(SGE.named_jobs_argv(NAME))
        avail = await as_alice(SGE.availability_argv())
        await as_alice(SGE.cancel_argv(job_id))
        gone = await wait_phase(queue, job_id, {ENDED})
        return job_id, info, comment, named, avail, gone

    job_id, info, comment, named, avail, gone = asyncio.run(go())
    assert info.batch_host in bed["sge_hosts"] and info.user == "alice"
    assert JobMark.parse(SGE.parse_comment(comment.stdout)) == mark
    assert job_id in SGE.parse_job_ids(named.stdout, NAME)
    gpu = SGE.parse_availability(avail.stdout)["gpu"]
    total = bed["gpus_per_node"] * len(bed["sge_hosts"])
    assert (gpu.nodes, gpu.gpus, gpu.idle_gpus) == (len(bed["sge_hosts"]), total, total - 2)
    assert gone.phase == ENDED and gone.exit_code != "0"  # deleted while running: killed


def test_the_exit_code_comes_from_the_accounting(bed, alice, queue):
    async def go():
        job_id = await submit(alice, script(alice, 0, "exit 3"))
        return await wait_phase(queue, job_id, {ENDED})

    info = asyncio.run(go())
    assert (info.state, info.exit_code) == ("FAILED", "3") and info.batch_host in bed["sge_hosts"]


def test_a_job_in_error_is_a_failure_with_its_reason_not_pending(alice, queue):
    async def go():
        job_id = await submit(alice, script(alice, 1, "true", workdir="/nonexistent/hpcdl"))
        return await wait_phase(queue, job_id, {ENDED})

    info = asyncio.run(go())
    assert info.state == "Eqw" and "can't chdir to /nonexistent/hpcdl" in info.reason


def test_a_waiting_job_says_why(bed, alice, queue):
    async def go():  # the first job takes every GPU of both hosts
        first = await submit(alice, script(alice, bed["gpus_per_node"], "sleep 120", nodes=len(bed["sge_hosts"])))
        await wait_phase(queue, first, {RUNNING})
        second = await submit(alice, script(alice, 1, "sleep 1"))
        deadline = time.monotonic() + 20  # the reason comes with the first scheduling run that passes it over
        while True:
            info = await wait_phase(queue, second, {PENDING})
            if info.reason or time.monotonic() > deadline:
                return info
            await asyncio.sleep(0.5)

    info = asyncio.run(go())
    assert "full" in info.reason or "gpu" in info.reason, info  # four slots, four GPUs a host: all are taken


def test_a_jobs_environment_is_shown_to_other_users(alice, bob):
    """Why Grid Engine's jobs get their secrets by file (GridEngine.private_env): qstat -j shows -v values to all."""
    async def go():
        result = await run(["runuser", "-u", "alice", "--", "env", "HPCDL_PROBE=visible-to-bob", *SGE.submit_argv(["HPCDL_PROBE"])],
                           input=script(alice, 0, "sleep 30"), timeout=30)
        job_id = SGE.parse_submit(result.check("qsub").stdout)
        seen = await run(["runuser", "-u", "bob", "--", "qstat", "-j", job_id], timeout=30)
        await as_alice(["qdel", job_id])
        return seen

    assert "visible-to-bob" in asyncio.run(go()).stdout
    assert SGE.private_env is False


def launch_job(alice, body: str, slots: int = 2, pe: str = "smp") -> str:
    return "\n".join(["#!/bin/bash", f"#$ -q gpu -pe {pe} {slots} -l h_rt=0:05:00,gpu=1 -o {alice.home}/sge-launch.out -j y",
                      f"#$ -wd {alice.home} -S /bin/bash -N {NAME}", body]) + "\n"


@pytest.mark.parametrize("pe", ["smp", bedconfig.SGE_PE_MULTI_NODE.format(gpus_per_node=1)])
def test_hpcdl_launch_joins_ranks_in_containers_into_one_horovod_world(bed, alice, queue, pe):
    """Two ranks on one host (smp) and one on each host (a PE of one slot a host), each in alice's container."""
    out = Path(alice.home, "sge-launch.out")
    out.unlink(missing_ok=True)
    script = launch_job(alice, f"hpcdl-launch --image={bed['image']} -e TF_CPP_MIN_LOG_LEVEL -- "
                               "python3 -m jupyter_hpcdl.diagnose --allreduce", pe=pe)
    job_id = SGE.parse_submit(alice.run("qsub", "-terse", "-v", "PATH,TF_CPP_MIN_LOG_LEVEL", input=script, check=True).stdout)
    info = asyncio.run(wait_phase(queue, job_id, {ENDED}, timeout=240))
    text = out.read_text()
    ranks = sorted((json.loads(line) for line in text.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert info.exit_code == "0", text[-3000:]
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)], text[-3000:]
    nodes = [r["node"] for r in ranks]
    assert set(nodes) <= set(bed["sge_hosts"])
    assert len(set(nodes)) == (1 if pe == "smp" else 2), nodes
    assert all(r["cuda_visible_devices"] for r in ranks), ranks  # a GPU of its host's, each
    assert all(r["allreduce_sum"] == 3.0 and r["image"] == bed["identity"] and r["uid"] == alice.uid for r in ranks)


def test_an_unchanged_torchrun_script_runs_as_pytorch_ranks_one_on_each_host(bed, alice, queue):
    """``hpcdl-launch --backend torch``: each task (``qrsh -inherit``, which passes only what is named) is told its
    backend on its command line and joins the world through the launcher's file store."""
    out = Path(alice.home, "sge-launch.out")
    out.unlink(missing_ok=True)
    example = Path(__file__).resolve().parents[1] / "examples" / "torchrun_digits.py"
    train = alice.write(Path(alice.home) / "torchrun_digits.py", example.read_text())
    pe = bedconfig.SGE_PE_MULTI_NODE.format(gpus_per_node=1)
    script = launch_job(alice, f"hpcdl-launch --backend torch --label --image=hpcdl/torch:latest -- "
                               f"python3 {train} --epochs 1", pe=pe)
    try:
        job_id = SGE.parse_submit(alice.run("qsub", "-terse", "-v", "PATH", input=script, check=True).stdout)
        info = asyncio.run(wait_phase(queue, job_id, {ENDED}, timeout=240))
        text = out.read_text()
    finally:
        Path(train).unlink(missing_ok=True)
    assert info.exit_code == "0", text[-3000:]
    assert "0: final loss" in text and "every rank exited with 0" in text, text[-3000:]
    assert not list(Path(alice.home).glob(".hpcdl-torch-*")), "the launcher left its store behind"


def test_a_failing_rank_ends_the_others_and_gives_the_jobs_exit_code(bed, alice, queue):
    out = Path(alice.home, "sge-launch.out")
    out.unlink(missing_ok=True)
    rank_code = "import os, sys, time; r = os.environ['HOROVOD_RANK']; sys.exit(3) if r == '1' else time.sleep(300)"
    script = launch_job(alice, f"hpcdl-launch --label --image={bed['image']} -- python3 -c {shlex.quote(rank_code)}")
    job_id = SGE.parse_submit(alice.run("qsub", "-terse", "-v", "PATH", input=script, check=True).stdout)
    info = asyncio.run(wait_phase(queue, job_id, {ENDED}, timeout=120))
    text = out.read_text()
    assert info.exit_code == "3", text[-3000:]
    assert "hpcdl-launch: rank 1 exited with 3" in text


def test_jobs_get_their_own_gpus_and_their_tasks_the_same(bed, alice, queue):
    """The bed's starter method binds GPUs (Grid Engine has no binding of its own): jobs get disjoint
    CUDA_VISIBLE_DEVICES on each host, and a task a job starts alone (qrsh -inherit) sees its job's GPUs on the
    task's host, on the job's first host as on the other."""
    body = ('echo "job=$HOSTNAME:$CUDA_VISIBLE_DEVICES"; for host in $(cut -d" " -f1 "$PE_HOSTFILE"); do '
            'qrsh -inherit "$host" \'echo "task=$HOSTNAME:$CUDA_VISIBLE_DEVICES"\'; done; sleep 5')

    async def go():
        ids = [await submit(alice, script(alice, 2, body)) for _ in range(2)]
        ids.append(await submit(alice, script(alice, 2, body, nodes=2)))
        for job_id in ids:
            await wait_phase(queue, job_id, {ENDED}, timeout=90)
        return ids

    held, logs = [], []
    for job_id in asyncio.run(go()):
        text = Path(alice.home, f"sge-{job_id}.log").read_text()
        logs.append(text)
        seen = [line.split("=", 1) for line in text.split() if line.startswith(("job=", "task="))]
        job = dict(line.split(":") for kind, line in seen if kind == "job")
        tasks = dict(line.split(":") for kind, line in seen if kind == "task")
        assert set(job) <= set(tasks) <= set(bed["sge_hosts"]) and all(tasks[h] == job[h] for h in job), text[-2000:]
        assert all(len(gpus.split(",")) == 2 for gpus in tasks.values()), tasks
        held.append({(host, gpu) for host, gpus in tasks.items() for gpu in gpus.split(",")})
    # two GPUs on each host; else the job's log says what each qrsh -inherit answered
    assert len(held[2]) == 4 and len({host for host, _ in held[2]}) == 2, (held[2], logs[2][-2000:])
    assert not held[0] & held[1], held  # two jobs at once: never the same GPU of a host


@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 2), (2, 2)])
def test_tasks_run_one_per_slot_each_with_its_rank_and_own_gpu(bed, alice, queue, nodes, gpus):
    """``jupyter_hpcdl.job.tasks`` in a job: one task per slot (qrsh -inherit in a PE; in a job of one slot, which has
    no PE, here), each knowing its rank and host (block-wise over the hosts) and seeing a GPU of its own there."""
    python = bed["venv"] + "/bin/python"
    ranks = nodes * gpus
    body = (f"{python} -m jupyter_hpcdl.job.tasks --ranks={ranks} --gpus-per-rank=1 -- "
            "sh -c 'echo task=$HPCDL_TASK_RANK:$HPCDL_TASK_NODE:$HOSTNAME:$CUDA_VISIBLE_DEVICES'; echo code=$?")

    async def go():
        job_id = await submit(alice, script(alice, gpus, body, nodes=nodes))
        await wait_phase(queue, job_id, {ENDED}, timeout=90)
        return job_id

    text = Path(alice.home, f"sge-{asyncio.run(go())}.log").read_text()
    tasks = sorted((line.split("=", 1)[1].split(":") for line in text.split() if line.startswith("task=")),
                   key=lambda t: int(t[0]))
    assert "code=0" in text, text[-2000:]
    assert [int(rank) for rank, *_ in tasks] == list(range(ranks)), text[-2000:]
    hosts = [node for _, node, _, _ in tasks]
    assert all(node == host for _, node, host, _ in tasks), tasks  # each task runs where it is told (Grid Engine says)
    assert set(hosts) <= set(bed["sge_hosts"]) and len(set(hosts)) == nodes, tasks
    assert hosts == sorted(hosts, key=hosts.index) and all(hosts.count(h) == gpus for h in set(hosts)), tasks
    assert len({(node, gpu) for _, node, _, gpu in tasks}) == ranks, tasks  # a GPU of its own on its host
    assert all(gpu and "," not in gpu for *_, gpu in tasks), tasks
