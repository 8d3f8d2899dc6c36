"""A training session in local mode (no batch system): 2 Horovod ranks as ipyparallel engines train a Keras model on
scikit-learn's digits, interactively — epochs and more epochs, live per-rank metrics, identical weights, stop
mid-epoch, learning rate changes, atomic checkpoints and resume."""
import os
import sys

import cloudpickle
import pytest

from jupyter_hpcdl.training import RankError, TrainingSession
from jupyter_hpcdl.atomic import atomic_write
from jupyter_hpcdl.training.metrics import MetricsTable, straggler_ranks
from jupyter_hpcdl.backends.horovod.hvd import keras_problem

import workloads
from workloads import digits_model, digits_shard

pytestmark = pytest.mark.ranks  # starts real worlds of local ranks (testbed/quick leaves them out)

pytest.importorskip("horovod.tensorflow.keras")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as functions defined in a notebook travel
cloudpickle.register_pickle_by_value(workloads)


def logits_loss():
    import tensorflow as tf
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def session():
    s = TrainingSession(ranks=2)
    try:
        world = s.start()
        assert sorted((w["rank"], w["size"]) for w in world) == [(0, 2), (1, 2)]
        s.setup(digits_model, digits_shard, loss=logits_loss(), lr=0.1, batch_size=32)
        yield s
    finally:
        s.close()


def test_loss_falls_and_ranks_agree_epoch_after_epoch(session):
    first = session.fit(epochs=2)
    again = session.fit(epochs=2)
    assert first.epochs_done == 2 and again.epochs_done == 4
    assert set(first.history) == {0, 1}
    losses = first.loss + again.loss
    assert losses[-1] < losses[0] * 0.7, losses
    assert first.weights != again.weights  # training moved them, and fit checked all ranks agree on each


def test_metrics_stream_from_both_ranks(session):
    seen = []
    session.fit(epochs=1, on_metrics=lambda table: seen.append(len(table.frame())))
    frame = session.metrics
    assert set(frame["rank"]) == {0, 1}
    assert frame["samples_per_s"].dropna().gt(0).all() and frame["memory_mb"].gt(0).all()
    assert seen and seen == sorted(seen), "metrics did not arrive while training ran"


def test_learning_rate_changes_without_restarting(session):
    assert session.set_lr(0.01) == pytest.approx([0.01, 0.01])
    pids = {w["pid"] for w in session.world}
    session.fit(epochs=1)
    assert {w["pid"] for w in session.world} == pids


def test_stop_mid_epoch_keeps_the_world_in_step(session):
    import threading
    timer = threading.Timer(1.5, session.stop_training)
    timer.start()
    result = session.fit(epochs=50)
    timer.join()
    assert result.stopped and "stopped in epoch" in result.stopped
    assert result.epochs_done < session.fit(epochs=1).epochs_done  # the world still trains afterwards


def test_checkpoint_is_atomic_and_resume_restores(session, tmp_path):
    path = session.checkpoint(str(tmp_path / "digits"))
    before = session.resume(path)
    digest = before[0]["weights"]
    session.fit(epochs=1)
    after = session.resume(path)
    assert [r["weights"] for r in after] == [digest, digest]
    assert [p.name for p in tmp_path.iterdir()] == ["digits"]
    written = sorted(p.name for p in (tmp_path / "digits").iterdir())
    assert written == ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "hpcdl.json"], written


def test_an_error_on_the_ranks_names_them(session):
    with pytest.raises(RankError, match=r"rank [01]: .*FileNotFoundError"):
        session.resume("/nonexistent/ckpt")


def test_atomic_write_leaves_the_old_checkpoint_when_writing_fails(tmp_path):
    path = tmp_path / "c.npz"
    path.write_bytes(b"old")

    def broken(tmp):
        open(tmp, "wb").write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(str(path), broken)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_keras3_without_tf_keras_is_refused_with_the_fix():
    assert "TF_USE_LEGACY_KERAS=1" in keras_problem("2.18.1", None)
    assert keras_problem("2.18.1", "1") is None and keras_problem("2.15.1", None) is None


def test_straggler_is_a_rank_clearly_slower_than_the_median():
    assert straggler_ranks({0: 0.010, 1: 0.011, 2: 0.030, 3: 0.010}) == [2]
    assert straggler_ranks({0: 0.010}) == []
    table = MetricsTable()
    assert table.add([{"rank": 0, "epoch": 1, "batch": 0, "time": 1, "step_time_s": 0.01},
                      {"rank": 0, "epoch": 1, "batch": 0, "time": 1, "step_time_s": 0.01}]) == 1


@pytest.mark.timing
def test_a_killed_rank_is_reported_within_seconds_and_training_recovers(session, tmp_path):
    import os
    import signal
    import threading
    import time

    checkpoint = session.checkpoint(str(tmp_path / "before-crash"))
    victim = next(w for w in session.world if w["rank"] == 1)["pid"]
    threading.Timer(2.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) (0, )?1 died during fit"):  # its peer may go down with it
        session.fit(epochs=100)
    assert time.monotonic() - t0 < 2.0 + 10, "the death was not reported within seconds"
    restored = session.recover(checkpoint)
    assert len({r["weights"] for r in restored}) == 1 and len(session.world) == 2
    assert session.fit(epochs=1).epochs_done > 0


