"""The notebooks, run the way binder would run them: a fresh virtual environment built only from ``binder/`` (its
requirements.txt, then its postBuild, from the repository's root, as repo2docker does), then every notebook of
``notebooks/`` executed top to bottom by nbclient in local mode (2 CPU ranks, no batch system). Each notebook ends
with a summary of what it measured; its figures are checked here, not just that no cell raised.

The Horovod wheel the installation built is offered to pip (``PIP_FIND_LINKS``), as pip's own cache would: building
it again would add minutes and prove nothing about binder/. PyTorch's CPU build comes from this machine's find-links
(``HPCDL_TORCH_INDEX=none``: there is no internet here)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from demo_notebook import notebook_summary

pytestmark = pytest.mark.ranks  # starts real worlds of local ranks (testbed/quick leaves them out)

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]-*.ipynb"))
ARTIFACTS = REPO / "artifacts" / "notebooks"
RUNNER = """
import json, sys, time
import nbformat
from nbclient import NotebookClient
src, dst = sys.argv[1], sys.argv[2]
book = nbformat.read(src, as_version=4)
t0 = time.monotonic()
try:
    NotebookClient(book, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": sys.argv[3]}}).execute()
finally:
    nbformat.write(book, dst)
print(json.dumps({"seconds": time.monotonic() - t0}))
"""


def _horovod_wheels() -> str:
    downloads = os.environ.get("HPCDL_DOWNLOADS", "/var/cache/jupyter-hpcdl-downloads")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    dirs = {os.path.dirname(w) for w in glob.glob(f"{downloads}/horovod/*/horovod-0.28.1-{tag}-*.whl")}
    return " ".join(sorted(dirs))


def _find_links() -> str:
    """The Horovod wheels, and the find-links this machine's pip has already (where PyTorch's CPU build lies here):
    ``PIP_FIND_LINKS`` replaces pip's configured value, so that is kept."""
    configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                capture_output=True, text=True).stdout.strip()
    return " ".join(p for p in (_horovod_wheels(), os.environ.get("PIP_FIND_LINKS", ""), configured) if p)


