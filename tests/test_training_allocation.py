"""A training session from a kernel of alice's JupyterLab (itself a 2-node Slurm job, the kernel inside her
container): the ranks start as engines in her container on node1 and node2 through the allocation's owner (srun on
the host side), one per GPU, join one Horovod world over Gloo, and train on real data; the loss falls and metrics
arrive from every rank; a killed rank is reported within seconds and a new world continues from the checkpoint."""
import inspect
import os
import json
import shutil
import re
import subprocess
import time
import uuid

import psutil
import pytest

import workloads
from hubclient import Hub

pytestmark = pytest.mark.testbed

KERNEL_CODE = "import json\nfrom jupyter_hpcdl.training import TrainingSession\n" + \
    inspect.getsource(workloads) + """
# ranks whose image is missing: named at once, each with its node and its log, instead of a start timeout
import time
from jupyter_hpcdl.training import EnginesFailed
t0 = time.monotonic()
try:
    TrainingSession(where="allocation", image="hpcdl/missing:latest").start()
    missing = "started"
except (EnginesFailed, TimeoutError) as e:
    missing = f"{type(e).__name__}: {e}"
missing_after = time.monotonic() - t0
session = TrainingSession(where="allocation")  # one rank per slot of the job: 4
try:
    world = session.start()
    import tensorflow as tf
    session.setup(digits_model, digits_shard, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), lr=0.1)
    first = session.fit(epochs=2)
    more = session.fit(epochs=1)
    # a rank dies (its engine killed on node2): reported within seconds, then a new world goes on from a checkpoint
    import os, signal, threading, time
    from jupyter_hpcdl.training import RankError
    checkpoint = session.checkpoint(os.path.expanduser("~/hpcdl-test-before-crash"))
    victim = next(w for w in world if w["rank"] == 3)["pid"]
    threading.Timer(3.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        session.fit(epochs=1000)
        crash = "no error"
    except RankError as e:
        crash = str(e)
    reported_after = time.monotonic() - t0 - 3.0
    restored = session.recover(checkpoint)
    after = session.fit(epochs=1)
    import shutil; shutil.rmtree(checkpoint)
    print(json.dumps({"world": [{k: w[k] for k in ("rank", "size", "node", "cuda_visible_devices")} for w in world],
                      "loss": first.loss + more.loss, "epochs": more.epochs_done,
                      "metric_ranks": sorted(set(int(r) for r in session.metrics["rank"])),
                      "crash": crash, "reported_after": reported_after, "missing": missing,
                      "missing_after": missing_after,
                      "restored": sorted({r["epochs_done"] for r in restored}), "after": after.epochs_done,
                      "new_world": sorted((w["rank"], w["node"]) for w in session.world)}))
finally:
    session.close()
"""


def _result_from_alices_kernel(bed, options: dict, code: str) -> dict:
    """Start alice's server with ``options`` (a Slurm job), run ``code`` in its container kernel, stop the server;
    return the last JSON line the code printed."""
    hub = Hub(bed)
    status, body = hub.api("POST", "/hub/api/users/alice/server", options)
    assert status in (201, 202), body
    try:
        hub.wait_ready("alice")
        out = hub.run_in_kernel("alice", code, timeout=400)
    finally:
        hub.stop("alice")
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


