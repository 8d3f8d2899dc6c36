"""A training session from a kernel of alice's JupyterLab (itself a 2-node Slurm job, the kernel inside her
container): the ranks start as engines in her container on node1 and node2 through the allocation's owner (srun on
the host side), one per GPU, join one Horovod world over Gloo, and train on real data; the loss falls and metrics
arrive from every rank."""
import inspect
import json

import pytest

import workloads
from hubclient import Hub

pytestmark = pytest.mark.testbed

KERNEL_CODE = "import json\nfrom jupyter_hpcdl.training import TrainingSession\n" + \
    inspect.getsource(workloads) + """
session = TrainingSession(ranks=4, where="allocation")
try:
    world = session.start()
    import tensorflow as tf
    session.setup(digits_model, digits_shard, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), lr=0.1)
    first = session.fit(epochs=2)
    more = session.fit(epochs=1)
    print(json.dumps({"world": [{k: w[k] for k in ("rank", "size", "node", "cuda_visible_devices")} for w in world],
                      "loss": first.loss + more.loss, "epochs": more.epochs_done,
                      "metric_ranks": sorted(set(int(r) for r in session.metrics["rank"]))}))
finally:
    session.close()
"""


def test_four_ranks_on_two_nodes_in_containers_train_from_the_notebook(bed):
    hub = Hub(bed)
    status, body = hub.api("POST", "/hub/api/users/alice/server", {"nodes": 2, "gpus_per_node": 2, "walltime": "00:20:00"})
    assert status in (201, 202), body
    try:
        hub.wait_ready("alice")
        out = hub.run_in_kernel("alice", KERNEL_CODE, timeout=400)
    finally:
        hub.stop("alice")
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert [(w["rank"], w["size"], w["node"]) for w in result["world"]] == [
        (0, 4, "node1"), (1, 4, "node1"), (2, 4, "node2"), (3, 4, "node2")]
    assert [w["cuda_visible_devices"] for w in result["world"]] == ["0", "1", "0", "1"], "each rank sees its own GPU"
    assert result["epochs"] == 3 and result["loss"][-1] < result["loss"][0]
    assert result["metric_ranks"] == [0, 1, 2, 3]