def test_rescale_keeps_the_model_state(session):
    before = session.fit(epochs=1).weights
    after = session.rescale(1)
    assert [r["weights"] for r in after] == [before] and len(session.world) == 1
    assert session.fit(epochs=1).epochs_done > 0


def test_scaling_experiment_gives_throughput_speedup_efficiency(tmp_path):
    import pandas as pd

    with TrainingSession(ranks=1) as s:
        s.setup(digits_model, digits_shard, loss=logits_loss(), lr=0.1)
        trained = s.fit(epochs=1).weights
        table = s.scaling([1, 2], epochs=1, mode="weak", csv=str(tmp_path / "scaling.csv"), plot=str(tmp_path / "scaling.png"))
        assert (s.ranks, s.epochs_done, s.weights_digest()) == (1, 1, trained), "the trained model was not kept"
    assert list(table["ranks"]) == [1, 2]
    assert (table["throughput"] > 0).all() and table.loc[0, "speedup"] == 1.0
    assert table["efficiency"].tolist() == pytest.approx((table["speedup"] / table["ideal"]).tolist())
    assert pd.read_csv(tmp_path / "scaling.csv").shape == table.shape
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_an_mpi_world_from_mpiexec_engines(monkeypatch):
    """world='mpi': ipyparallel's MPI launcher starts the engines under mpiexec and Horovod joins over MPI."""
    if os.geteuid() == 0:  # Open MPI refuses root unless told (the test runner is root on the test bed)
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    s = TrainingSession(ranks=2, world="mpi")
    try:
        world = s.start()
        assert sorted((w["rank"], w["size"], w["local_rank"]) for w in world) == [(0, 2, 0), (1, 2, 1)]
        s.setup(digits_model, digits_shard, loss=logits_loss(), lr=0.1)
        first, more = s.fit(epochs=1), s.fit(epochs=1)  # fit checks that both ranks hold identical weights
        assert more.loss[-1] < first.loss[0]
    finally:
        s.close()
    with pytest.raises(ValueError, match="world must be 'gloo'"):
        TrainingSession(world="nccl")


@pytest.mark.gpu
def test_each_rank_streams_its_gpu_memory():
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow here sees no GPU (tensorflow-cpu)")
    with TrainingSession(ranks=1) as s:
        assert s.world[0]["gpus"] >= 1
        s.setup(digits_model, digits_shard, loss=logits_loss(), lr=0.1)
        s.fit(epochs=1)
        gpu = s.metrics["gpu_memory_mb"].dropna()
        util = s.metrics["gpu_util_pct"].dropna()  # NVML, the driver's own figures
        used = s.metrics["gpu_used_mb"].dropna()
    assert len(gpu) > 0 and gpu.gt(0).all()
    assert len(util) > 0 and util.between(0, 100).all() and used.gt(0).all()


def digits_uneven(rank, size):
    """np.array_split of the 1797 digits: shards of 899 and 898 samples, not a multiple of ranks × batch size."""
    import numpy as np
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return np.array_split((x / 16.0).astype("float32"), size)[rank], np.array_split(y, size)[rank]


@pytest.mark.timeout(240)
def test_uneven_shards_agree_on_the_steps_and_finish():
    """With batches of 449, rank 0 (899 samples) needs 3 batches and rank 1 (898) only 2: fit deadlocked before (rank
    0's third gradient allreduce had no peer). Both now run the agreed 3 steps, rank 1 wrapping around its shard."""
    with TrainingSession(ranks=2) as s:
        built = s.setup(digits_model, digits_uneven, loss=logits_loss(), lr=0.1, batch_size=449)
        assert sorted(b["samples"] for b in built) == [898, 899]
        assert {b["steps_per_epoch"] for b in built} == {3}
        result = s.fit(epochs=2)  # raises WorldDiverged if the ranks' weights differ
        assert result.epochs_done == 2 and set(result.history) == {0, 1}
        built = s.setup(digits_model, digits_uneven, loss=logits_loss(), lr=0.1, batch_size=32)
        assert {b["steps_per_epoch"] for b in built} == {29}  # 899 and 898 samples: 29 batches each, the last partial
        assert s.fit(epochs=1).epochs_done == 1


def test_without_a_gpu_the_rank_reports_no_gpu_figures():
    """NVML is asked only for a GPU the rank was given; none (or no driver) gives no figures, never an error."""
    from jupyter_hpcdl.backends.gpu import RankGpu

    assert RankGpu(visible="").sample() is None and RankGpu(visible="-1").sample() is None
    assert RankGpu(visible="0").sample() is None or os.path.exists("/dev/nvidiactl")


def test_a_checkpoint_written_before_the_first_fit_resumes(session, tmp_path):
    """Before its first step the optimizer has no slots; loading builds them before restoring, so the checkpoint
    must hold them too (the scaling notebook checkpoints right after setup and failed to restore its model)."""
    session.setup(digits_model, digits_shard, loss=logits_loss(), lr=0.1, batch_size=32, seed=5)
    digest = session.weights_digest()
    path = session.checkpoint(str(tmp_path / "fresh"))
    session.fit(epochs=1)
    session.resume(path)
    assert session.weights_digest() == digest and session.epochs_done == 0
    assert session.fit(epochs=1).epochs_done == 1