@pytest.mark.timing
def test_four_ranks_on_two_nodes_in_containers_train_from_the_notebook_and_survive_a_killed_rank(bed):
    result = _result_from_alices_kernel(bed, {"nodes": 2, "gpus_per_node": 2, "walltime": "00:20:00"}, KERNEL_CODE)
    assert [(w["rank"], w["size"], w["node"]) for w in result["world"]] == [
        (0, 4, "node1"), (1, 4, "node1"), (2, 4, "node2"), (3, 4, "node2")]
    assert [w["cuda_visible_devices"] for w in result["world"]] == ["0", "1", "0", "1"], "each rank sees its own GPU"
    assert result["epochs"] == 3 and result["loss"][-1] < result["loss"][0]
    assert result["metric_ranks"] == [0, 1, 2, 3]
    # the killed rank is named; its peers may go down with it (Horovod aborts a rank whose Gloo peer vanished)
    assert re.search(r"rank\(s\) ([0-2], )*3 died during fit", result["crash"]), result["crash"]
    assert result["reported_after"] < 15, "the death was not reported within seconds"
    assert result["restored"] == [3] and result["after"] == 4, "the new world continued from the checkpoint"
    # the engines of a missing image were named long before the start timeout (120 s)
    assert re.match(r"EnginesFailed: the engine of rank \d on node\d: .*Its log: /", result["missing"], re.S), \
        result["missing"]
    assert result["missing_after"] < 60, result
    assert result["new_world"] == [[0, "node1"], [1, "node1"], [2, "node2"], [3, "node2"]]


NEW_JOB_CODE = """
import json, subprocess
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard

session = TrainingSession(ranks=2, where="new", start_timeout=240,
                          new_allocation=NewAllocation(nodes=2, walltime="00:10:00", partition="gpu", gpus_per_rank=1))
try:
    world = session.start()
    job = session.job_id
    running = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %D"], capture_output=True, text=True).stdout.split()
    session.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    fit = session.fit(epochs=2)
finally:
    session.close()
after = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.split()
print(json.dumps({"job": job, "running": running, "after": after, "loss": fit.loss,
                  "world": sorted((w["rank"], w["node"], w["cuda_visible_devices"]) for w in world)}))
"""


