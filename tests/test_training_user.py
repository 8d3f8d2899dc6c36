"""The user's own work on a session's ranks (local mode, 2 ranks): a Keras model they compiled with Adam and a
schedule, a tf.data pipeline from files in their home, validation data, their callbacks, their seed; code run on
every rank (``run``, ``%%ranks``); an existing Horovod script run unchanged (``run_script``) with live metrics and
Stop; checkpoints that keep Adam's state across a rescale, in a format TensorFlow reads."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

from jupyter_hpcdl.training import RankError, ScriptFailed, TrainingSession
from jupyter_hpcdl.training.spec import make_spec

pytestmark = pytest.mark.ranks  # starts real worlds of local ranks (testbed/quick leaves them out)

pytest.importorskip("horovod.tensorflow.keras")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as functions defined in a notebook travel

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "horovod_keras_digits.py"


def digits_arrays():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype("float32"), y.astype("int64")


def adam_model():
    """The user's model, compiled as they would for one GPU: Adam with a decaying learning rate, and accuracy."""
    import tensorflow as tf
    model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=50, decay_rate=0.9)
    model.compile(optimizer=tf.keras.optimizers.Adam(schedule),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class EpochLog:
    """A user's callback: it keeps the epoch logs it saw on its rank (read back with session.run)."""

    def __new__(cls):
        import tensorflow as tf

        class Recorder(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                import builtins
                builtins.__dict__.setdefault("hpcdl_test_epochs", []).append((epoch, dict(logs or {})))

        return Recorder()


def seen_epochs():
    import builtins
    return builtins.__dict__.get("hpcdl_test_epochs", [])


def optimizer_state():
    """A digest of the optimizer's variables (Adam's moments and step count) on this rank."""
    import hashlib

    from jupyter_hpcdl.backends.horovod.rank import _STATE
    h = hashlib.sha256()
    for v in _STATE["model"].optimizer.variables:
        h.update(v.numpy().tobytes())
    return int(_STATE["model"].optimizer.iterations), h.hexdigest()


@pytest.fixture(scope="module")
def session():
    with TrainingSession(ranks=2) as s:
        yield s


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The user's data as files in their home: one .npz per part, and a validation file."""
    x, y = digits_arrays()
    root = tmp_path_factory.mktemp("home-data")
    for part in range(4):
        np.savez(root / f"part-{part}.npz", x=x[part:1500:4], y=y[part:1500:4])
    np.savez(root / "validation.npz", x=x[1500:], y=y[1500:])
    return root


def file_pipeline(directory):
    """A tf.data pipeline of the user's files: each rank reads its own files and batches them."""
    def data(rank, size):
        import glob

        import tensorflow as tf
        parts = sorted(glob.glob(f"{directory}/part-*.npz"))[rank::size]

        def read(path):
            with np.load(path.decode()) as f:
                return f["x"], f["y"]

        files = tf.data.Dataset.from_tensor_slices(parts)
        samples = files.map(lambda p: tf.numpy_function(read, [p], (tf.float32, tf.int64))).unbatch()
        options = tf.data.Options()
        options.threading.private_threadpool_size = 2  # the user's own options, kept by the session's stream
        return (samples.map(lambda x, y: (tf.ensure_shape(x, [64]), tf.ensure_shape(y, []))).shuffle(800).batch(32)
                .with_options(options))
    return data


def stream_options() -> list:
    """Of the streams this rank's next fit reads (training, validation): whether they are autotuned (None:
    TensorFlow's default) and their private thread pool's size."""
    from jupyter_hpcdl.backends.horovod.rank import _STATE
    from jupyter_hpcdl.backends.horovod.rank_data import training_stream, validation_stream
    spec = _STATE["spec"]
    streams = [training_stream(_STATE["shard"], spec.batch_size, spec.seed, 0),
               validation_stream(_STATE["validation"], spec.batch_size)]
    return [None if s is None else (s.options().autotune.enabled, s.options().threading.private_threadpool_size)
            for s in streams]


def autotuning_kept(autotune: bool | None) -> list:
    """Whether the session's training and validation streams over a user's Dataset that sets ``tf.data``'s
    autotuning to ``autotune`` (None: leaves it unset) are autotuned."""
    import tensorflow as tf

    from jupyter_hpcdl.backends.horovod.rank_data import Shard, training_stream, validation_stream
    options = tf.data.Options()
    if autotune is not None:
        options.autotune.enabled = autotune
    shard = Shard(dataset=tf.data.Dataset.range(8).batch(2).with_options(options))
    return [s.options().autotune.enabled for s in (training_stream(shard, 2, 0, 0), validation_stream(shard, 2))]


def test_the_users_compiled_model_trains_with_their_pipeline_validation_and_callback(session, files):
    built = session.setup(adam_model, file_pipeline(files), validation_data=str(files / "validation.npz"),
                          callbacks=lambda rank, size: [EpochLog()], seed=7)
    assert {b["optimizer"] for b in built} == {"Adam"}, built
    assert {b["steps_per_epoch"] for b in built} == {24}  # 750 samples per rank in batches of 32
    first = session.fit(epochs=2)
    more = session.fit(epochs=2)
    assert more.epochs_done == 4
    losses = first.history[0]["loss"] + more.history[0]["loss"]
    assert losses[-1] < losses[0] * 0.6, losses
    for key in ("val_loss", "val_accuracy", "accuracy"):  # averaged over the ranks: the same on each
        assert first.history[0][key] == pytest.approx(first.history[1][key], rel=1e-6), key
    assert more.history[0]["val_accuracy"][-1] > 0.8
    seen = session.run(seen_epochs)
    assert [e for e, _ in seen[0]] == [0, 1, 2, 3], "the user's callback was not called each epoch"
    assert seen[0][-1][1]["val_loss"] == pytest.approx(seen[1][-1][1]["val_loss"], rel=1e-6)
    assert set(session.metrics.columns) >= {"accuracy", "loss"}
    epochs = session.epoch_metrics
    assert set(epochs["rank"]) == {0, 1} and "val_accuracy" in epochs.columns
    # the user's pipeline keeps its options; tf.data's autotuning, which it leaves unset, is off (its teardown can
    # hold up the end of a fit by seconds); validation arrays in a stream of ours: not autotuned either
    assert session.run(stream_options) == {r: [(False, 2), (False, None)] for r in (0, 1)}
    # for training and for validation: a Dataset that asks for autotuning keeps it, one that does not say is not
    assert session.run(autotuning_kept, True) == {r: [True, True] for r in (0, 1)}
    assert session.run(autotuning_kept, None) == {r: [False, False] for r in (0, 1)}


def test_seeds_are_the_users_choice(session):
    x, y = digits_arrays()
    digests = []
    for seed in (3, 3, 4):
        session.setup(adam_model, (x, y), seed=seed)
        digests.append(session.weights_digest())
    assert digests[0] == digests[1] != digests[2]
    assert session.seed == 4


def test_arrays_a_npz_path_and_scaled_learning_rate(session, tmp_path):
    x, y = digits_arrays()
    np.savez(tmp_path / "digits.npz", x=x, y=y)
    built = session.setup(adam_model, str(tmp_path / "digits.npz"), scale_lr=True, batch_size=64)
    assert sorted(b["samples"] for b in built) == [898, 899]
    assert [b["learning_rate"] for b in built] == pytest.approx([0.02, 0.02])  # the schedule's 0.01 × 2 ranks
    assert session.fit(epochs=1).epochs_done == 1
    # arrays: nothing in the stream to tune, and an autotuned iterator's teardown can hold up the end of a fit
    assert session.run(stream_options) == {r: [(False, None), None] for r in (0, 1)}


def batchnorm_model():
    """A model with BatchNormalization: its moving statistics are updated from each rank's own batches (Horovod
    averages gradients, not them), so they differ between ranks fed different data."""
    import tensorflow as tf
    model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(32),
                                 tf.keras.layers.BatchNormalization(), tf.keras.layers.ReLU(),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def moving_statistics() -> list[float]:
    """The sums of this rank's non-trainable weights (BatchNormalization's moving mean and variance)."""
    from jupyter_hpcdl.backends.horovod.rank import _STATE
    return [float(w.numpy().sum()) for w in _STATE["model"].non_trainable_weights]


def test_batch_normalization_on_different_shards_is_not_taken_for_diverged_weights(session):
    session.setup(batchnorm_model, digits_arrays(), batch_size=64)  # every other sample on each rank
    done = session.fit(epochs=2)  # raised WorldDiverged when the digest covered the moving statistics
    assert done.epochs_done == 2 and done.history[0]["loss"][-1] < done.history[0]["loss"][0]
    stats = session.run(moving_statistics)
    assert stats[0] != stats[1], "the ranks' moving statistics are equal: this test no longer shows anything"
    assert isinstance(session.weights_digest(), str)  # the trained weights are the same on both ranks


def test_bad_input_says_what_to_fix(session, tmp_path):
    with pytest.raises(ValueError, match="no file .*missing.npz"):
        session.setup(adam_model, str(tmp_path / "missing.npz"))
    with pytest.raises(ValueError, match="x has 3 samples but y has 2"):
        make_spec(adam_model, (np.zeros((3, 64)), np.zeros(2)))
    with pytest.raises(ValueError, match="lr and metrics go with loss="):
        make_spec(adam_model, digits_arrays(), lr=0.1)

    def uncompiled():
        import tensorflow as tf
        return tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(10)])

    with pytest.raises(RankError, match=r"rank 0: ValueError: model_fn returned a model that is not compiled"):
        session.setup(uncompiled, digits_arrays())
    session.setup(adam_model, digits_arrays())
    with pytest.raises(ValueError, match="batch_size must be a positive whole number, not 0"):
        session.recover("/nonexistent", batch_size=0)  # refused before the world is touched
    assert session.alive


