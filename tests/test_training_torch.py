"""The PyTorch backend in local mode (no batch system): 2 and 3 ranks as ipyparallel engines train a user's
``torch.nn.Module`` (Adam with a step schedule, a validation set) on scikit-learn's digits, interactively — epochs and
more epochs, live per-rank metrics, identical parameters, Stop mid-epoch, checkpoints that plain PyTorch loads,
resume and rescale with the optimizer's state, uneven shards, and an unchanged ``torchrun`` script."""
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest

from jupyter_hpcdl.training import RankError, TrainingSession

import workloads
from workloads import digits_shard, digits_torch_model

pytestmark = pytest.mark.ranks  # starts real worlds of local ranks (testbed/quick leaves them out)

torch = pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as functions defined in a notebook travel
cloudpickle.register_pickle_by_value(workloads)


@pytest.fixture(scope="module")
def session():
    s = TrainingSession(ranks=2, backend="torch")
    try:
        world = s.start()
        assert sorted((w["rank"], w["size"]) for w in world) == [(0, 2), (1, 2)]
        built = s.setup(digits_torch_model, digits_shard, loss="cross_entropy", metrics=["accuracy"],
                        validation_data=digits_shard, batch_size=32)
        assert {b["optimizer"] for b in built} == {"Adam"}
        yield s
    finally:
        s.close()