def test_a_new_allocation_when_asked_trains_and_is_cancelled_at_close(alice):
    """From a host-side Python as alice (where sbatch is): the ranks get a batch job of their own, in containers."""
    r = alice.run(alice.bed["venv"] + "/bin/python", "-c", NEW_JOB_CODE, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["running"] == ["RUNNING", "2"], result
    assert result["world"] == [[0, "node1", "0"], [1, "node2", "0"]]
    assert result["loss"][-1] < result["loss"][0]
    assert result["after"] in ([], ["COMPLETING"], ["CANCELLED"]), "the ranks' job outlived the session"


MPI_JOB_CODE = """
import json
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard

session = TrainingSession(ranks=2, where="new", world="mpi", start_timeout=240,
                          new_allocation=NewAllocation(nodes=1, walltime="00:10:00", partition="gpu", gpus_per_rank=1))
try:
    world = session.start()
    session.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    fit = session.fit(epochs=2)
finally:
    session.close()
print(json.dumps({"loss": fit.loss, "world": sorted((w["rank"], w["size"], w["cuda_visible_devices"]) for w in world)}))
"""


def test_an_mpi_world_from_srun_pmix_in_containers(alice):
    """world='mpi' in a batch job: srun --mpi=pmix starts the engines in containers and Horovod joins over MPI.
    (One node: the test bed's two slurmd share one /tmp, where PMIx keeps per-step directories.)"""
    r = alice.run(alice.bed["venv"] + "/bin/python", "-c", MPI_JOB_CODE, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["world"] == [[0, 2, "0"], [1, 2, "1"]], "one MPI world of two ranks, each its own GPU"
    assert result["loss"][-1] < result["loss"][0]


REFUSED_CODE = """
import subprocess
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession

session = TrainingSession(ranks=2, where="new", new_allocation=NewAllocation(partition="nosuch"))
try:
    session.start()
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:300])
"""


def _processes_marked(mark: str) -> list[str]:
    """The command lines of the processes whose environment holds ``HPCDL_TEST_MARK=mark`` (what one run started,
    however it was started, and not what another test runs as the same user meanwhile)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.environ().get("HPCDL_TEST_MARK") == mark:
                found.append(" ".join(p.info["cmdline"]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_a_refused_new_allocation_says_why_and_leaves_nothing(alice):
    mark = uuid.uuid4().hex
    r = alice.run(alice.bed["venv"] + "/bin/python", "-c", REFUSED_CODE, timeout=300, HPCDL_TEST_MARK=mark)
    assert "REFUSED" in r.stdout, r.stdout + r.stderr
    assert "invalid partition" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    jobs = subprocess.run(["squeue", "-h", "-u", "alice", "-t", "PENDING,RUNNING", "-o", "%j"],  # not an ending one
                          capture_output=True, text=True, check=True)
    assert not [j for j in jobs.stdout.split() if j.startswith("hpcdl-engines")]
    deadline = time.monotonic() + 15  # what was told to end may take a moment
    while (left := _processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], "the refused start left these processes"


KERNEL_NEW_JOB_CODE = """
import json, shutil
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard

assert shutil.which("sbatch") is None, "the kernel's container has no scheduler client"
session = TrainingSession(ranks=2, where="new", start_timeout=240,
                          new_allocation=NewAllocation(nodes=2, walltime="00:10:00", partition="gpu", gpus_per_rank=1))
try:
    world = session.start()
    job = session.job_id
    session.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    fit = session.fit(epochs=2)
finally:
    session.close()
print(json.dumps({"job": job, "loss": fit.loss, "world": sorted((w["rank"], w["node"]) for w in world)}))
"""


def test_a_kernel_in_its_container_asks_for_a_new_allocation_through_the_owner(bed):
    """The notebook's kernel has no sbatch: the allocation's owner submits the ranks' job and cancels it."""
    result = _result_from_alices_kernel(bed, {"nodes": 1, "gpus_per_node": 1, "walltime": "00:20:00"},
                                        KERNEL_NEW_JOB_CODE)
    assert result["world"] == [[0, "node1"], [1, "node2"]]
    assert result["loss"][-1] < result["loss"][0]
    state = subprocess.run(["squeue", "-h", "-j", result["job"], "-t", "PENDING,RUNNING", "-o", "%T"],
                           capture_output=True, text=True).stdout.strip()
    assert state == "", f"the ranks' job {result['job']} outlived the session ({state})"


UNEVEN_CODE = """
import json, math
import numpy as np
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model

def uneven(rank, size):  # np.array_split of 1796 digits: shards that differ by one sample
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return np.array_split((x[:1796] / 16.0).astype("float32"), size)[rank], np.array_split(y[:1796], size)[rank]

BATCH = {3: 46, 7: 32, 8: 32}  # 599/598 samples -> 14/13 batches; 257/256 -> 9/8; 225/224 -> 8/7
session = TrainingSession(ranks=3, where="new", start_timeout=300,
                          new_allocation=NewAllocation(nodes=2, walltime="00:15:00", partition="gpu"))
rows = []
try:
    session.start()
    for n in (3, 7, 8):
        if n != 3:
            session.rescale(n)
        built = session.setup(digits_model, uneven, loss=digits_loss, lr=0.1, batch_size=BATCH[n])
        fit = session.fit(epochs=2)  # raises WorldDiverged unless every rank ends with the same weights
        rows.append({"ranks": n, "nodes": sorted({w["node"] for w in session.world}),
                     "samples": sorted(b["samples"] for b in built), "steps": sorted({b["steps_per_epoch"] for b in built}),
                     "own_batches": sorted({math.ceil(b["samples"] / BATCH[n]) for b in built}),
                     "epochs": fit.epochs_done})
finally:
    session.close()
print(json.dumps(rows))
"""


@pytest.mark.timeout(1200)
def test_uneven_shards_at_3_7_and_8_ranks_across_two_nodes_in_containers(alice):
    """Shards that need different numbers of batches (8 ranks with batch 32: 8 and 7), which deadlocked."""
    r = alice.run(alice.bed["venv"] + "/bin/python", "-c", UNEVEN_CODE, timeout=1100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["ranks"] for row in rows] == [3, 7, 8]
    for row in rows:
        assert row["nodes"] == ["node1", "node2"], row
        assert max(row["samples"]) - min(row["samples"]) == 1 and sum(row["samples"]) == 1796, row
        assert len(row["own_batches"]) == 2, f"the shards should need different numbers of batches: {row}"
        assert row["steps"] == [max(row["own_batches"])], row  # all ranks run the most any rank needs
        assert row["epochs"] == 2, row


WALLTIME_CODE = """
import json, os, subprocess
from jupyter_hpcdl.job.newjob import NewAllocation
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard

session = TrainingSession(ranks=2, where="new", start_timeout=240, walltime_margin=150,
                          new_allocation=NewAllocation(nodes=2, walltime="00:04:00", partition="gpu"))
out = {}
try:
    # 1. the clock: a 4-minute job, a fit that would outlast it by far
    session.start()
    out["first_job"] = session.job_id
    out["left_at_start"] = session.time_left()
    session.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    fit = session.fit(epochs=100000)
    out["left_at_stop"] = session.time_left()
    out.update(stopped=fit.stopped, epochs=fit.epochs_done, checkpoint=session.walltime_checkpoint,
               checkpoint_exists=os.path.exists(session.walltime_checkpoint or "/nonexistent"))
    # 2. on in a new allocation from that checkpoint
    restored = session.continue_in_new_allocation(NewAllocation(nodes=2, walltime="00:10:00", partition="gpu"))
    out["second_job"] = session.job_id
    out["restored"] = sorted({r["epochs_done"] for r in restored})
    out["after"] = session.fit(epochs=1).epochs_done
finally:
    session.close()
jobs = [j for j in (out.get("first_job"), out.get("second_job")) if j]
out["left_over"] = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(jobs)], capture_output=True,
                                  text=True).stdout.split()
print(json.dumps(out))
"""


@pytest.mark.timing
@pytest.mark.timeout(900)
def test_training_stops_and_checkpoints_before_the_walltime_then_continues_in_a_new_allocation(alice):
    r = alice.run(alice.bed["venv"] + "/bin/python", "-c", WALLTIME_CODE, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the scheduler's walltime left (4 minutes less the allocation's start and the engines'), counting down
    assert 0 < out["left_at_stop"] < out["left_at_start"] <= 240, out
    assert out["stopped"].startswith("Stopped before the walltime ends (the scheduler says"), out
    assert out["checkpoint"] in out["stopped"] and out["checkpoint_exists"]
    assert "continue_in_new_allocation" in out["stopped"] and "Stopped before the walltime ends" in r.stderr
    assert out["left_at_stop"] is not None and out["left_at_stop"] > 0, "the job ended before the checkpoint"
    assert out["epochs"] > 1 and out["restored"] == [out["epochs"]], "the new allocation did not continue"
    assert out["second_job"] != out["first_job"]
    assert out["after"] == out["epochs"] + 1
    assert all(s in ("COMPLETING", "CANCELLED") for s in out["left_over"][1::2]), out["left_over"]
    shutil.rmtree(out["checkpoint"])


KILLED_KERNEL_CODE = """
import json, os
from jupyter_hpcdl.training import TrainingSession
session = TrainingSession(ranks=2, where="allocation")
world = session.start()
print(json.dumps({"pid": os.getpid(), "engines": [w["pid"] for w in world]}))
"""


def _alices_ipyparallel() -> list[str]:
    found = []
    for p in psutil.process_iter(["username", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["username"] == "alice" and "ipyparallel" in cmd:
            found.append(f"{p.pid} {cmd[:120]}")
    return found


@pytest.mark.timeout(600)
def test_a_killed_kernel_in_the_job_leaves_no_engine_controller_or_step(bed):
    import asyncio
    import os
    import signal
    import time

    hub = Hub(bed)
    status, body = hub.api("POST", "/hub/api/users/alice/server", {"nodes": 2, "gpus_per_node": 1, "walltime": "00:20:00"})
    assert status in (201, 202), body
    kernel = None
    try:
        hub.wait_ready("alice")
        job = subprocess.run(["squeue", "-h", "-u", "alice", "-o", "%i"], capture_output=True, text=True).stdout.split()
        assert len(job) == 1, job
        status, kernel = hub.api("POST", "/user/alice/api/kernels", {"name": "hpcdl"}, timeout=120)
        assert status == 201, kernel
        out = asyncio.run(hub._execute("alice", f"/user/alice/api/kernels/{kernel['id']}", KILLED_KERNEL_CODE, 300))
        info = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        steps = lambda: [s for s in subprocess.run(["squeue", "-h", "-s", "-j", job[0], "-o", "%i"],  # noqa: E731
                                                   capture_output=True, text=True).stdout.split()
                         if not s.endswith((".batch", ".extern"))]
        assert steps() and _alices_ipyparallel(), "the session's engines are not running"
        os.kill(info["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (steps() or _alices_ipyparallel()):
            time.sleep(1)
        assert not steps(), f"engine steps left after the kernel was killed: {steps()}"
        assert not _alices_ipyparallel(), _alices_ipyparallel()
    finally:
        if kernel and isinstance(kernel, dict) and "id" in kernel:
            hub.api("DELETE", f"/user/alice/api/kernels/{kernel['id']}")
        hub.stop("alice")


USER_WORK_CODE = '''
import json, os, shutil
import numpy as np
from sklearn.datasets import load_digits
from jupyter_hpcdl.training import TrainingSession

home = os.path.expanduser("~")
data_dir, ckpt_dir = os.path.join(home, "hpcdl-test-data"), os.path.join(home, "hpcdl-test-adam")
script = os.path.join(home, "hpcdl-test-horovod-script.py")
os.makedirs(data_dir, exist_ok=True)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
np.savez(os.path.join(data_dir, "train.npz"), x=x[:1500], y=y[:1500])
np.savez(os.path.join(data_dir, "val.npz"), x=x[1500:], y=y[1500:])
with open(script, "w") as f:
    f.write(SCRIPT)

def model():
    import tensorflow as tf
    m = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                             tf.keras.layers.Dense(10)])
    m.compile(optimizer=tf.keras.optimizers.Adam(tf.keras.optimizers.schedules.ExponentialDecay(0.01, 50, 0.9)),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m

def pipeline(rank, size):
    import tensorflow as tf
    with np.load(os.path.join(data_dir, "train.npz")) as f:
        xs, ys = f["x"][rank::size], f["y"][rank::size]
    return tf.data.Dataset.from_tensor_slices((xs, ys)).shuffle(len(xs), seed=rank).batch(32)

def calls():
    import tensorflow as tf
    class Count(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            import builtins
            builtins.__dict__["hpcdl_epochs"] = builtins.__dict__.get("hpcdl_epochs", 0) + 1
    return [Count()]

def epochs_seen():
    import builtins
    return builtins.__dict__.get("hpcdl_epochs", 0)

def iterations():
    from jupyter_hpcdl.backends.horovod.rank import _STATE
    return int(_STATE["model"].optimizer.iterations)

session = TrainingSession(ranks=4, where="allocation")
try:
    world = session.start()
    session.setup(model, pipeline, validation_data=os.path.join(data_dir, "val.npz"),
                  callbacks=lambda rank, size: calls(), seed=3)
    first = session.fit(epochs=2)
    seen = session.run(epochs_seen)
    session.checkpoint(ckpt_dir)
    before = session.run(iterations)
    session.rescale(2, batch_size=64)
    moved = session.run(iterations)
    after = session.fit(epochs=1)
    rows_before = len(session.metrics)
    ran = session.run_script(script, ["--epochs", "1"], echo=False)
    print(json.dumps({"world": sorted((w["rank"], w["node"]) for w in world),
                      "history": first.history, "seen": seen, "before": before, "moved": moved,
                      "after": after.history[0]["loss"], "epochs": after.epochs_done,
                      "script_exit": ran.exit_codes, "script_out": ran.stdout[0][-300:],
                      "script_metric_ranks": sorted(set(int(r) for r in session.metrics["rank"].iloc[rows_before:]))}))
finally:
    session.close()
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    os.unlink(script)
'''


def test_the_users_model_data_and_script_train_across_two_nodes_in_containers(bed):
    """Alice's own work in her job (2 nodes, containers): her Adam model and tf.data pipeline over files in her
    home, validation and a callback, a checkpoint carried into 2 ranks with Adam's step count, then an existing
    Horovod script run unchanged on the same ranks."""
    from pathlib import Path
    script = (Path(__file__).resolve().parent.parent / "examples" / "horovod_keras_digits.py").read_text()
    code = f"SCRIPT = {script!r}\n" + USER_WORK_CODE
    result = _result_from_alices_kernel(bed, {"nodes": 2, "gpus_per_node": 2, "walltime": "00:20:00"}, code)
    assert result["world"] == [[0, "node1"], [1, "node1"], [2, "node2"], [3, "node2"]]
    history = result["history"]
    assert history["0"]["val_loss"] == history["3"]["val_loss"], "validation metrics differ between ranks"
    assert history["0"]["loss"][-1] < history["0"]["loss"][0]
    assert result["seen"] == {"0": 2, "1": 2, "2": 2, "3": 2}, "the user's callback was not called on every rank"
    assert set(result["before"].values()) == {2 * 12} and set(result["moved"].values()) == {2 * 12}, \
        "Adam's step count did not come along into the 2-rank world"
    assert result["epochs"] == 3 and result["after"][0] < history["0"]["loss"][0]
    assert result["script_exit"] == {"0": 0, "1": 0} and "final loss" in result["script_out"]
    assert result["script_metric_ranks"] == [0, 1], "the script's metrics did not stream from its ranks"


BATCH_FAULTS_CODE = """
import json
from jupyter_hpcdl.training.batchrun import BatchRun
out = {}
# more GPUs than the nodes have free while this server holds one on each: it waits in the queue, and says why
queued = BatchRun.submit(command=["python3", "-c", "pass"], ranks=8, nodes=2, gpus_per_rank=1, walltime=5,
                         name="queued")
try:
    queued.wait(timeout=15, every=2)
except TimeoutError as e:
    out["gave_up"] = str(e)
queued.cancel()
out["cancelled"] = queued.wait(timeout=60, every=2, show=False).state
out["queued_id"] = queued.job_id
out["queued_result"] = queued.result().exit_code
# a command that fails: its exit code comes back
failing = BatchRun.submit(command=["python3", "-c", "import sys; print('about to fail', flush=True); sys.exit(3)"], ranks=2,
                          nodes=2, walltime=5, name="fails")
ended = failing.wait(timeout=240, every=2, show=False)
result = failing.result()
out.update(failed_state=ended.state, failed_code=result.exit_code, failed_why=result.why,
           failed_said=result.output)
print(json.dumps(out))
"""


def test_a_batch_run_in_the_queue_says_why_is_cancelled_and_a_failing_one_gives_its_exit_code(bed):
    out = _result_from_alices_kernel(bed, {"nodes": 2, "gpus_per_node": 1, "walltime": "00:20:00"},
                                     BATCH_FAULTS_CODE)
    assert re.search(r"pending, PENDING \((Resources|Priority)\).*still not ended after 15 s", out["gave_up"]), out
    assert out["cancelled"] in ("CANCELLED", ""), out  # "" once Slurm has forgotten it
    assert out["queued_result"] is None  # it never ran: no exit code is made up
    left = subprocess.run(["squeue", "-h", "-j", out["queued_id"], "-o", "%T"], capture_output=True, text=True,
                          timeout=30)
    assert left.stdout.strip() in ("", "CANCELLED"), left
    # srun's code: the highest of the ranks' (3, or 137 or 143 for a rank ended because the other failed first)
    assert out["failed_code"] in (3, 137, 143) and out["failed_state"] == "FAILED", out
    assert "about to fail" in out["failed_said"] and "Exited with exit code 3" in out["failed_said"], out


TORCH_CODE = """
import json, os, shutil
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.batchrun import BatchRun
from jupyter_hpcdl.training.examples import digits_shard, digits_torch_model

where = os.path.expanduser("~/hpcdl-torch-test")
os.makedirs(where, exist_ok=True)
with open(os.path.join(where, "torchrun_digits.py"), "w") as f:
    f.write(SCRIPT)
session = TrainingSession(where="allocation", backend="torch")  # one rank per slot of the job: 4
try:
    world = session.start()
    session.setup(digits_torch_model, digits_shard, loss="cross_entropy", metrics=["accuracy"],
                  validation_data=digits_shard)
    first = session.fit(epochs=2)
    saved = session.checkpoint(os.path.join(where, "ckpt"))
    steps = json.load(open(os.path.join(saved, "hpcdl.json")))["optimizer_steps"]
    weights = session.weights_digest()
    moved = session.rescale(2)
    after = session.fit(epochs=1)
    before = len(session.metrics)
    ran = session.run_script(os.path.join(where, "torchrun_digits.py"), ["--epochs", "2"], echo=False)
    script_rows = session.metrics.iloc[before:]
    out = {"world": [[w["rank"], w["node"], w["cuda_visible_devices"]] for w in world],
           "history": {str(k): v for k, v in first.history.items()},
           "metric_ranks": sorted({int(r) for r in session.metrics["rank"]}),
           "steps": steps, "weights": weights,
           "moved": [[r["weights"], r["iterations"]] for r in moved], "after": after.epochs_done,
           "new_world": sorted([w["rank"], w["node"]] for w in session.world),
           "script_exit": {str(k): v for k, v in ran.exit_codes.items()}, "script_out": ran.stdout[0],
           "script_ranks": sorted({int(r) for r in script_rows["rank"]}),
           "script_loss": bool(script_rows["loss"].notna().any())}
    session.close()
    # the same script as a batch run of its own: a new job over both nodes, ranks in this image's containers
    batch = BatchRun.submit(os.path.join(where, "torchrun_digits.py"), ["--epochs", "1"], ranks=2, nodes=2,
                            walltime=5, name="torch", backend="torch")
    state = batch.wait(timeout=240, every=2, show=False).state
    done = batch.result()
    out["batch"] = [batch.job_id, state, done.exit_code, done.rank_output(0)]
    print(json.dumps(out))
finally:
    session.close()
    shutil.rmtree(where, ignore_errors=True)
"""


def test_pytorch_ranks_on_two_nodes_in_containers_train_rescale_and_run_a_torchrun_script(bed):
    """Alice's PyTorch work in her job (2 nodes, the PyTorch image): her module with Adam and a step schedule and a
    validation set on 4 ranks, a checkpoint carried into 2 ranks with Adam's state, then an unchanged torchrun
    script on the same ranks with live step metrics, and as a batch run of its own over both nodes."""
    from pathlib import Path
    script = (Path(__file__).resolve().parent.parent / "examples" / "torchrun_digits.py").read_text()
    result = _result_from_alices_kernel(
        bed, {"nodes": 2, "gpus_per_node": 2, "walltime": "00:20:00", "image": "torch"},
        f"SCRIPT = {script!r}\n" + TORCH_CODE)
    assert result["world"] == [[0, "node1", "0"], [1, "node1", "1"], [2, "node2", "0"], [3, "node2", "1"]]
    history = result["history"]
    assert history["0"] == history["3"], "epoch metrics differ between ranks"
    assert history["0"]["loss"][-1] < history["0"]["loss"][0] and "val_accuracy" in history["0"]
    assert result["metric_ranks"] == [0, 1, 2, 3]
    assert result["moved"] == [[result["weights"], result["steps"]]] * 2, "Adam's state did not come along"
    assert [r for r, _ in result["new_world"]] == [0, 1] and result["after"] == 3
    assert result["script_exit"] == {"0": 0, "1": 0} and "final loss" in result["script_out"]
    assert result["script_ranks"] == [0, 1] and result["script_loss"], "the script's steps did not stream"
    job, state, code, said = result["batch"]
    assert state == "COMPLETED" and code == 0 and "final loss" in said, result["batch"]
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    assert re.search(r"\bNodeList=node\[1-2\]\s", shown), f"the batch run's job did not run on both nodes: {shown}"
