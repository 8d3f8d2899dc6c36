"""The test bed as a user sees it: Slurm jobs across two GPU nodes whose tasks run in udocker containers,
Horovod between those containers, the registry, the hub, and users kept apart."""
import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.testbed


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_nodes_offer_four_gpus_each_of_one_type(bed):
    out = subprocess.run(["sinfo", "-h", "-N", f"--partition={bed['partition']}", "-o", "%N %G %T"], capture_output=True,
                         text=True, check=True).stdout
    rows = sorted(line.split() for line in out.splitlines())
    assert [r[0] for r in rows] == bed["nodes"]
    assert all(r[1].startswith(f"gpu:sim:{bed['gpus_per_node']}") and r[2] in ("idle", "mixed") for r in rows), rows


def test_batch_job_tasks_run_in_the_container_on_both_nodes(bed, alice, alice_dir):
    script = alice.write(alice_dir / "job.sh", f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:2 --time=5 --output={alice_dir}/job.out
srun hpcdl-containers run -e CUDA_VISIBLE_DEVICES -e SLURMD_NODENAME {bed['image']} -- python3 -m jupyter_hpcdl.diagnose
""")
    alice.run("sbatch", "--wait", str(script), check=True)
    reports = sorted(_json_lines((alice_dir / "job.out").read_text()), key=lambda r: r["node"])
    assert [r["node"] for r in reports] == ["node1", "node2"]
    for r in reports:
        assert r["image"] == bed["identity"], "the task did not run inside the test bed's image"
        assert r["uid"] == alice.uid
        assert len(r["cuda_visible_devices"].split(",")) == 2, "Slurm's GPU binding did not reach the container"


def test_horovod_allreduce_between_containers_on_two_nodes(bed, alice):
    r = alice.run("salloc", "--nodes=2", "--ntasks-per-node=1", "--time=5", "hpcdl-launch", f"--image={bed['image']}",
                  "-e", "TF_CPP_MIN_LOG_LEVEL", "--", "python3", "-m", "jupyter_hpcdl.diagnose", "--allreduce", timeout=240)
    ranks = sorted(_json_lines(r.stdout), key=lambda x: x["rank"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(x["rank"], x["size"], x["node"]) for x in ranks] == [(0, 2, "node1"), (1, 2, "node2")]
    assert all(x["allreduce_sum"] == 3.0 and x["image"] == bed["identity"] for x in ranks)


def test_launch_outside_an_allocation_says_what_to_do(alice):
    r = alice.run("hpcdl-launch", "--image=hpcdl/base:latest", "--", "true")
    assert r.returncode == 2 and "not inside a batch job" in r.stderr


def test_pull_from_the_loopback_registry(bed, alice, alice_dir):
    repo = alice_dir / "udocker"
    site = alice.write(alice_dir / "site.json", json.dumps({"ContainerSite": {
        **json.loads(Path(bed["site_config"]).read_text())["ContainerSite"], "udocker_dir": str(repo)}}))
    alice.run("hpcdl-containers", f"--site={site}", "pull", bed["os_image"], check=True)
    assert alice.run("hpcdl-containers", f"--site={site}", "images", check=True).stdout.split() == [bed["os_image"]]
    alice.run("hpcdl-containers", f"--site={site}", "verify", bed["os_image"], check=True)
    r = alice.run("hpcdl-containers", f"--site={site}", "run", bed["os_image"], "--", "sh", "-c",
                  ". /etc/os-release; echo $VERSION_CODENAME; id -un", check=True)
    assert r.stdout.split() == ["bookworm", "alice"]


def test_bob_cannot_read_or_run_alices_containers(bed, alice, bob):
    mine = alice.run("hpcdl-containers", "ensure", bed["image"], check=True).stdout.strip()
    assert mine.startswith("hpcdl-")
    r = bob.run("ls", f"{alice.home}/.udocker/containers")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    tools = Path(bed["prefix"]) / "udocker-tools"
    r = bob.run(f"{bed['venv']}/bin/udocker", "-q", "run", "--nobanner", mine, "id",
                UDOCKER_DIR=f"{alice.home}/.udocker", UDOCKER_BIN=f"{tools}/bin", UDOCKER_LIB=f"{tools}/lib",
                UDOCKER_TARBALL="")
    assert r.returncode != 0 and "uid=" not in r.stdout


def test_hub_is_up_behind_the_proxy(bed):
    with urllib.request.urlopen(bed["hub_url"] + "/hub/api/", timeout=10) as resp:
        version = json.load(resp)["version"]
    assert version.split(".")[0] in ("5", "6")
    token = (Path(bed["hub_dir"]) / "service_token").read_text().strip()
    req = urllib.request.Request(bed["hub_url"] + "/hub/api/users", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        names = {u["name"] for u in json.load(resp)}
    assert set(bed["users"]) <= names


TRAIN_SCRIPT = '''
import hashlib, json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
import horovod.tensorflow.keras as hvd
from sklearn.datasets import load_digits
hvd.init()
tf.keras.utils.set_random_seed(1234)
x, y = load_digits(return_X_y=True)
x, y = (x[hvd.rank()::hvd.size()] / 16.0).astype("float32"), y[hvd.rank()::hvd.size()]
model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                             tf.keras.layers.Dense(10)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), experimental_run_tf_function=False)
h = model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
print(json.dumps({"rank": hvd.rank(), "node": os.environ.get("SLURMD_NODENAME"), "loss": h.history["loss"],
                  "weights": digest}), flush=True)
'''


def test_batch_mode_trains_a_script_across_nodes_in_containers(bed, alice, alice_dir):
    """The batch workflow: the same kind of training script, submitted with sbatch, ranks in containers over Gloo."""
    script = alice.write(alice_dir / "train.py", TRAIN_SCRIPT)
    job = alice.write(alice_dir / "train.sh", f"""#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:1 --time=10 --output={alice_dir}/train.out
hpcdl-launch --image={bed['image']} -e TF_CPP_MIN_LOG_LEVEL -- python3 {script}
""")
    alice.run("sbatch", "--wait", str(job), check=True, timeout=400)
    ranks = sorted(_json_lines((alice_dir / "train.out").read_text()), key=lambda r: r["rank"])
    assert [(r["rank"], r["node"]) for r in ranks] == [(0, "node1"), (1, "node2")]
    assert ranks[0]["weights"] == ranks[1]["weights"], "gradients were not averaged"
    assert ranks[0]["loss"][-1] < ranks[0]["loss"][0]