@pytest.fixture(scope="module")
def binder_env(tmp_path_factory) -> Path:
    """A virtual environment from Debian's Python 3.11 (binder/runtime.txt) with binder/'s files applied."""
    assert (REPO / "binder/runtime.txt").read_text().strip() == "python-3.11"
    venv = tmp_path_factory.mktemp("binder") / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv}/bin:{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "PIP_FIND_LINKS": _find_links(), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "HPCDL_TORCH_INDEX": "none",  # no internet here: pip's find-links hold PyTorch's CPU build
           "YARN_CACHE_FOLDER": os.path.join(os.environ.get("HPCDL_DOWNLOADS", "/var/cache/jupyter-hpcdl-downloads"),
                                             "yarn")}
    env.pop("PYTHONPATH", None)
    for step in (["python", "-m", "pip", "install", "-q", "-r", "binder/requirements.txt"], ["bash", "binder/postBuild"]):
        done = subprocess.run(step, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"{' '.join(step)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return venv


@pytest.fixture(scope="module")
def executed(binder_env, tmp_path_factory) -> dict[str, dict]:
    """Each notebook executed in a copy of the repository's layout (notebooks/ beside examples/): its summary."""
    work = tmp_path_factory.mktemp("run")
    shutil.copytree(REPO / "notebooks", work / "notebooks")
    shutil.copytree(REPO / "examples", work / "examples")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JUPYTER_PATH")}
    env.update(PATH=f"{binder_env}/bin:{os.environ['PATH']}", TF_CPP_MIN_LOG_LEVEL="2",
               HPCDL_BATCH_ROOT=str(work / "batch-runs"))
    summaries = {}
    for notebook in NOTEBOOKS:
        out = ARTIFACTS / notebook.name
        done = subprocess.run([str(binder_env / "bin/python"), "-c", RUNNER, str(work / "notebooks" / notebook.name),
                               str(out), str(work / "notebooks")], env=env, capture_output=True, text=True,
                              timeout=1200)
        assert done.returncode == 0, f"{notebook.name} failed (executed copy: {out}):\n{done.stderr[-4000:]}"
        summaries[notebook.stem] = {**notebook_summary(out), "outputs": work / "notebooks" / "outputs"}
    return summaries


def test_every_notebook_is_run_here():
    assert [n.stem for n in NOTEBOOKS] == ["01-first-training", "02-your-own-model-and-data", "03-scaling",
                                          "04-checkpoint-resume-rescale", "05-horovod-script", "06-batch-mode",
                                          "07-pytorch"]


def test_first_training_trains_two_local_ranks_and_draws_its_charts(executed):
    s = executed["01-first-training"]
    assert s["where"] == "local" and s["ranks"] == 2 and s["epochs"] == 4
    assert s["loss_last_epoch"] < 0.8 * s["loss_first_epoch"], s
    assert sorted(s["per_rank"]) == ["0", "1"]
    assert all(r["batches"] > 0 and r["samples_per_s"] > 0 for r in s["per_rank"].values())
    assert Path(s["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_own_model_and_data_learns_and_its_callback_writes_its_log(executed):
    s = executed["02-your-own-model-and-data"]
    assert s["where"] == "local" and s["ranks"] == 2 and s["epochs"] == 4
    assert s["history_rows"] == 4  # the user's CSVLogger, on rank 0, saw every epoch
    assert s["val_accuracy"] > 0.7 and s["loss_last_epoch"] < s["loss_first_epoch"], s


def test_scaling_measures_each_count_in_both_modes_and_writes_csv_and_plot(executed):
    s = executed["03-scaling"]
    for mode in ("strong", "weak"):
        rows = s[mode]
        assert [r["ranks"] for r in rows] == [1, 2]
        assert rows[0]["speedup"] == pytest.approx(1.0) and all(r["throughput"] > 0 for r in rows)
        assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2, rel=0.01)
    assert s["ranks_after"] == 2  # the session is as it was
    assert {"03-strong.csv", "03-strong.png", "03-weak.csv", "03-weak.png"} <= set(s["files"])
    csv = (s["outputs"] / "03-strong.csv").read_text().splitlines()
    assert len(csv) == 3 and "efficiency" in csv[0]


def test_checkpoint_resume_rescale_go_back_exactly_and_on_one_rank(executed):
    s = executed["04-checkpoint-resume-rescale"]
    assert s["weights_match_checkpoint"] and s["moved_on"], s
    assert s["epochs_after_resume"] == 2 and s["epochs"] == 3 and s["ranks_after_rescale"] == 1
    assert "checkpoint" in s["checkpoint_files"]  # TensorFlow's index: the checkpoint is complete
    assert s["time_left"] is None  # not in a batch job


def test_an_unchanged_horovod_script_runs_on_the_ranks_and_streams_metrics(executed):
    s = executed["05-horovod-script"]
    assert s["exit_codes"] == {"0": 0, "1": 0}
    assert s["last_line"].startswith("final loss") and s["batches_streamed"] > 0


def test_batch_mode_submits_watches_and_collects_a_run_of_local_ranks(executed):
    s = executed["06-batch-mode"]
    assert s["where"] == "local" and s["exit_code"] == 0 and s["ranks_seen"] == [0, 1], s
    assert s["epochs"] == 4 and s["loss_last_epoch"] < 0.8 * s["loss_first_epoch"]
    assert s["attached_phase"] == "ended"
    run = Path(s["directory"])
    assert json.loads((run / "status.json").read_text())["exit_code"] == 0
    assert len((run / "history.csv").read_text().splitlines()) == 5  # what the script wrote in its directory
    assert Path(s["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_own_pytorch_model_learns_checkpoints_for_plain_pytorch_and_runs_a_torchrun_script(executed):
    s = executed["07-pytorch"]
    assert s["where"] == "local" and s["ranks"] == 2 and s["epochs"] == 4
    assert s["history_rows"] == 4  # the user's callback, on rank 0, saw every epoch
    assert s["val_accuracy"] > 0.7 and s["loss_last_epoch"] < s["loss_first_epoch"], s
    assert s["checkpoint_matches"], "plain PyTorch did not read the ranks' parameters from the checkpoint"
    assert s["script_exit_codes"] == {"0": 0, "1": 0} and s["script_ranks"] == [0, 1] and s["script_steps_streamed"] > 0
