"""Rank slots computed from the batch system's layout agree with Horovod's own plan."""
import pytest

from jupyter_hpcdl.world import Slot, expand_tasks_per_node, gloo_env, plan_slots, slurm_hosts, slurm_slot

hosts_mod = pytest.importorskip("horovod.runner.common.util.hosts")


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