def test_run_returns_each_ranks_answer_and_names_the_failing_rank(session):
    def where():
        import horovod.tensorflow as hvd
        return hvd.rank(), hvd.size(), os.getpid()

    answers = session.run(where)
    assert {r: a[:2] for r, a in answers.items()} == {0: (0, 2), 1: (1, 2)}
    assert {a[2] for a in answers.values()} == {w["pid"] for w in session.world}

    def fails_on_one(limit):
        import horovod.tensorflow as hvd
        if hvd.rank() >= limit:
            raise ValueError(f"rank {hvd.rank()} has no data")
        return "fine"

    with pytest.raises(RankError, match=r"rank 1: ValueError: rank 1 has no data") as e:
        session.run(fails_on_one, limit=1)
    assert "rank 0" not in str(e.value)


def test_the_ranks_cell_magic_shows_each_ranks_output(session, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    from jupyter_hpcdl.training.magic import register_cell_magic
    assert register_cell_magic(session)
    shell.run_cell_magic("ranks", "", "import horovod.tensorflow as hvd\nanswer = 40 + hvd.rank()\n"
                                      "print('rank', hvd.rank(), 'of', hvd.size())\nanswer")
    out = capsys.readouterr().out
    assert "[rank 0]\nrank 0 of 2\nOut: 40" in out and "[rank 1]\nrank 1 of 2\nOut: 41" in out, out
    assert session.run_cell("print(answer)")[1]["stdout"] == "41\n"  # the namespace stays between cells
    with pytest.raises(RankError, match=r"rank [01]: ZeroDivisionError"):
        shell.run_cell_magic("ranks", "", "1 / 0")


def test_an_existing_horovod_script_runs_unchanged_with_live_metrics(session, capsys):
    seen = []
    result = session.run_script(str(EXAMPLE), ["--epochs", "2"], on_metrics=lambda t: seen.append(len(t.frame())))
    assert result.ok and result.exit_codes == {0: 0, 1: 0} and result.stopped is None
    assert "final loss" in result.stdout[0] and "final loss" not in result.stdout[1]
    assert "[rank 0] final loss" in capsys.readouterr().out
    frame = session.metrics
    script_rows = frame.tail(seen[-1] - (seen[0] - 1)) if seen else frame.iloc[0:0]
    assert seen and set(script_rows["rank"]) == {0, 1}, "the script's metrics did not stream from both ranks"
    assert script_rows["accuracy"].notna().any()
    epochs = session.epoch_metrics
    assert len(epochs[epochs["rank"] == 1]) >= 2


def test_the_same_script_runs_under_horovodrun():
    """The script run above is a plain horovodrun script (nothing of this project in it)."""
    assert "jupyter_hpcdl" not in EXAMPLE.read_text()
    run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "--gloo",
                          sys.executable, str(EXAMPLE), "--epochs", "1"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final loss" in run.stdout


def test_stop_ends_a_running_script_at_an_agreed_batch(session):
    timer = threading.Timer(4.0, session.stop_training)
    timer.start()
    result = session.run_script(str(EXAMPLE), ["--epochs", "500"], echo=False)
    timer.join()
    assert result.stopped and "stopped in epoch" in result.stopped, result
    assert session.run(lambda: 1) == {0: 1, 1: 1}  # the world is still in step


def test_a_failing_script_raises_with_each_ranks_exit_code(session, tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys\nimport horovod.tensorflow as hvd\nhvd.init()\n"
                      "print('about to leave', file=sys.stderr)\nsys.exit(3 if hvd.rank() == 1 else 0)\n")
    with pytest.raises(ScriptFailed, match=r"exits.py failed on rank 1: exit code 3 \(rank 1 said: about to leave\)") as e:
        session.run_script(str(script), echo=False)
    assert e.value.result.exit_codes == {0: 0, 1: 3}
    assert e.value.result.stderr[1].strip() == "about to leave"
    with pytest.raises(ValueError, match="args must be a list of strings"):
        session.run_script(str(script), "--epochs 3")


@pytest.mark.timeout(600)
def test_adam_continues_across_a_rescale_as_without_one(tmp_path):
    """Train with Adam on 2 ranks, checkpoint, go on (the reference); then from the checkpoint on 1 rank with
    the same global batch. The optimizer's state (moments, step count, so the schedule's place) comes along, and the
    loss goes on as it did without the rescale; the checkpoint is plain TensorFlow."""
    x, y = digits_arrays()
    with TrainingSession(ranks=2) as s:
        s.setup(adam_model, (x, y), batch_size=32, seed=11, shuffle=False)
        before = s.fit(epochs=3).loss
        path = s.checkpoint(str(tmp_path / "adam"))
        state = s.run(optimizer_state)
        assert state[0] == state[1] and state[0][0] == 3 * 29
        reference = s.fit(epochs=3).loss
        loaded = s.recover(path, ranks=1, batch_size=64)  # 1 rank × 64 = 2 ranks × 32
        assert loaded[0]["saved_world_size"] == 2 and loaded[0]["epochs_done"] == 3
        assert s.run(optimizer_state)[0] == state[0], "Adam's moments or step count did not come along"
        continued = s.fit(epochs=3)
        assert continued.epochs_done == 6
    assert continued.loss == pytest.approx(reference, rel=0.05), (before, reference, continued.loss)
    assert continued.loss[0] < before[0] * 0.5
    manifest = json.loads((tmp_path / "adam" / "hpcdl.json").read_text())
    assert manifest["epochs_done"] == 3 and manifest["world_size"] == 2 and manifest["seed"] == 11
    import tensorflow as tf
    model = adam_model()
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
        tf.train.latest_checkpoint(str(tmp_path / "adam"))).expect_partial()
    assert int(model.optimizer.iterations) == 3 * 29  # plain TensorFlow reads it