def digest(model) -> str:
    """As the backend digests a module's parameters."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_loss_falls_and_ranks_agree_epoch_after_epoch(session):
    first = session.fit(epochs=2)
    again = session.fit(epochs=2)
    assert first.epochs_done == 2 and again.epochs_done == 4
    assert set(first.history) == {0, 1}
    assert set(first.history[0]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert first.history[0] == first.history[1], "epoch metrics are averaged over the ranks"
    losses = first.loss + again.loss
    assert losses[-1] < losses[0] * 0.7, losses
    assert again.history[0]["val_accuracy"][-1] > 0.8
    assert first.weights != again.weights  # training moved them, and fit checked all ranks agree on each


def test_metrics_stream_from_both_ranks(session):
    seen = []
    session.fit(epochs=1, on_metrics=lambda table: seen.append(len(table.frame())))
    frame = session.metrics
    assert set(frame["rank"]) == {0, 1}
    assert frame["samples_per_s"].dropna().gt(0).all() and frame["memory_mb"].gt(0).all()
    assert frame["loss"].notna().all() and "accuracy" in frame
    assert seen and seen == sorted(seen), "metrics did not arrive while training ran"
    assert set(session.epoch_metrics["rank"]) == {0, 1}


def test_stop_mid_epoch_keeps_the_world_in_step(session):
    timer = threading.Timer(1.5, session.stop_training)
    timer.start()
    result = session.fit(epochs=200)
    timer.join()
    assert result.stopped and "stopped in epoch" in result.stopped
    assert result.epochs_done < session.fit(epochs=1).epochs_done  # the world still trains afterwards


def test_a_scheduled_learning_rate_is_not_set_by_hand(session):
    with pytest.raises(RankError, match="scheduler"):
        session.set_lr(0.1)


def test_plain_pytorch_loads_the_checkpoint_and_resume_restores_the_optimizer(session, tmp_path):
    path = session.checkpoint(str(tmp_path / "digits"))
    manifest = json.loads((tmp_path / "digits" / "hpcdl.json").read_text())
    state = tmp_path / "digits" / manifest["latest"]
    model, optimizer, scheduler = digits_torch_model()
    model.load_state_dict(torch.load(state / "model.pt"))  # plain PyTorch, as the module's docstring shows
    optimizer.load_state_dict(torch.load(state / "optimizer.pt"))
    scheduler.load_state_dict(torch.load(state / "scheduler.pt"))
    saved = session.weights_digest()
    assert digest(model) == saved
    steps = manifest["optimizer_steps"]
    assert steps > 0 and all(int(s["step"]) == steps for s in optimizer.state_dict()["state"].values())
    assert scheduler.last_epoch == manifest["epochs_done"]

    session.fit(epochs=1)
    assert session.weights_digest() != saved
    loaded = session.resume(path)
    assert {r["weights"] for r in loaded} == {saved} and {r["iterations"] for r in loaded} == {steps}
    for _ in range(3):  # the newest two states are kept; no partial directory is left
        session.checkpoint(path)
    kept = sorted(os.listdir(path))
    assert len([d for d in kept if d.startswith("state-")]) == 2 and not [d for d in kept if "partial" in d]


def test_a_checkpoint_of_the_other_backend_is_refused(session, tmp_path):
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "hpcdl.json").write_text(json.dumps({"format": "tf.train.Checkpoint", "latest": "ckpt-1"}))
    with pytest.raises(RankError, match="another backend"):
        session.resume(str(tmp_path / "keras"))


def test_a_setup_without_a_loss_says_what_to_give(session):
    before = session.weights_digest()
    with pytest.raises(RankError, match=r"loss=torch.nn.CrossEntropyLoss\(\)"):
        session.setup(digits_torch_model, digits_shard)
    assert session.weights_digest() == before, "a failed setup left the built model alone"


#: The example torchrun script the package ships (examples/), unchanged.
TORCHRUN_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "torchrun_digits.py"


def test_an_unchanged_torchrun_script_runs_on_the_ranks_with_live_steps(session):
    before = len(session.metrics)
    result = session.run_script(str(TORCHRUN_SCRIPT), ["--epochs", "2"], echo=False)
    assert result.ok and result.exit_codes == {0: 0, 1: 0}
    assert "final loss" in result.stdout[0] and not result.stdout[1]
    steps = session.metrics.iloc[before:]
    assert set(steps["rank"]) == {0, 1} and steps["step_time_s"].gt(0).all()
    assert steps["loss"].notna().any()
    assert session.fit(epochs=1).epochs_done > 0  # the script left the session's world as it was


#: A torchrun script whose ranks have different numbers of batches, kept in step by DDP's ``Join``: once
#: ("one"), once per epoch for 2 epochs ("epochs"), or with a ``ZeroRedundancyOptimizer`` joined too ("zero").
UNEVEN_JOIN_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer

base, extra, pause, mode = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
if mode == "zero":
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
done = 0
for epoch in range(2 if mode == "epochs" else 1):
    with Join([model, opt] if mode == "zero" else [model]):
        for _ in range(base + extra * rank):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            done += 1
            time.sleep(pause)
print("DONE", done, [round(x, 6) for p in model.parameters() for x in p.detach().reshape(-1).tolist()])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode, epochs", [("one", 1), ("epochs", 2), ("zero", 1)])
def test_a_script_with_uneven_inputs_under_join_ends_on_every_rank(session, tmp_path, mode, epochs):
    script = tmp_path / "uneven_join.py"
    script.write_text(UNEVEN_JOIN_SCRIPT)
    # rank 0 runs out after 12 steps; rank 1 takes 35 more, through two of the session's Stop checks (every 20th)
    before = len(session.metrics)
    result = session.run_script(str(script), ["12", "35", "0", mode], echo=False)
    assert result.ok and result.stopped is None, result
    done = {r: out.split("DONE ", 1)[1].split(" ", 1) for r, out in result.stdout.items()}
    assert {r: int(d[0]) for r, d in done.items()} == {0: 12 * epochs, 1: 47 * epochs}
    assert done[0][1] == done[1][1], "DDP's join left the ranks with different weights"
    published = session.metrics.iloc[before:].groupby("rank")["batch"].max()
    # the world's steps are numbered 0 to 47 * epochs - 1 (ZeRO's inner optimizer step is not one of its own)
    assert 20 <= published[1] < 47 * epochs, published


def test_stop_ends_a_script_on_every_rank_also_once_one_ran_out_of_inputs(session, tmp_path):
    script = tmp_path / "uneven_join.py"
    script.write_text(UNEVEN_JOIN_SCRIPT)
    asked = []

    def stop_once_rank_1_is_past_rank_0(table):
        if not asked and any(r == 1 and row["batch"] >= 30 for r, row in table.latest().items()):
            asked.append(True)
            session.stop_training()

    result = session.run_script(str(script), ["10", "100000", "0.002", "one"],
                                on_metrics=stop_once_rank_1_is_past_rank_0, echo=False)
    assert asked and result.ok and result.stopped and "stopped after batch" in result.stopped, result
    assert "DONE" not in result.stdout[0] + result.stdout[1], "a rank went on after the agreed stop"


#: A torchrun script taking ``steps`` optimizer steps: through a subclass whose ``step`` calls ``super().step()``
#: ("super": PyTorch runs its step hooks for both), or after a step that raised and was caught ("raised").
STEP_KINDS_SCRIPT = """
import sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps, mode = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
plain = torch.optim.SGD(model.parameters(), lr=0.01)  # from here on SGD.step is PyTorch's hooked one


