"""Rank slots computed from the batch system's layout agree with Horovod's own plan."""
import asyncio
import os
import sys
import time

import pytest

from jupyter_hpcdl.job.allocation import AllocationOwner
from jupyter_hpcdl.job.owner import check_ranks_fit, engines_argv
from jupyter_hpcdl.job.ownerapi import handle
from jupyter_hpcdl.batchsystems.gridengine import GridEngine
from jupyter_hpcdl.batchsystems.slurm import Slurm, expand_tasks_per_node, slurm_hosts
from jupyter_hpcdl.job.tasks import gpu_share, spread
from jupyter_hpcdl.backends.horovod.environment import gloo_env
from jupyter_hpcdl.job.world import Slot, hosts_from_tasks, iface_for, plan_slots, task_slot

hosts_mod = pytest.importorskip("horovod.runner.common.util.hosts")


def ask(owner: AllocationOwner, method: str, path: str, body: dict) -> tuple[int, dict]:
    return asyncio.run(handle(owner, method, path, body))


@pytest.mark.parametrize("layout", [[("node1", 1), ("node2", 1)], [("node1", 2), ("node2", 1)],
                                    [("a", 4)], [("a", 1), ("b", 3), ("c", 2)]])
def test_plan_matches_horovod(layout):
    size = sum(n for _, n in layout)
    theirs = hosts_mod.get_host_assignments(hosts_mod.parse_hosts(",".join(f"{h}:{n}" for h, n in layout)), size)
    assert [Slot(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.size) for s in theirs] \
        == plan_slots(layout)


def test_tasks_per_node_expansion():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="tasks per node"):
        expand_tasks_per_node("2(x)")
    with pytest.raises(ValueError, match="2 nodes"):
        slurm_hosts(["a", "b"], "1")


