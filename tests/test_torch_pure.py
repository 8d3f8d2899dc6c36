"""The PyTorch backend's parts that need no world of ranks (pure, with PyTorch imported here): its checkpoints,
written whole and read by plain PyTorch; the batches it makes of the user's arrays; what ``model_fn`` may return."""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jupyter_hpcdl.backends.base import NpzFile  # noqa: E402
from jupyter_hpcdl.backends.progress import Progress  # noqa: E402
from jupyter_hpcdl.backends.pytorch import checkpoint  # noqa: E402
from jupyter_hpcdl.backends.pytorch.model import model_parts  # noqa: E402
from jupyter_hpcdl.backends.pytorch.rank_data import Shard, load_shard, one_pass, training_stream  # noqa: E402
from jupyter_hpcdl.training.spec import ShortCompile  # noqa: E402


def parts():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1)


def test_a_checkpoint_keeps_the_newest_two_and_clears_a_save_killed_half_way(tmp_path):
    model, optimizer, scheduler = parts()
    (tmp_path / "c" / ".partial-killed").mkdir(parents=True)  # what a killed rank 0 left
    for epoch in range(3):
        checkpoint.save(str(tmp_path / "c"), model, optimizer, scheduler, Progress(epoch, 10 * epoch, 2, 7), 5)
    names = sorted(os.listdir(tmp_path / "c"))
    assert "hpcdl.json" in names and len([n for n in names if n.startswith("state-")]) == 2
    assert not [n for n in names if n.startswith(".")]
    latest = json.loads((tmp_path / "c" / "hpcdl.json").read_text())["latest"]
    assert latest == max(n for n in names if n.startswith("state-")) and "epoch2" in latest
    fresh, fresh_opt, fresh_sched = parts()
    saved = checkpoint.load(str(tmp_path / "c"), fresh, fresh_opt, fresh_sched, "cpu")
    assert saved.progress == Progress(2, 20, 2, 7) and saved.optimizer_steps == 5
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.state_dict()["state"][0]["step"] == 1


def test_a_failed_save_leaves_the_last_checkpoint_as_it_was(tmp_path, monkeypatch):
    model, optimizer, scheduler = parts()
    checkpoint.save(str(tmp_path / "c"), model, optimizer, scheduler, Progress(1, 10, 2, 7), 5)
    before = sorted(os.listdir(tmp_path / "c")), (tmp_path / "c" / "hpcdl.json").read_text()

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(str(tmp_path / "c"), model, optimizer, scheduler, Progress(2, 20, 2, 7), 6)
    assert (sorted(os.listdir(tmp_path / "c")), (tmp_path / "c" / "hpcdl.json").read_text()) == before


def test_a_checkpoint_that_does_not_fit_the_model_says_so(tmp_path):
    model, optimizer, scheduler = parts()
    checkpoint.save(str(tmp_path / "c"), model, optimizer, scheduler, Progress(1, 10, 2, 7), 5)
    other = torch.nn.Linear(5, 2)
    with pytest.raises(ValueError, match="does not fit this model"):
        checkpoint.load(str(tmp_path / "c"), other, torch.optim.Adam(other.parameters()), None, "cpu")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        checkpoint.load(str(tmp_path / "none"), model, optimizer, None, "cpu")


def test_arrays_become_float32_inputs_and_int64_labels_and_each_pass_is_its_own_order():
    x, y = np.arange(20.0).reshape(10, 2), np.arange(10, dtype=np.uint8)
    batches = list(one_pass(Shard(x, y), 4, seed=1, rank=0, p=0, shuffle=True))
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert batches[0][0].dtype == torch.float32 and batches[0][1].dtype == torch.int64
    order = torch.cat([b[1] for b in batches]).tolist()
    assert sorted(order) == list(range(10)) and order != list(range(10))
    again = torch.cat([b[1] for b in one_pass(Shard(x, y), 4, seed=1, rank=0, p=0, shuffle=True)]).tolist()
    assert again == order and order != torch.cat([b[1] for b in one_pass(Shard(x, y), 4, 1, 0, 1, True)]).tolist()


def test_a_stream_resumes_at_the_batch_it_was_at_and_wraps_into_the_next_pass():
    x, y = np.zeros((10, 2), np.float32), np.arange(10)
    whole = [b[1].tolist() for _, b in zip(range(7), training_stream(Shard(x, y), 4, 3, 0, True, 0, 3, "cpu"))]
    later = [b[1].tolist() for _, b in zip(range(3), training_stream(Shard(x, y), 4, 3, 0, True, 4, 3, "cpu"))]
    assert later == whole[4:7]  # batch 4 is the second of pass 1


def test_a_npz_shard_is_a_copy_of_the_ranks_part_only(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.arange(100.0), y=np.arange(100))
    shard = load_shard(NpzFile(str(tmp_path / "d.npz")), 1, 4)
    assert shard.x.tolist() == list(range(1, 100, 4)) and shard.x.base is None and shard.x.flags.c_contiguous


def test_what_model_fn_may_return_and_what_it_is_told_otherwise():
    short = ShortCompile("cross_entropy", ("accuracy", ("top", lambda o, t: 1.0)), 0.05)
    module = torch.nn.Linear(2, 2)
    plain = model_parts(module, short)
    assert isinstance(plain.optimizer, torch.optim.SGD) and not plain.user_optimizer
    assert plain.optimizer.param_groups[0]["lr"] == 0.05 and list(plain.metrics) == ["accuracy", "top"]
    opt = torch.optim.Adam(module.parameters())
    assert model_parts({"model": module, "optimizer": opt}, short).user_optimizer
    with pytest.raises(ValueError, match="loss=torch.nn.CrossEntropyLoss()"):
        model_parts(module, None)
    with pytest.raises(ValueError, match="must return a torch.nn.Module"):
        model_parts("not a model", short)
    with pytest.raises(ValueError, match="unknown loss 'xent'"):
        model_parts(module, ShortCompile("xent"))