def test_a_checkpoint_that_does_not_fit_says_so(session, tmp_path):
    x, y = digits_arrays()
    session.setup(adam_model, (x, y))
    path = session.checkpoint(str(tmp_path / "small"))

    def wider():
        import tensorflow as tf
        model = tf.keras.Sequential([tf.keras.layers.Input((64,)), tf.keras.layers.Dense(48, activation="relu"),
                                     tf.keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    session.setup(wider, (x, y))
    with pytest.raises(RankError, match="does not fit this model|shape"):
        session.resume(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RankError, match="is a file: a checkpoint is a directory"):
        session.checkpoint(str(tmp_path / "file"))


def test_the_dashboard_trains_the_users_compiled_model(session):
    from jupyter_hpcdl.dashboard import Dashboard

    session.setup(adam_model, digits_arrays(), validation_data=digits_arrays(), seed=5)
    tabs = Dashboard(session=session, epochs=2)
    d = tabs.training
    assert d.lr.disabled, "the user's optimizer sets the learning rate, not the dashboard's box"
    d.buttons["Train"].click()
    d.wait(300)
    assert d.error.value == "", d.error.value
    assert "done: " in d.status.value and d.progress.max == session.batches_per_epoch * 2
    assert {m.labels[0] for m in d.figures["loss"].marks} == {"rank 0", "rank 1"}