def test_slurm_task_gets_its_slot_and_gloo_env():
    env = {"SLURM_TASKS_PER_NODE": "2,1", "SLURM_PROCID": "2", "SLURMD_NODENAME": "node2", "SLURM_LOCALID": "0"}
    slot = task_slot(Slurm().parse_hosts("node1\nnode2\n", env), *Slurm().task_index(env))
    assert slot == Slot("node2", 2, 0, 1, 1, 2, 3)
    g = gloo_env(slot, "10.0.0.1", 1234, "ib0")
    assert (g["HOROVOD_RANK"], g["HOROVOD_SIZE"], g["HOROVOD_HOSTNAME"], g["HOROVOD_GLOO_IFACE"]) == ("2", "3", "node2", "ib0")
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS" not in g, "Horovod's own default where the caller sets no deadline"
    # a session's ranks wait for each other as long as its start may take, never less than Horovod's 30 s
    assert gloo_env(slot, "10.0.0.1", 1234, "ib0", 120)["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "120"
    assert gloo_env(slot, "10.0.0.1", 1234, "ib0", 5)["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "30"


def test_cyclic_distribution_is_refused_with_the_fix():
    env = {"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "1", "SLURMD_NODENAME": "node2", "SLURM_LOCALID": "0"}
    with pytest.raises(ValueError, match="block-wise"):
        task_slot(slurm_hosts(["node1", "node2"], env["SLURM_TASKS_PER_NODE"]), *Slurm().task_index(env))
    with pytest.raises(ValueError, match="not in a world of 4"):
        task_slot([("a", 2), ("b", 2)], 4)


def test_hosts_from_block_distributed_tasks():
    assert hosts_from_tasks([(2, "node2"), (0, "node1"), (1, "node1"), (3, "node2")]) == [("node1", 2), ("node2", 2)]
    with pytest.raises(ValueError, match="--distribution=block"):
        hosts_from_tasks([(0, "node1"), (1, "node2"), (2, "node1")])


def test_engines_are_tasks_over_the_job_each_in_the_container_with_its_gpu():
    argv = engines_argv(4, "hpcdl/base:latest", "/home/a/.ipython/x-engine.json", python="/v/bin/python",
                        gpus_per_rank=1, env={"CUDA_VISIBLE_DEVICES": "0,1", "HPCDL_ALLOCATION_FILE": "/a.json",
                                              "SECRET": "x"})
    cut = argv.index("--")
    assert argv[:6] == ["/v/bin/python", "-m", "jupyter_hpcdl.job.tasks", "--ranks=4", "--gpus-per-rank=1",
                        "--name=hpcdl-engines"]
    assert argv[6:cut] == ["--env=CUDA_VISIBLE_DEVICES", "--env=HPCDL_ALLOCATION_FILE"], "only what is set, by name"
    assert argv[cut + 1:cut + 5] == ["/v/bin/python", "-m", "jupyter_hpcdl.containers", "run"]
    assert argv[-7:] == ["hpcdl/base:latest", "--", "python3", "-m", "ipyparallel.engine",
                         "--file=/home/a/.ipython/x-engine.json", "--quiet"]
    assert "--env=HPCDL_TASK_RANK" in argv and "--env=SLURM_PROCID" in argv
    assert not any("/a.json" in word or "0,1" in word for word in argv), "names only, never values"
    for bad, says in (((0, "hpcdl/base:latest", "/x.json"), "1 to 4096 ranks"),
                      ((2, "Bad Image", "/x.json"), "image reference"), ((2, "hpcdl/base:latest", "x.json"), "absolute")):
        with pytest.raises(ValueError, match=says):
            engines_argv(*bad)
    assert "--mpi" in engines_argv(2, "hpcdl/base:latest", "/x.json", mpi=True, env={})


def test_slurm_runs_the_tasks_as_one_block_wise_step():
    assert Slurm().step_argv(4, ["cmd"], kill_on_bad_exit=False, nodes=2, gpus_per_task=1, mpi=True,
                             job_name="hpcdl-engines") == [
        "srun", "--kill-on-bad-exit=0", "--distribution=block", "--ntasks=4", "--nodes=2", "--job-name=hpcdl-engines",
        "--gpus-per-task=1", "--mpi=pmix", "cmd"]
    assert Slurm().step_argv(2, ["cmd"], label=True) == ["srun", "--kill-on-bad-exit=1", "--distribution=block",
                                                          "--ntasks=2", "--label", "cmd"]


def test_tasks_started_alone_fill_the_hosts_in_order_each_with_its_share_of_gpus():
    assert spread([("a", 2), ("b", 2)], 3) == [("a", 2), ("b", 1)]
    assert spread([("a", 2)], 2) == [("a", 2)]
    with pytest.raises(ValueError, match="holds 4 task slot"):
        spread([("a", 2), ("b", 2)], 5)
    assert gpu_share("0,1,2,3", 1, 2) == "2,3" and gpu_share("GPU-a,GPU-b", 1, 1) == "GPU-b"
    assert gpu_share("0,1", 0, 0) == "0,1" and gpu_share(None, 0, 1) is None
    with pytest.raises(ValueError, match="needs 1 GPU"):
        gpu_share("0", 1, 1)
    sge = GridEngine()
    assert sge.hosts_argv({"PE_HOSTFILE": "/var/spool/pe"}) == ["cat", "/var/spool/pe"]
    assert sge.parse_hosts("vm 2 gpu@vm UNDEFINED\nvm2 2 gpu@vm2 UNDEFINED\n", {"PE_HOSTFILE": "/x"}) == [
        ("vm", 2), ("vm2", 2)]
    assert sge.hosts_argv({}) is None and sge.parse_hosts("", {"HOSTNAME": "vm"}) == [("vm", 1)], "no PE: one slot"
    with pytest.raises(ValueError, match="SLURM_PROCID is unset"):
        Slurm().task_index({})


def test_owner_api_validates_and_says_what_is_wrong():
    owner = AllocationOwner(environ={})
    assert ask(owner, "GET", "/allocation", {})[1]["job_id"] is None
    assert ask(owner, "POST", "/engines", {"ranks": "4", "image": "x", "connection_file": "/x"}) == (
        400, {"message": "ranks must be a whole number from 1 to 4096"})
    assert ask(owner, "POST", "/engines", {"ranks": 2, "image": "hpcdl/base:latest", "connection_file": "/x"}) == (
        400, {"message": "not inside a batch job"})
    assert ask(owner, "PUT", "/nope", {})[0] == 404


def test_more_ranks_than_the_jobs_slots_are_refused_at_once_with_the_ways_out(monkeypatch):
    owner = AllocationOwner(environ={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "5"})

    async def hosts():
        return [("node1", 1)]  # the form's default: one node, one GPU, one task

    monkeypatch.setattr(owner, "hosts", hosts)
    started = time.monotonic()
    status, reply = ask(owner, "POST", "/engines", {"ranks": 2, "image": "hpcdl/base:latest", "connection_file": "/x"})
    assert time.monotonic() - started < 2 and status == 400, reply
    assert reply["message"].startswith("2 ranks do not fit this job: it has 1 task slot(s), one rank each (node1: 1)")
    assert "TrainingSession(ranks=1)" in reply["message"] and 'where="new"' in reply["message"]
    check_ranks_fit(3, [("a", 2), ("b", 1)])  # fits: nothing to say
    assert owner._steps == []


def test_the_tasks_that_ended_early_are_read_from_srun_and_from_the_launchers_own_lines():
    from jupyter_hpcdl.job.tasks import TaskExit, exit_line, task_exits

    out = ("engine starting\nsrun: error: node2: task 1: Exited with exit code 1\n"
           "srun: error: node1: tasks 2-3,5: Killed\n" + exit_line(4, "vm2", -9) + "\n" + exit_line(1, "x", 2) + "\n")
    assert task_exits(out) == [TaskExit(1, "node2", "Exited with exit code 1"), TaskExit(2, "node1", "Killed"),
                               TaskExit(3, "node1", "Killed"), TaskExit(4, "vm2", "was killed by signal 9"),
                               TaskExit(5, "node1", "Killed")]
    assert task_exits("srun: error: Unable to create step\nrank 1: task 1 failed\n") == []


def test_an_engine_that_ended_is_named_with_its_node_and_log_at_once_not_after_the_start_timeout(tmp_path):
    from jupyter_hpcdl.training.placement import EnginesFailed, PlacementOptions
    from jupyter_hpcdl.training.placement_allocation import AllocationPlacement

    log = tmp_path / "engines-0.log"
    log.write_text("an earlier step's line\nsrun: error: node1: task 0: Exited with exit code 1\n")
    earlier = log.stat().st_size
    with log.open("a") as f:
        f.write("FileNotFoundError: image hpcdl/missing:latest\nsrun: error: node2: task 1: Exited with exit code 1\n")

    class NoEngines:  # a controller no engine reaches
        ids: list = []

    placement = AllocationPlacement(PlacementOptions(ranks=2, start_timeout=120, session_dir=str(tmp_path)))
    placement.client = NoEngines()
    started = time.monotonic()
    with pytest.raises(EnginesFailed) as failed:
        placement._wait_for_engines(str(log), earlier)
    assert time.monotonic() - started < 2
    message = str(failed.value)
    assert message.startswith("the engine of rank 1 on node2: Exited with exit code 1, before it joined"), message
    assert str(log) in message and "image hpcdl/missing:latest" in message and "earlier step" not in message
    placement.options.start_timeout = 0.3
    with pytest.raises(TimeoutError, match=r"2 engines not ready in 0.3 seconds \(0 ready.*their log is "):
        placement._wait_for_engines(str(tmp_path / "quiet.log"), 0)


def test_a_session_asks_for_one_rank_per_slot_of_its_job_or_two_elsewhere(monkeypatch):
    from jupyter_hpcdl.training import TrainingSession
    from jupyter_hpcdl.training import placement

    monkeypatch.delenv("HPCDL_ALLOCATION_FILE", raising=False)
    assert placement.default_ranks("local") == placement.default_ranks("allocation") == 2
    monkeypatch.setattr(placement, "owner_socket", lambda: "/owner.sock")
    monkeypatch.setattr(placement, "request", lambda sock, method, path, timeout: {"slots": [2, 1]})
    assert placement.default_ranks("allocation") == 3 and placement.default_ranks("local") == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ranks must be a whole number of at least 1"):
            TrainingSession(ranks=bad)


def test_new_allocation_script_is_built_from_checked_values():
    from jupyter_hpcdl.job.newjob import NewAllocation, engines_job_template

    fill = dict(cluster_id="c1", profile_dir="/home/a/.ipython/profile_default",
                program_and_args="python -m jupyter_hpcdl.containers run hpcdl/base:latest -- engine")
    alloc = NewAllocation(nodes=2, walltime="00:10", partition="gpu", account="proj-a", gpus_per_rank=1)
    tasks = ("exec /v/bin/python -m jupyter_hpcdl.job.tasks --ranks=4 --gpus-per-rank=1 --name=hpcdl-engines -- python -m "
             "jupyter_hpcdl.containers run hpcdl/base:latest -- engine --profile-dir=/home/a/.ipython/profile_default "
             "--cluster-id=c1")
    assert engines_job_template(Slurm(), alloc, 4, "/v/bin/python").format(**fill).splitlines() == [
        "#!/bin/bash", "#SBATCH --job-name=hpcdl-engines-c1", "#SBATCH --export=ALL", "#SBATCH --nodes=2",
        "#SBATCH --ntasks=4", "#SBATCH --distribution=block", "#SBATCH --time=00:10:00",
        "#SBATCH --output=/home/a/.ipython/profile_default/log/hpcdl-engines-%j.out", "#SBATCH --partition=gpu",
        "#SBATCH --account=proj-a", "#SBATCH --gpus-per-task=1", tasks]
    assert engines_job_template(GridEngine(), alloc, 4, "/v/bin/python").format(**fill).splitlines() == [
        "#!/bin/bash", "#$ -N hpcdl-engines-c1", "#$ -o /home/a/.ipython/profile_default/log/hpcdl-engines-$JOB_ID.out",
        "#$ -j y", "#$ -r n", "#$ -S /bin/bash", "#$ -cwd", "#$ -pe mpi-2 4", "#$ -l h_rt=600,gpu=1", "#$ -q gpu",
        "#$ -A proj-a", tasks]
    assert "#$ -pe smp 2" in engines_job_template(GridEngine(), NewAllocation(), 2, "/v/bin/python")
    with pytest.raises(ValueError, match="spread evenly over 2 nodes"):
        engines_job_template(GridEngine(), NewAllocation(nodes=2), 3, "/v/bin/python")
    assert "--mpi -- {program_and_args}" in engines_job_template(Slurm(), NewAllocation(), 1, "/p", mpi=True)
    with pytest.raises(ValueError, match="cannot carry"):
        engines_job_template(Slurm(), NewAllocation(), 1, "/p p")
    for bad, message in ((dict(partition="gpu\n#SBATCH --uid=0"), "partition"), (dict(account="a;b"), "account"),
                         (dict(nodes=3), "ranks must be a whole number from 3"), (dict(walltime="1h"), "walltime"),
                         (dict(gpus_per_rank=True), "gpus_per_rank"), (dict(partition="{n}"), "partition")):
        for sched in (Slurm(), GridEngine()):
            with pytest.raises(ValueError, match=message):
                engines_job_template(sched, NewAllocation(**bad), 2, "/v/bin/python")


def test_engines_that_did_not_join_one_world_are_refused():
    from jupyter_hpcdl.training.joining import check_one_world

    check_one_world([{"rank": 1, "size": 2}, {"rank": 0, "size": 2}], 2)
    for world in ([{"rank": 0, "size": 1}, {"rank": 0, "size": 1}], [{"rank": 0, "size": 2}, {"rank": 2, "size": 2}]):
        with pytest.raises(RuntimeError, match="did not join one Horovod world"):
            check_one_world(world, 2)


def test_owner_submits_and_cancels_only_what_it_should(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    outside = AllocationOwner(environ={"PATH": "/usr/bin:/bin"})
    status, reply = ask(outside, "POST", "/jobs", {"batch_file": "/etc/passwd"})
    assert status == 400 and "no batch system to submit to" in reply["message"]
    owner = AllocationOwner(environ={"PATH": "/usr/bin:/bin", "JOB_ID": "7", "SGE_ROOT": "/usr/share/gridengine"})
    assert owner.sched.name == "gridengine" and owner.job_id == "7"
    status, reply = ask(owner, "POST", "/jobs", {"batch_file": "/etc/passwd"})
    assert status == 400 and "in your home directory" in reply["message"]
    status, reply = ask(owner, "POST", "/jobs", {"batch_file": str(tmp_path / "missing.sbatch")})
    assert status == 400 and "existing file" in reply["message"]
    status, reply = ask(owner, "DELETE", "/jobs/12345", {})
    assert status == 400 and "not submitted through this allocation's owner" in reply["message"]
    assert ask(owner, "DELETE", "/jobs/1;rm", {})[0] == 404


def test_an_owner_in_a_job_of_an_adapter_without_the_jobs_side_says_so():
    owner = AllocationOwner(environ={"PATH": "/usr/bin:/bin", "PBS_JOBID": "5.server", "PBS_ENVIRONMENT": "PBS_BATCH"})
    assert owner.sched is not None and owner.sched.name == "pbs" and owner.job_id == "5.server"
    status, reply = ask(owner, "GET", "/allocation", {})
    assert status == 400 and reply["message"].startswith(
        "the pbs adapter does not serve training inside its jobs (the allocation's owner, its tasks, hpcdl-launch) "
        "yet (it serves: the hub's servers (the form's jobs);"), reply


def test_tasks_say_what_is_missing_instead_of_a_traceback(capsys, monkeypatch):
    from jupyter_hpcdl.job.tasks import main

    for name in ("SLURM_JOB_ID", "JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--ranks=1", "--", "true"]) == 2 and "not inside a batch job" in capsys.readouterr().err
    monkeypatch.setenv("PBS_JOBID", "5.server")
    assert main(["--ranks=1", "--", "true"]) == 2
    assert "the pbs adapter does not serve training inside its jobs" in capsys.readouterr().err


class _HereAdapter:
    """A batch system whose tasks "started alone" run on this machine: what tasks.run_tasks does with them."""

    name = "here"

    def __init__(self, slots: int):
        self.slots = slots

    def hosts_argv(self, env):
        return ["echo", f"here {self.slots}"]

    def parse_hosts(self, stdout, env):
        host, n = stdout.split()
        return [(host, int(n))]

    def task_argv(self, host, names, argv):
        return list(argv)


def _tasks_args(*words):
    from jupyter_hpcdl.job.tasks import _parser

    args = _parser().parse_args(list(words))
    return args, args.command[1:]


def test_tasks_started_alone_know_their_rank_and_gpu_and_give_the_first_failure(tmp_path, monkeypatch, capsys):
    from jupyter_hpcdl.job.tasks import run_tasks

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    out = tmp_path / "seen"
    code = ("import os, sys; open(sys.argv[1] + os.environ['HPCDL_TASK_RANK'], 'w').write("
            "os.environ['HPCDL_TASK_NODE'] + ' ' + os.environ['CUDA_VISIBLE_DEVICES']); "
            "sys.exit(int(os.environ['HPCDL_TASK_RANK']) * 3)")
    args, command = _tasks_args("--ranks=2", "--gpus-per-rank=1", "--", sys.executable, "-c", code, str(out))
    assert run_tasks(_HereAdapter(2), args, command) == 3, "the failing task's code"
    assert "jupyter_hpcdl.job.tasks: task 1 on here exited with exit code 3" in capsys.readouterr().err
    assert [(tmp_path / f"seen{r}").read_text() for r in (0, 1)] == ["here 4", "here 5"]


def test_a_stopped_launcher_ends_its_tasks_through_their_stdin(tmp_path):
    import signal
    import threading

    import psutil

    from jupyter_hpcdl.job.tasks import run_tasks

    marker = f"hpcdl-test-{os.getpid()}"
    args, command = _tasks_args("--ranks=2", "--", sys.executable, "-c", "import time; time.sleep(120)", marker)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, lambda *_: None)  # never pytest's own end, whatever run_tasks does
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = run_tasks(_HereAdapter(2), args, command)
    finally:
        timer.cancel()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or ())]
    assert code == 143 and not left, (code, left)


