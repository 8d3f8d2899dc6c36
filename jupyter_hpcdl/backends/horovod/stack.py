"""The doctor's view of the Horovod stack in an image (runs on the hub host, and ``PROBE_SCRIPT`` in a container of
the image): which TensorFlow and Horovod it has, whether Horovod loads with that TensorFlow, and what is wrong."""
from __future__ import annotations

from typing import Sequence

from ..base import StackFinding
from .hvd import keras_problem

KNOWN_TF = ((2, 15), (2, 18))  # TensorFlow releases Horovod 0.28.1 builds against as is (docs/admin.md)

# Runs in the container: what the kernel side needs, and whether Horovod loads with this TensorFlow.
PROBE_SCRIPT = r"""
import importlib.metadata as m, json, os, sys
out = {"python": "%d.%d.%d" % sys.version_info[:3], "tf_use_legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS"),
       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
for name in ("jupyter-hpcdl", "tensorflow", "tensorflow-cpu", "horovod", "ipykernel", "ipyparallel"):
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
try:
    import horovod.tensorflow  # loads Horovod's TensorFlow ops: fails when built against another TensorFlow
    out["horovod_tf_error"] = ""
except Exception as e:
    out["horovod_tf_error"] = (type(e).__name__ + ": " + str(e))[:400]
print("HPCDL-VERSIONS " + json.dumps(out))
"""


def pinned_version(requirements: Sequence[str]) -> str | None:
    """The Horovod release in jupyter-hpcdl's requirements (``horovod==X``), or None."""
    pin = None
    for req in requirements:
        if req.replace(" ", "").startswith("horovod=="):
            pin = req.replace(" ", "").split("==", 1)[1].split(";", 1)[0]
    return pin


def assess_stack(v: dict, ref: str, pinned: str | None) -> list[StackFinding]:
    """What is wrong with TensorFlow and Horovod in image ``ref`` (``v``: the probe's versions)."""
    out = []
    tf = v.get("tensorflow") or v.get("tensorflow-cpu")
    if not tf:
        out.append(StackFinding("fail", f"{ref} has no TensorFlow", "install tensorflow (or "
                                "tensorflow-cpu) in the image"))
    else:
        major_minor = tuple(int(x) for x in tf.split(".")[:2])
        problem = keras_problem(tf, v.get("tf_use_legacy_keras"))
        if problem:
            out.append(StackFinding("fail", f"{ref}: {problem}", "use TensorFlow 2.15 or add tf-keras "
                                    "and TF_USE_LEGACY_KERAS=1"))
        elif not KNOWN_TF[0] <= major_minor <= KNOWN_TF[1]:
            out.append(StackFinding("warn", f"{ref} has TensorFlow {tf}, outside what Horovod 0.28.1 is "
                                    f"known to build against ({'.'.join(map(str, KNOWN_TF[0]))}–"
                                    f"{'.'.join(map(str, KNOWN_TF[1]))})", "prefer a TensorFlow in that range"))
    hvd = v.get("horovod")
    if not hvd:
        out.append(StackFinding("fail", f"{ref} has no Horovod", f"build horovod=={pinned} "
                                "against the image's TensorFlow (HOROVOD_WITH_TENSORFLOW=1) and install it"))
    else:
        if pinned and hvd != pinned:
            out.append(StackFinding("warn", f"{ref} has Horovod {hvd}, jupyter-hpcdl is tested with "
                                    f"{pinned}", f"install horovod=={pinned}"))
        if v.get("horovod_tf_error"):
            out.append(StackFinding("fail", f"{ref}: Horovod does not load with TensorFlow {tf}: "
                                    f"{v['horovod_tf_error']}", "rebuild Horovod in the image against its TensorFlow "
                                    "(pip install --no-build-isolation --no-cache-dir horovod)"))
    return out


def stack_summary(v: dict) -> str:
    return f"TensorFlow {v.get('tensorflow') or v.get('tensorflow-cpu')}, Horovod {v.get('horovod')} (loads)"
