"""Rank slots computed from the batch system's layout agree with Horovod's own plan."""
import asyncio

import pytest

from jupyter_hpcdl.allocation import AllocationOwner, engine_srun_argv, handle
from jupyter_hpcdl.world import (Slot, expand_tasks_per_node, gloo_env, hosts_from_tasks, plan_slots, slurm_hosts,
                                 slurm_slot)

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
    slot = slurm_slot(env, ["node1", "node2"])
    assert slot == Slot("node2", 2, 0, 1, 1, 2, 3)
    g = gloo_env(slot, "10.0.0.1", 1234, "ib0")
    assert (g["HOROVOD_RANK"], g["HOROVOD_SIZE"], g["HOROVOD_HOSTNAME"], g["HOROVOD_GLOO_IFACE"]) == ("2", "3", "node2", "ib0")


def test_cyclic_distribution_is_refused_with_the_fix():
    env = {"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "1", "SLURMD_NODENAME": "node2", "SLURM_LOCALID": "0"}
    with pytest.raises(ValueError, match="--distribution=block"):
        slurm_slot(env, ["node1", "node2"])


def test_hosts_from_block_distributed_tasks():
    assert hosts_from_tasks([(2, "node2"), (0, "node1"), (1, "node1"), (3, "node2")]) == [("node1", 2), ("node2", 2)]
    with pytest.raises(ValueError, match="--distribution=block"):
        hosts_from_tasks([(0, "node1"), (1, "node2"), (2, "node1")])


def test_engine_step_runs_engines_in_the_container_one_gpu_each():
    argv = engine_srun_argv(4, 2, "hpcdl/base:latest", "/home/a/.ipython/x-engine.json", python="/v/bin/python",
                            gpus_per_rank=1)
    assert argv[:7] == ["srun", "--ntasks=4", "--nodes=2", "--distribution=block", "--kill-on-bad-exit=0",
                        "--job-name=hpcdl-engines", "--gpus-per-task=1"]
    assert argv[7:11] == ["/v/bin/python", "-m", "jupyter_hpcdl.containers", "run"]
    assert argv[-7:] == ["hpcdl/base:latest", "--", "python3", "-m", "ipyparallel.engine",
                         "--file=/home/a/.ipython/x-engine.json", "--quiet"]
    assert "--env=SLURM_PROCID" in argv and "--env=CUDA_VISIBLE_DEVICES" in argv
    with pytest.raises(ValueError, match="one rank per node"):
        engine_srun_argv(1, 2, "hpcdl/base:latest", "/x.json")
    with pytest.raises(ValueError, match="image reference"):
        engine_srun_argv(2, 1, "Bad Image", "/x.json")
    mpi = engine_srun_argv(2, 1, "hpcdl/base:latest", "/x.json", python="/v/bin/python", mpi=True)
    assert mpi[:7] == ["srun", "--ntasks=2", "--nodes=1", "--distribution=block", "--kill-on-bad-exit=0",
                       "--job-name=hpcdl-engines", "--mpi=pmix"]


def test_owner_api_validates_and_says_what_is_wrong():
    owner = AllocationOwner(environ={})
    assert ask(owner, "GET", "/allocation", {})[1]["job_id"] is None
    assert ask(owner, "POST", "/engines", {"ranks": "4", "image": "x", "connection_file": "/x"}) == (
        400, {"message": "ranks must be a whole number from 1 to 4096"})
    assert ask(owner, "POST", "/engines", {"ranks": 2, "image": "hpcdl/base:latest", "connection_file": "/x"}) == (
        400, {"message": "not inside a batch job"})
    assert ask(owner, "PUT", "/nope", {})[0] == 404


def test_new_allocation_script_is_built_from_checked_values():
    from jupyter_hpcdl.newjob import NewAllocation, engines_job_template

    template = engines_job_template(NewAllocation(nodes=2, walltime="00:10", partition="gpu", account="proj-a",
                                                  gpus_per_rank=1), ranks=4)
    script = template.format(n=4, cluster_id="c1", profile_dir="/home/a/.ipython/profile_default",
                             program_and_args="python -m jupyter_hpcdl.containers run hpcdl/base:latest -- engine")
    assert script.splitlines() == [
        "#!/bin/sh", "#SBATCH --job-name=hpcdl-engines-c1", "#SBATCH --export=ALL", "#SBATCH --nodes=2",
        "#SBATCH --ntasks=4", "#SBATCH --distribution=block", "#SBATCH --time=00:10:00",
        "#SBATCH --output=/home/a/.ipython/profile_default/log/hpcdl-engines-%j.out", "#SBATCH --partition=gpu",
        "#SBATCH --account=proj-a", "#SBATCH --gpus-per-task=1",
        "srun --kill-on-bad-exit=0 python -m jupyter_hpcdl.containers run hpcdl/base:latest -- engine"
        " --profile-dir=/home/a/.ipython/profile_default --cluster-id=c1"]
    assert engines_job_template(NewAllocation(), 1, mpi=True).splitlines()[-1].startswith(
        "srun --kill-on-bad-exit=0 --mpi=pmix {program_and_args}")
    for bad, message in ((dict(partition="gpu\n#SBATCH --uid=0"), "partition"), (dict(account="a;b"), "account"),
                         (dict(nodes=3), "ranks must be a whole number from 3"), (dict(walltime="1h"), "walltime"),
                         (dict(gpus_per_rank=True), "gpus_per_rank"), (dict(partition="{n}"), "partition")):
        with pytest.raises(ValueError, match=message):
            engines_job_template(NewAllocation(**bad), ranks=2)


def test_engines_that_did_not_join_one_world_are_refused():
    from jupyter_hpcdl.training.session import check_one_world

    check_one_world([{"rank": 1, "size": 2}, {"rank": 0, "size": 2}], 2)
    for world in ([{"rank": 0, "size": 1}, {"rank": 0, "size": 1}], [{"rank": 0, "size": 2}, {"rank": 2, "size": 2}]):
        with pytest.raises(RuntimeError, match="did not join one Horovod world"):
            check_one_world(world, 2)


def test_owner_submits_and_cancels_only_what_it_should(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    owner = AllocationOwner(environ={"PATH": "/usr/bin:/bin"})
    status, reply = ask(owner, "POST", "/jobs", {"batch_file": "/etc/passwd"})
    assert status == 400 and "in your home directory" in reply["message"]
    status, reply = ask(owner, "POST", "/jobs", {"batch_file": str(tmp_path / "missing.sbatch")})
    assert status == 400 and "existing file" in reply["message"]
    status, reply = ask(owner, "DELETE", "/jobs/12345", {})
    assert status == 400 and "not submitted through this allocation's owner" in reply["message"]
    assert ask(owner, "DELETE", "/jobs/1;rm", {})[0] == 404