class Clipped(torch.optim.SGD):
    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_(self.param_groups[0]["params"], 1.0)
        return super().step(closure)


class Failing(torch.optim.SGD):
    def step(self, closure=None):
        raise FloatingPointError("a step the script catches")


opt = Clipped(model.parameters(), lr=0.01) if mode == "super" else plain
if mode == "raised":
    try:
        Failing(model.parameters(), lr=0.01).step()
    except FloatingPointError:
        pass
for _ in range(steps):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["super", "raised"])
def test_each_optimizer_step_of_a_script_counts_once(session, tmp_path, mode):
    script = tmp_path / "step_kinds.py"
    script.write_text(STEP_KINDS_SCRIPT)
    before = len(session.metrics)
    result = session.run_script(str(script), ["45", mode], echo=False)
    assert result.ok, result
    published = session.metrics.iloc[before:].groupby("rank")["batch"].max()
    # steps 0 to 44, published at least at the Stop checks (every 20th); none if the raised step stopped the count
    assert sorted(published.index) == [0, 1] and published.between(20, 44).all(), published


def test_rescale_keeps_the_parameters_and_the_optimizer_state(session):
    session.fit(epochs=1)
    before, steps = session.weights_digest(), session.checkpoint(os.path.join(session.private_dir, "before"))
    steps = json.loads(open(os.path.join(steps, "hpcdl.json")).read())["optimizer_steps"]
    after = session.rescale(1)
    assert [r["weights"] for r in after] == [before] and [r["iterations"] for r in after] == [steps]
    assert len(session.world) == 1 and session.fit(epochs=1).epochs_done > 0


def uneven_digits(rank, size):
    """Shards of 100, 150 and 200 samples: 2, 3 and 4 batches of 64 — the ranks agree on 4 steps an epoch."""
    x, y = digits_shard(0, 1)
    start = sum(100 + 50 * r for r in range(rank))
    return x[start:start + 100 + 50 * rank], y[start:start + 100 + 50 * rank]


def test_uneven_shards_at_three_ranks_finish_with_identical_weights():
    with TrainingSession(ranks=3, backend="torch") as s:
        built = s.setup(digits_torch_model, uneven_digits, loss="cross_entropy", batch_size=64, seed=1)
        assert sorted(b["samples"] for b in built) == [100, 150, 200]
        assert {b["steps_per_epoch"] for b in built} == {4}
        result = s.fit(epochs=2)  # raises WorldDiverged if the ranks' parameters differ
        assert result.epochs_done == 2 and set(result.history) == {0, 1, 2}


def test_a_scaling_experiment_with_pytorch_keeps_the_model():
    with TrainingSession(ranks=1, backend="torch") as s:
        s.setup(digits_torch_model, digits_shard, loss="cross_entropy", metrics=["accuracy"])
        trained = s.fit(epochs=1).weights
        table = s.scaling([1, 2], epochs=1, mode="weak")
        assert (s.ranks, s.weights_digest()) == (1, trained), "the trained model was not kept"
    assert list(table["ranks"]) == [1, 2] and (table["throughput"] > 0).all()


def failing_once_on_rank_0(marker: str):
    """Callbacks whose rank-0 callback raises the first time (it leaves ``marker`` behind)."""
    def callbacks(rank, size):
        def fail(epoch, logs):
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("the user's callback failed")
        return [fail] if rank == 0 else []
    return callbacks


def test_a_rank_that_fails_mid_fit_ends_the_world_at_once_and_recover_goes_on(tmp_path):
    """Rank 0's callback raises after the first epoch while rank 1 waits for it in the next gradient allreduce:
    the session ends the world a few seconds later with rank 0's error (not at the collective's 30-minute
    deadline, nor as a stall)."""
    with TrainingSession(ranks=2, backend="torch", stall_timeout=600) as s:
        s.setup(digits_torch_model, digits_shard, loss="cross_entropy", seed=3,
                callbacks=failing_once_on_rank_0(str(tmp_path / "failed")))
        saved = s.checkpoint(str(tmp_path / "before"))
        with pytest.raises(RankError, match="the user's callback failed") as failed:
            s.fit(epochs=3)
        assert "stall" not in str(failed.value)
        s.recover(saved)
        assert s.fit(epochs=1).epochs_done == 1