def test_the_interface_of_an_address_is_the_one_holding_it_or_its_network():
    interfaces = {"lo": [("127.0.0.1", "255.0.0.0"), ("::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")],
                  "eth0": [("192.0.2.2", "255.255.255.0"), ("fe80::1%eth0", "ffff:ffff:ffff:ffff::"),
                           ("02:00:00:00:00:01", None)]}
    assert iface_for("192.0.2.2", interfaces) == "eth0"
    assert iface_for("127.0.0.1", interfaces) == "lo"
    assert iface_for("127.0.0.2", interfaces) == "lo"  # a second host's name on loopback (the bed's Grid Engine)
    assert iface_for("192.0.2.9", interfaces) == "eth0"
    overlapping = {"eth0": [("10.0.0.5", "255.0.0.0")], "ib0": [("10.1.0.5", "255.255.0.0")]}
    assert iface_for("10.1.2.3", overlapping) == "ib0" and iface_for("10.2.0.1", overlapping) == "eth0"
    with pytest.raises(ValueError, match="no network interface holds 10.1.1.1"):
        iface_for("10.1.1.1", interfaces)
    with pytest.raises(ValueError, match="not an IP address"):
        iface_for("node1", interfaces)
    assert iface_for("127.0.0.1") == "lo"  # this machine's own
