"""The public face of :class:`TrainingSession`, as notebooks, docs/training.md and the dashboard use it: every
public method and property with its arguments and defaults, the attributes a session has once made, and which of them
carry a docstring. The session is a façade over its parts; moving work between them must not change this."""
import inspect

import pytest

from jupyter_hpcdl.training import TrainingSession

#: Each public method (its arguments and defaults, annotations left out) and property.
API = {
    "__enter__": "(self)",
    "__exit__": "(self, *exc)",
    "__init__": "(self, ranks=None, iface=None, tf_threads=1, env=None, engine_cmd=None, start_timeout=120, "
                "where='auto', image=None, controller_ip=None, containers=False, new_allocation=None, world='gloo', "
                "stall_timeout=60, call_timeout=600, stop_grace=30, walltime_margin=300, "
                "checkpoint_dir='~/.jupyter-hpcdl/checkpoints', backend=None)",
    "alive": "property",
    "batch_size": "property",
    "user_optimizer": "property",
    "batches_per_epoch": "property",
    "checkpoint": "(self, path)",
    "close": "(self)",
    "continue_in_new_allocation": "(self, new_allocation=None, checkpoint=None, ranks=None)",
    "dead_ranks": "(self)",
    "epoch_metrics": "property",
    "fit": "(self, epochs=1, publish_every=5, on_metrics=None, poll=0.1, stop_check_every=20, publish_interval=0.1)",
    "has_model": "property",
    "job_id": "property",
    "metrics": "property",
    "owner_socket": "property",
    "private_dir": "property",
    "rank_table": "(self)",
    "recover": "(self, checkpoint, ranks=None, batch_size=None)",
    "rescale": "(self, ranks, batch_size=None)",
    "resume": "(self, path)",
    "run": "(self, fn, *args, **kwargs)",
    "run_cell": "(self, code, timeout=None)",
    "run_script": "(self, path, args=(), on_metrics=None, echo=True, first_batch_timeout=None, poll=0.1)",
    "scaling": "(self, ranks, epochs=1, mode='strong', csv=None, plot=None, on_step=None, on_metrics=None, "
               "restore=True)",
    "seed": "property",
    "set_lr": "(self, lr)",
    "setup": "(self, model_fn, data, loss=None, metrics=(), lr=None, batch_size=32, *, validation_data=None, "
             "callbacks=(), seed=None, scale_lr=False, shuffle=True, steps_per_epoch=None)",
    "shard_sizes": "(self)",
    "start": "(self)",
    "stop_training": "(self)",
    "stragglers": "(self, factor=1.5)",
    "time_left": "(self)",
    "weights_digest": "(self)",
}

#: What a new session holds (``mode`` comes with ``start()``), with its value where it does not depend on the machine.
ATTRIBUTES = {"backend": None, "built": [], "call_timeout": 600, "checkpoint_dir": None, "controller_ip": None, "engine_cmd": None,
              "env": {"TF_CPP_MIN_LOG_LEVEL": "2", "HPCDL_TF_THREADS": "1"}, "epochs_done": 0, "id": None,
              "iface": None, "image": None, "metrics_table": None, "new_allocation": None, "ranks": None, "spec": None,
              "stall_timeout": 60, "start_timeout": 120, "state": "none", "stop_file": None, "stop_grace": 30,
              "walltime_checkpoint": None, "walltime_margin": 300, "where": "auto", "world": [], "world_kind": "gloo"}

#: The public methods and properties without a docstring (the rest have one, as users see it in notebooks).
UNDOCUMENTED = {"__enter__", "__exit__", "batch_size", "owner_socket", "seed", "set_lr"}


def _shown(obj) -> str:
    if isinstance(obj, property):
        return "property"
    sig = inspect.signature(obj)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def _public() -> dict:
    names = [n for n in dir(TrainingSession) if not n.startswith("_") or n in ("__init__", "__enter__", "__exit__")]
    found = {n: inspect.getattr_static(TrainingSession, n) for n in names}
    return {n: obj for n, obj in found.items() if isinstance(obj, property) or inspect.isfunction(obj)}


def test_every_public_method_and_property_keeps_its_arguments_and_defaults():
    assert {n: _shown(obj) for n, obj in _public().items()} == API


def test_the_public_methods_and_properties_that_users_read_keep_a_docstring():
    assert {n for n, obj in _public().items() if not inspect.getdoc(obj)} == UNDOCUMENTED


@pytest.fixture
def session(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the session's private directory is made in the home
    monkeypatch.delenv("HPCDL_BACKEND", raising=False)  # the default backend, whatever the site names
    s = TrainingSession()
    yield s
    s.close()


def test_a_new_session_has_its_attributes_and_they_can_be_set(session):
    names = {n for n in dir(session) if not n.startswith("_")} - set(API)
    assert names == set(ATTRIBUTES)
    assert {n: getattr(session, n) for n, v in ATTRIBUTES.items() if v is not None or n in ("ranks", "spec")} == {
        n: v for n, v in ATTRIBUTES.items() if v is not None or n in ("ranks", "spec")}
    assert session.stop_file.startswith(session.private_dir) and len(session.id) == 32
    assert len(session.metrics) == 0 and session.rank_table() == [] and not session.alive and not session.has_model
    for name in ATTRIBUTES:  # plain attributes to the user, wherever a part keeps them
        value = object()
        setattr(session, name, value)
        assert getattr(session, name) is value, name
