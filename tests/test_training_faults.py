"""Training never hangs and never leaks (local ranks): a stopped rank is reported within the bound and the world
ends, Stop and calls end even when a rank hangs, the rendezvous answers only with the session's secret and only on
loopback, the controller's files are private, and a killed kernel leaves nothing running."""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import cloudpickle
import psutil
import pytest

from jupyter_hpcdl.training import RankError, TrainingSession
from jupyter_hpcdl.training.watchdog import stall_message, suspects

import workloads
from workloads import digits_loss, digits_model, digits_shard

pytest.importorskip("horovod.tensorflow.keras")
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(workloads)


def _request(method: str, url: str, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# -- pure ------------------------------------------------------------------------------------------------------------
def test_stall_message_names_the_rank_that_holds_the_others():
    world = [{"rank": 0, "node": "node1"}, {"rank": 1, "node": "node2"}]
    latest = {0: {"epoch": 2, "batch": 20}, 1: {"epoch": 2, "batch": 15}}
    assert suspects(world, latest, {}) == [1]
    assert suspects(world, latest, {0: "stopped (SIGSTOP?)", 1: "sleeping"}) == [0]
    assert suspects(world, {0: {"epoch": 1, "batch": 5}, 1: {"epoch": 1, "batch": 5}}, {}) == []
    msg = stall_message("fit", 61, "stall_timeout", world, latest, {1: "stopped (SIGSTOP?)"})
    assert msg.startswith("fit made no progress for 61 s (stall_timeout): rank(s) 1 held the others up.")
    assert "rank 1 (node2): last at epoch 2 batch 15, process stopped (SIGSTOP?)" in msg and "recover(" in msg
    assert "first batch" not in msg
    # nothing stopped and no batch yet: the first batch's own time may be what ran out, and the message says so
    first = stall_message("fit", 61, "stall_timeout", world, {}, {0: "running", 1: "running"})
    assert "no batch reported yet" in first and "TrainingSession(stall_timeout=...)" in first, first
    assert "first batch" not in stall_message("fit", 61, "stall_timeout", world, {}, {1: "stopped (SIGSTOP?)"})


def test_rendezvous_needs_the_secret_and_listens_on_one_address():
    from jupyter_hpcdl.backends.horovod.rendezvous import FORBIDDEN, SessionRendezvous

    rv = SessionRendezvous(bind="127.0.0.1")
    port = rv.start()
    try:
        listening = [c for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [c.laddr.ip for c in listening] == ["127.0.0.1"], listening
        base = f"http://127.0.0.1:{port}"
        assert _request("PUT", f"{base}/global/0", b"x") == FORBIDDEN  # what anyone on the machine could send
        assert _request("GET", f"{base}/global/0") == FORBIDDEN
        assert _request("PUT", f"{base}/not-the-secret:{port}/global/0", b"x") == FORBIDDEN
        assert _request("DELETE", f"{base}/global/0") == FORBIDDEN
        # what Horovod's client sends with HOROVOD_GLOO_RENDEZVOUS_ADDR = rank_address(), PORT = port
        prefix = f"http://{rv.rank_address('127.0.0.1')}:{port}"
        assert _request("PUT", f"{prefix}/global/0", b"x") == 200
        assert _request("GET", f"{prefix}/global/0") == 200
    finally:
        rv.stop()


# -- real ranks ------------------------------------------------------------------------------------------------------
def _engine_pids(session) -> dict[int, int]:
    return {int(w["rank"]): int(w["pid"]) for w in session.world}


def _fit_in_thread(session, epochs: int = 500, **fit_options):
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            box["result"] = session.fit(epochs=epochs, **fit_options)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            box["error"] = e
        box["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _wait_for_batches(session, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(session.metrics) > 4:
            return
        time.sleep(0.2)
    raise AssertionError("the ranks never started training")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ended, reaped meanwhile
        return False


def _gone(pids, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


@pytest.mark.timing
@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_stopped_rank_is_reported_within_the_bound_and_the_world_ends():
    with TrainingSession(ranks=2, stall_timeout=20) as s:
        s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.05, batch_size=16)
        pids = _engine_pids(s)
        thread, box = _fit_in_thread(s)
        _wait_for_batches(s)
        stopped_at = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        thread.join(120)
        assert not thread.is_alive(), "fit still waits on a stopped rank"
        took = time.monotonic() - stopped_at
        assert isinstance(box.get("error"), RankError), box
        message = str(box["error"])
        print(f"reported after {took:.1f} s: {message}")
        # the deadline the session applied, as it says (stall_timeout stretched to 3 step times on a slow machine),
        # or the controller's heartbeat (ipyparallel: 10 missed beats of 3 s); then the world is ended by force
        applied = re.search(r"stall_timeout, (\d+) s at this step time", message)
        bound = (int(applied.group(1)) if applied else 30) + 10
        assert took < bound, f"reported after {took:.0f} s (bound {bound} s): {message}"
        assert re.search(r"rank\(s\) 1 (held the others up|died during fit)", message), message
        assert not s.world and _gone(pids.values()) == [], "the world's engines are still running"


@pytest.mark.timing
@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_stop_and_calls_end_even_when_a_rank_hangs():
    with TrainingSession(ranks=2, stop_grace=5) as s:
        s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.05, batch_size=16)
        pids = _engine_pids(s)
        # the ranks look for a Stop every 4 batches: the grace stretched by slow steps (2 x 4 step times) stays well
        # under the controller's heartbeat timeout (about 30 s), so it is Stop's deadline that ends this world
        thread, box = _fit_in_thread(s, stop_check_every=4)
        _wait_for_batches(s)
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        s.stop_training()
        thread.join(120)
        took = time.monotonic() - t0
        assert not thread.is_alive(), "fit still waits on a rank that does not stop"
        message = str(box.get("error"))
        assert "Stop made no progress for" in message and "rank(s) 0" in message, message
        # the documented deadline: stop_grace, stretched by slow steps to 2 x stop_check_every step times as
        # measured while it ran (on a loaded CI machine the first steps can take most of a second);
        # the message names both. Then the world ends (its engines killed; ipyparallel gives each process of the
        # controller and engines up to 5 s after SIGTERM)
        said = re.search(r"made no progress for (\d+) s \(stop_grace, (\d+) s at this step time", message)
        assert said, message
        waited, grace = int(said.group(1)), int(said.group(2))
        assert 5 <= grace and waited <= grace + 2, message
        assert took - waited < 20, (took, message)
        assert _gone(pids.values()) == []
        # a call to a hung rank ends too, naming it
        s.start()
        s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.05, batch_size=16)
        pids = _engine_pids(s)
        # a short deadline for the calls from here on: the build above, on fresh ranks of a loaded machine, may take
        # longer (call_timeout is read at each call)
        s.call_timeout = 5
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"shard_size did not finish in 5 s on rank\(s\) 1"):
            s.shard_sizes()
        assert time.monotonic() - t0 < 5 + 15 and _gone(pids.values()) == []


