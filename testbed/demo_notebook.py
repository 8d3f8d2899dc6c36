"""The main job's last part: the first notebook, run as alice in her JupyterLab job through the hub.

Her server is spawned through the hub's REST API (two nodes, a GPU each); in a kernel of that server (inside her
container, the way JupyterLab runs one) nbclient executes ``notebooks/01-first-training.ipynb`` top to bottom, so
its TrainingSession puts one rank on each node of the job, each in her container. Then each rank's figures are
printed, with where the executed notebook and the PNG of its charts were written, and her server is stopped.

    /opt/jupyter-hpcdl/venv/bin/python testbed/demo_notebook.py [--user alice] [--nodes 2]
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import sys
from pathlib import Path

from hubclient import Hub

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))
NOTEBOOK = "01-first-training.ipynb"
#: Run in the user's kernel: execute the notebook with nbclient (its kernel starts in the same container and job,
#: so it finds the allocation) and write the executed copy.
EXECUTE = """
import nbformat
from nbclient import NotebookClient
book = nbformat.read({src!r}, as_version=4)
try:
    NotebookClient(book, timeout=600, kernel_name="python3", resources={{"metadata": {{"path": {cwd!r}}}}}).execute()
finally:
    nbformat.write(book, {dst!r})
"""


def notebook_summary(path: Path) -> dict:
    """The JSON an executed notebook's summary cell printed (its last printed JSON object with a "notebook" key)."""
    book = json.loads(path.read_text())
    for cell in reversed(book["cells"]):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stdout":
                text = "".join(output["text"])
                if text.lstrip().startswith("{") and '"notebook"' in text:
                    return json.loads(text)
    raise ValueError(f"{path.name} printed no summary")


def place_notebooks(user: str, names: list[str], directory: str = "hpcdl-notebooks") -> Path:
    """Copies of the notebooks in ``directory`` of the user's home (theirs, as a workshop's copy would be), with the
    example script they run beside them; the directory."""
    pw = pwd.getpwnam(user)
    work = Path(pw.pw_dir) / directory
    work.mkdir(exist_ok=True)
    copies = [shutil.copy(REPO / "notebooks" / name, work / name) for name in names]
    copies.append(shutil.copy(REPO / "examples" / "horovod_keras_digits.py", work / "horovod_keras_digits.py"))
    for path in (work, *copies):
        os.chown(path, pw.pw_uid, pw.pw_gid)
    return work


def run_notebooks(hub: Hub, user: str = "alice", nodes: int = 2, names: list[str] | None = None,
                  gpus_per_node: int = 1, directory: str = "hpcdl-notebooks") -> dict[str, tuple[dict, Path]]:
    """Spawn ``user``'s server on ``nodes`` nodes (``gpus_per_node`` each), execute the notebooks (``names``, by
    default the first) in it one after the other, in ``directory`` of the home, stop the server; each notebook's
    summary and executed copy, by name."""
    names = names or [NOTEBOOK]
    work = place_notebooks(user, names, directory)
    if hub.server(user):
        hub.stop(user)
    status, body = hub.api("POST", f"/hub/api/users/{user}/server",
                           {"nodes": nodes, "gpus_per_node": gpus_per_node, "image": "base"}, timeout=120)
    if status not in (201, 202):
        raise RuntimeError(f"the hub refused {user}'s server: {status} {body}")
    done = {}
    try:
        hub.wait_ready(user, timeout=300)
        hub.wait_routed(user)
        for name in names:
            executed = work / name.replace(".ipynb", ".executed.ipynb")
            print(f"== {user}'s JupyterLab runs as a batch job on {nodes} node(s); running {name} in it", flush=True)
            hub.run_in_kernel(user, EXECUTE.format(src=str(work / name), dst=str(executed), cwd=str(work)),
                              timeout=900)
            done[name] = (notebook_summary(executed), executed)
    finally:
        if hub.server(user):
            hub.stop(user)
    return done


def run_first_notebook(hub: Hub, user: str = "alice", nodes: int = 2) -> tuple[dict, Path]:
    """The first notebook, run as :func:`run_notebooks` runs them."""
    return run_notebooks(hub, user, nodes)[NOTEBOOK]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--user", default="alice")
    p.add_argument("--nodes", type=int, default=2)
    args = p.parse_args(argv)
    hub = Hub(json.loads((STATE / "bed.json").read_text()))
    summary, executed = run_first_notebook(hub, args.user, args.nodes)
    print(f"-- the ranks ran in {summary['where']!r}: {summary['ranks']} ranks, {summary['epochs']} epochs, mean "
          f"loss {summary['loss_first_epoch']:.3f} after the first epoch, {summary['loss_last_epoch']:.3f} after the "
          "last")
    for rank, figures in sorted(summary["per_rank"].items(), key=lambda kv: int(kv[0])):
        print(f"rank {rank}: " + json.dumps(figures))
    print(f"-- the executed notebook: {executed}")
    print(f"-- its charts as a PNG:   {summary['chart']}")
    return 0 if summary["where"] == "allocation" else 1


if __name__ == "__main__":
    sys.exit(main())