@pytest.mark.ranks
def test_controller_files_are_private_and_it_listens_on_loopback():
    with TrainingSession(ranks=2) as s:
        security = Path(s._rankworld.cluster.profile_dir, "security")
        mine = list(security.glob(f"*{s._rankworld.cluster.cluster_id}*.json"))
        assert mine, list(security.iterdir())
        assert security.stat().st_mode & 0o077 == 0, "the connection files' directory is open to others"
        with_key = [f for f in mine if json.loads(f.read_text()).get("key")]
        assert {f.name.rsplit("-", 1)[-1] for f in with_key} == {"client.json", "engine.json"}, mine
        for f in with_key:  # the cluster file (ipcluster's bookkeeping) holds no key
            assert f.stat().st_mode & 0o077 == 0, f"{f} is readable by others: {oct(f.stat().st_mode)}"
        kernel = psutil.Process()
        listeners = [c for p in kernel.children(recursive=True) for c in _listening(p)]
        assert listeners and {c.laddr.ip for c in listeners} == {"127.0.0.1"}, listeners


def _listening(p: psutil.Process):
    try:
        return [c for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


KERNEL = """
import sys, time
sys.path.insert(0, {tests!r})
from jupyter_hpcdl.training import TrainingSession
s = TrainingSession(ranks=2)
s.start()
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_a_killed_kernel_leaves_nothing_running(tmp_path):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL.format(tests=str(Path(__file__).parent))],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert kernel.stdout.readline().strip() == "READY"
        tree = psutil.Process(kernel.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "ipyparallel" in names or "ipcontroller" in names, names
        assert "jupyter_hpcdl.training.reaper" in names
        kernel.kill()
        kernel.wait(10)
        left = _gone([p.pid for p in tree], timeout=60)
        assert not left, [" ".join(psutil.Process(p).cmdline()) for p in left if psutil.pid_exists(p)]
    finally:
        if kernel.poll() is None:
            kernel.kill()





ALICE_SESSION = """
import json, sys
from jupyter_hpcdl.training import TrainingSession
s = TrainingSession(ranks=2)
s.start()
c = s._rankworld.cluster
print(json.dumps({"rendezvous": s._rankworld.rendezvous.port,
                  "client_file": f"{c.profile_dir}/security/ipcontroller-{c.cluster_id}-client.json"}), flush=True)
sys.stdin.readline()
s.close()
"""

BOB_PROBE = """
import json, sys, urllib.error, urllib.request
import ipyparallel as ipp
info = json.loads(sys.argv[1])
out = {}
req = urllib.request.Request(f"http://127.0.0.1:{info['rendezvous']}/global/0", data=b"x", method="PUT")
try:
    out["rendezvous"] = urllib.request.urlopen(req, timeout=5).status
except urllib.error.HTTPError as e:
    out["rendezvous"] = e.code
try:
    open(info["client_file"]).read()
    out["read_connection_file"] = True
except OSError as e:
    out["read_connection_file"] = type(e).__name__
forged = info["connection"]  # the controller's ports, as anyone sees them listening, and a key of bob's own
forged["key"] = "not-alices-key"
with open(sys.argv[2], "w") as f:
    json.dump(forged, f)
try:
    ipp.Client(sys.argv[2], timeout=8).close()
    out["controller"] = "answered"
except Exception as e:
    out["controller"] = type(e).__name__
print(json.dumps(out))
"""


@pytest.mark.testbed
@pytest.mark.stream("rest")  # local ranks as alice, no scheduler
@pytest.mark.timeout(300)
def test_bob_cannot_use_alices_session(alice, bob):
    env = alice.env()
    session = subprocess.Popen(["runuser", "-u", "alice", "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                                f"{alice.bed['venv']}/bin/python", "-c", ALICE_SESSION], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=alice.home)
    try:
        info = json.loads(session.stdout.readline())
        connection = json.loads(Path(info["client_file"]).read_text())  # root reads it, to hand bob the ports only
        listening = [c for p in psutil.Process(session.pid).children(recursive=True) for c in _listening(p)]
        assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}, listening
        forged_file = Path(tempfile.mkdtemp(prefix="hpcdl-bob-")) / "forged.json"
        shutil.chown(forged_file.parent, "bob")
        probe = {**info, "connection": {k: v for k, v in connection.items() if k != "key"}}
        r = bob.run(f"{bob.bed['venv']}/bin/python", "-c", BOB_PROBE, json.dumps(probe), str(forged_file), timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["rendezvous"] == 403
        assert seen["read_connection_file"] == "PermissionError"
        assert seen["controller"] == "TimeoutError", seen
        # the same client with alice's own key is answered: the refusal is the key's doing
        forged_file.write_text(json.dumps(connection))
        import ipyparallel as ipp
        ipp.Client(str(forged_file), timeout=15).close()
        shutil.rmtree(forged_file.parent)
    finally:
        session.stdin.write("\n")
        session.stdin.flush()
        session.wait(60)


def shard_failing_on_rank_1(rank, size):
    if rank == 1:
        raise FileNotFoundError("/data/shard-1.npz")
    return digits_shard(rank, size)


@pytest.mark.timing
@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_one_rank_failing_to_build_fails_setup_at_once_on_every_rank():
    """setup() holds a collective (the agreed steps); a rank whose data fails still joins it, so nobody waits."""
    call_timeout = 120
    with TrainingSession(ranks=2, call_timeout=call_timeout) as s:
        t0 = time.monotonic()
        with pytest.raises(RankError) as e:
            s.setup(digits_model, shard_failing_on_rank_1, loss=digits_loss, lr=0.05, batch_size=16)
        took = time.monotonic() - t0
        assert took < call_timeout, f"setup took {took:.0f} s: it waited for the failed rank until call_timeout"
        message = str(e.value)
        assert "rank 1: FileNotFoundError: /data/shard-1.npz" in message, message
        assert "rank 0: RuntimeError: another rank could not build" in message, message
        s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.05, batch_size=16)  # the world is still good
        assert s.fit(epochs=1).epochs_done == 1


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_the_clock_stops_a_fit_before_the_walltime_and_checkpoints(tmp_path, capsys):
    """The scheduler's time left (here: 100 s, against a margin of 150 s) stops the ranks at an agreed batch; the
    session checkpoints and says so, and the checkpoint resumes in a new world."""
    with TrainingSession(ranks=2, walltime_margin=150, checkpoint_dir=str(tmp_path)) as s:
        s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.05, batch_size=16)
        s.fit(epochs=1)
        s.time_left = lambda: 100.0  # what squeue would say near the end of the job
        result = s.fit(epochs=100000)
        assert result.stopped.startswith("Stopped before the walltime ends (the scheduler says 100 s"), result.stopped
        assert s.walltime_checkpoint and os.path.exists(s.walltime_checkpoint)
        assert s.walltime_checkpoint in result.stopped and "continue_in_new_allocation" in capsys.readouterr().err
        assert result.epochs_done >= 1
        s.time_left = lambda: None
        restored = s.recover(s.walltime_checkpoint)
        assert {r["epochs_done"] for r in restored} == {result.epochs_done}
