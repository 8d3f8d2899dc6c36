"""The spawner's pure parts alone: options validation (fuzzed), the batch script, Slurm's parsers, the callback body,
and the shared queue's one-query-per-interval."""
import asyncio
import re
import shlex

import pytest
from hypothesis import given, settings, strategies as st

from jupyter_hpcdl.spawner.api import parse_callback
from jupyter_hpcdl.commands import Result
from jupyter_hpcdl.spawner.commands import as_user
from jupyter_hpcdl.batchsystems.gridengine import GridEngine
from jupyter_hpcdl.spawner.orphans import JobMark
from jupyter_hpcdl.spawner.options import FIELDS, OptionsError, request_to_options, validate_options
from jupyter_hpcdl.spawner.profile import Image, Partition, Profile, parse_walltime
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.batchsystems.scheduler import ENDED, PENDING, RUNNING
from jupyter_hpcdl.spawner.script import ScriptContext, build_batch_script
from jupyter_hpcdl.batchsystems.slurm import Slurm

PROFILE = Profile(
    partitions={"gpu": Partition("gpu", max_nodes=2, max_gpus_per_node=4, max_walltime=240),
                "big": Partition("big", max_nodes=1, max_gpus_per_node=8, max_walltime=60, max_memory_gb=512),
                "a100": Partition("a100", max_nodes=4, max_gpus_per_node=8, max_walltime=60, gpu_types=("a100",))},
    images={"base": Image("base", "hpcdl/base:latest", "TF"), "tf216": Image("tf216", "hpcdl/tf:2.16")},
    accounts={"*": ("hpcdl",), "alice": ("hpcdl", "alice-project")})
CTX = ScriptContext(python="/opt/venv/bin/python", output="/home/alice/.jupyter-hpcdl/jobs/%j.log", workdir="/home/alice",
                    listen_ip="127.0.0.1", comment=JobMark("testhub", "alice", "my gpu/1").comment(),
                    singleuser_cmd=("/opt/venv/bin/jupyterhub-singleuser", "--debug"))


def test_form_values_become_a_typed_request():
    req = validate_options({"partition": ["gpu"], "nodes": ["2"], "gpus_per_node": ["3"], "walltime": ["01:30"],
                            "account": ["alice-project"], "image": ["tf216"]}, PROFILE, "alice")
    assert (req.partition, req.nodes, req.gpus_per_node, req.walltime_minutes, req.account, req.image_ref) == \
        ("gpu", 2, 3, 90, "alice-project", "hpcdl/tf:2.16")
    assert req.gpu_hours == 9.0
    assert validate_options(request_to_options(req), PROFILE, "alice") == req


def test_defaults_fill_what_is_not_given():
    req = validate_options({}, PROFILE, "bob")
    assert (req.partition, req.nodes, req.gpus_per_node, req.walltime, req.account, req.image) == \
        ("gpu", 1, 1, "01:00:00", "hpcdl", "base")


@pytest.mark.parametrize("raw,message", [
    ({"nodes": 3}, r"nodes: 3 is out of range; allowed: 1 to 2"),
    ({"nodes": "1; rm -rf ~"}, r"nodes: a whole number from 1 to 2"),
    ({"nodes": True}, r"nodes: a whole number"),
    ({"gpus_per_node": 0}, r"gpus_per_node: 0 is out of range; allowed: 1 to 4"),
    ({"partition": "debug"}, r"partition: 'debug' is not offered; choose one of: gpu, big, a100"),
    ({"partition": "big", "memory_gb": 600}, r"memory_gb: 600 is out of range; allowed: 1 to 512"),
    ({"memory_gb": 8}, r"memory_gb: partition gpu takes no memory request"),
    ({"walltime": "05:00:00"}, r"walltime: 05:00:00 is longer than partition gpu allows \(04:00:00\)"),
    ({"walltime": "1:00\n#SBATCH --uid=0"}, r"walltime: walltime must be HH:MM"),
    ({"account": "bobs-project"}, r"account: 'bobs-project' is not offered; choose one of: hpcdl, alice-project"),
    ({"image": "docker.io/evil"}, r"image: 'docker.io/evil' is not offered; choose one of: base, tf216"),
    ({"cmd": ["/bin/sh"]}, r"unknown option\(s\) cmd; allowed: partition"),
    ({"gpu_type": "a100"}, r"gpu_type: partition gpu has no GPU types"),
    ({"partition": "a100", "gpu_type": "h100"}, r"gpu_type: 'h100' is not offered; choose one of: a100"),
    ({"nodes": ["1", "2"]}, r"nodes: give exactly one value"),
])
def test_each_bad_value_says_what_is_allowed(raw, message):
    with pytest.raises(OptionsError, match=message):
        validate_options(raw, PROFILE, "alice")


def test_walltime_forms():
    assert [parse_walltime(v) for v in ("30", "0:30", "1:00:00", "1-02:00:00", 45, "0:00:30")] == [30, 30, 60, 1560, 45, 1]
    for bad in ("0", "1:75", "abc", "1:00:00:00", "-5", True):
        with pytest.raises(ValueError):
            parse_walltime(bad)


def test_script_is_exact_and_carries_no_secret():
    req = validate_options({"nodes": 2, "gpus_per_node": 2, "walltime": "02:00:00", "account": "alice-project"},
                           PROFILE, "alice")
    script = build_batch_script(req, Slurm(), CTX)
    assert script == """#!/bin/bash
#SBATCH --job-name=jupyterhub-hpcdl
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --time=02:00:00
#SBATCH --output=/home/alice/.jupyter-hpcdl/jobs/%j.log
#SBATCH --chdir=/home/alice
#SBATCH --no-requeue
#SBATCH --account=alice-project
#SBATCH --comment=jupyterhub-hpcdl:testhub:alice:my%20gpu%2F1
# jupyter-hpcdl: JupyterLab on the first node; kernels in the udocker image hpcdl/base:latest
# 2 node(s) x 2 GPU(s) for 02:00:00: 8 GPU-hours
set -eu
export HPCDL_JOB_ID="${SLURM_JOB_ID:-}" HPCDL_NODE="${SLURMD_NODENAME:-}"
exec /opt/venv/bin/python -m jupyter_hpcdl.job.server --image=hpcdl/base:latest --listen-ip=127.0.0.1 -- /opt/venv/bin/jupyterhub-singleuser --debug
"""
    assert "TOKEN" not in script.upper()


def test_memory_defaults_to_the_partitions_limit_and_goes_into_mem():
    req = validate_options({"partition": "big"}, PROFILE, "alice")
    assert req.memory_gb == 512 and "#SBATCH --mem=512G" in build_batch_script(req, Slurm(), CTX)
    req = validate_options({"partition": "big", "memory_gb": "64"}, PROFILE, "alice")
    assert "#SBATCH --mem=64G" in build_batch_script(req, Slurm(), CTX)
    assert validate_options(request_to_options(req), PROFILE, "alice") == req


def test_gpu_type_goes_into_gres():
    req = validate_options({"partition": "a100", "gpu_type": "a100", "gpus_per_node": 8}, PROFILE, "alice")
    assert "#SBATCH --gres=gpu:a100:8" in build_batch_script(req, Slurm(), CTX)


def test_a_partition_without_gpus_takes_none_and_asks_for_no_gres():
    profile = Profile(partitions={"cpu": Partition("cpu", max_nodes=1, max_gpus_per_node=0, max_walltime=60)},
                      images=PROFILE.images)
    req = validate_options({}, profile, "alice")
    assert req.gpus_per_node == 0 and req.gpu_hours == 0
    script = build_batch_script(req, Slurm(), CTX)
    assert "--gres" not in script and "#SBATCH --ntasks-per-node=1" in script
    with pytest.raises(OptionsError, match="allowed: 0 to 0"):
        validate_options({"gpus_per_node": 1}, profile, "alice")
    with pytest.raises(OptionsError, match="allowed: 1 to 4"):
        validate_options({"gpus_per_node": 0}, PROFILE, "alice")


SAFE = re.compile(r"^#SBATCH --[a-z-]+(=[A-Za-z0-9_.:/%-]+)?$")
SAFE_SGE = re.compile(r"^#\$ -[A-Za-z]+( [A-Za-z0-9_.:/%$=,-]+)?$")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS + ("cmd", "exec_prefix", "x")),
                       st.one_of(st.text(max_size=30), st.integers(-5, 500), st.booleans(), st.none(),
                                 st.lists(st.text(max_size=10), max_size=3), st.floats(allow_nan=True)),
                       max_size=6))
def test_fuzzed_options_never_reach_the_script_unvalidated(raw):
    try:
        req = validate_options(raw, PROFILE, "alice")
    except OptionsError:
        return
    script = build_batch_script(req, Slurm(), CTX)
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            assert SAFE.match(line), line
    assert script.count("\n") == 15 + bool(req.account) + bool(req.memory_gb) + bool(req.gpus_per_node)
    assert shlex.split(script.splitlines()[-1])[0] == "exec"
    for line in build_batch_script(req, GridEngine(), CTX).splitlines()[1:]:
        if line.startswith("#$"):
            assert SAFE_SGE.match(line), line


def test_submit_and_cancel_argv_carry_names_not_values():
    assert Slurm().submit_argv(["HOME", "JUPYTERHUB_API_TOKEN"]) == [
        "sbatch", "--parsable", "--export=HOME,JUPYTERHUB_API_TOKEN"]
    assert Slurm().cancel_argv("42") == ["scancel", "42"]
    assert as_user(["sudo", "-n", "-u", "{username}"], "alice", ["A", "B"]) == [
        "sudo", "-n", "-u", "alice", "--preserve-env=A,B", "--"]


def test_slurm_parsers():
    s = Slurm()
    assert s.parse_submit("123\n") == "123" and s.parse_submit("77;cluster\n") == "77"
    with pytest.raises(ValueError, match="no job id"):
        s.parse_submit("sbatch: error: Batch job submission failed")
    jobs = s.parse_queue("12|PENDING|Resources|2026-11-29T20:00:00|n/a|alice\n13|RUNNING|None|2026-11-29T19:00:00|node1|bob\n"
                         "14|COMPLETING|None|N/A|node2|bob\n15|CANCELLED|None|N/A|node1|bob\n12_3|RUNNING|None|N/A|x|y\n"
                         "short|line\n")
    assert (jobs["12"].phase, jobs["12"].reason, jobs["12"].expected_start, jobs["12"].batch_host) == \
        (PENDING, "Resources", "2026-11-29T20:00:00", "")
    assert (jobs["13"].phase, jobs["13"].batch_host, jobs["14"].phase, jobs["15"].phase) == (RUNNING, "node1", RUNNING, ENDED)
    assert (jobs["12"].user, jobs["13"].user) == ("alice", "bob") and set(jobs) == {"12", "13", "14", "15"}
    assert "%k" not in "".join(s.queue_argv()) and "%j" not in "".join(s.queue_argv())  # nothing a user writes
    assert s.parse_job_ids("41\n42\n4x\n43_1\n") == ["41", "42"]
    assert s.job_forgotten("slurm_load_jobs error: Invalid job id specified")
    assert not s.job_forgotten("slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    ended = s.parse_job("JobId=15 JobName=x UserId=alice(1001) JobState=FAILED Reason=NonZeroExitCode "
                        "Dependency=(null) ExitCode=1:0 BatchHost=node1 StartTime=2026-11-29T19:00:00")
    assert (ended.phase, ended.state, ended.reason, ended.exit_code) == (ENDED, "FAILED", "NonZeroExitCode", "1:0")
    assert s.parse_job("slurm_load_jobs error: Invalid job id specified") is None
    avail = s.parse_availability("gpu |node1 |idle |gpu:4 |gpu:0 \ngpu |node2 |mixed |gpu:4 |gpu:3(IDX:0-2) \n"
                                 "gpu |node3 |down* |gpu:4 |gpu:0 \n")
    a = avail["gpu"]
    assert (a.nodes, a.idle_nodes, a.gpus, a.idle_gpus) == (3, 1, 12, 5)


@pytest.mark.parametrize("body", [{}, {"port": "8888"}, {"port": 0}, {"port": 70000}, {"port": True}, [8888],
                                  {"port": 8888, "ip": "10.0.0.1"}, {"port": 8888, "batch_cancel_cmd": "id"}, None])
def test_callback_accepts_only_a_port(body):
    with pytest.raises(ValueError):
        parse_callback(body)


def test_callback_port():
    assert parse_callback({"port": 8888}) == 8888


def test_one_scheduler_query_per_interval_for_a_thousand_servers():
    calls = []

    async def runner(argv, **kw):
        calls.append(argv[0])
        await asyncio.sleep(0.01)
        lines = "".join(f"{i}|RUNNING|None|N/A|node1|u\n" for i in range(1000))
        return Result(tuple(argv), 0, lines, "")

    async def scenario():
        q = JobQueue(Slurm(), interval=60, runner=runner)
        infos = await asyncio.gather(*(q.job(str(i)) for i in range(1000)))
        again = await asyncio.gather(*(q.job(str(i)) for i in range(1000)))
        return q, infos, again

    q, infos, again = asyncio.run(scenario())
    assert all(i.phase == RUNNING for i in infos + again)
    assert calls == ["squeue"] and q.queries == 1


def _take(port: int, ip: str) -> str | None:
    """What a neighbour gets trying to serve on ``port``: None when it could listen there, else the error."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((ip, port))
            s.listen()
        except OSError as e:
            return str(e)
    return None


def test_the_port_is_the_servers_from_the_moment_the_job_chooses_it(tmp_path):
    """The job listens on the port before it tells the hub, and the server accepts on that socket: at no moment can
    another process (here with SO_REUSEADDR and SO_REUSEPORT, as root) listen there, and the server answers."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    import psutil

    from jupyter_hpcdl.job.server import hold_port, route_address

    held = hold_port("127.0.0.1")
    port = held.getsockname()[1]
    assert held.get_inheritable() and held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    for _ in range(200):  # no other process asking for a free port is given it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            assert s.getsockname()[1] != port
    assert _take(port, "127.0.0.1") and _take(port, "0.0.0.0"), "a neighbour could listen on the job's port"
    token = "t" * 32
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_", "HPCDL_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.jpserver_extensions={'jupyter_hpcdl.job.serverext': True}"],
        pass_fds=[held.fileno()], env={**env, "HPCDL_HELD_PORT_FD": str(held.fileno())},
        stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT)
    held.close()  # the server's copy alone holds the port now
    try:
        deadline = time.monotonic() + 60
        while True:
            assert _take(port, "127.0.0.1") and _take(port, "0.0.0.0"), "the port was free while the server started"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.2)
        listening = [c.laddr.port for c in psutil.Process(proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening == [port], f"the server listens on {listening}, not only on the job's socket"
        assert _take(port, "127.0.0.1") and _take(port, "0.0.0.0")
        assert "the server stops" not in (tmp_path / "server.log").read_text()
    finally:
        proc.terminate()
        proc.wait(60)
    assert route_address("http://127.0.0.1:8081/hub/api") == "127.0.0.1"


def test_a_server_given_a_socket_it_cannot_serve_on_stops_and_says_why(tmp_path):
    """Fail closed: a held socket that is not listening is not quietly replaced by a port of the server's own."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_", "HPCDL_"))}
        r = subprocess.run(
            [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1",
             f"--port={bound.getsockname()[1]}", "--allow-root", f"--ServerApp.root_dir={tmp_path}",
             "--ServerApp.jpserver_extensions={'jupyter_hpcdl.job.serverext': True}"],
            pass_fds=[bound.fileno()], env={**env, "HPCDL_HELD_PORT_FD": str(bound.fileno())},
            capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "is not listening" in r.stderr and "the server stops" in r.stderr, r.stderr[-2000:]


class _FormFields(__import__("html.parser").parser.HTMLParser):
    """What a browser submits from the form as rendered: each enabled field's selected or given value."""

    def __init__(self):
        super().__init__()
        self.values, self._select = {}, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "input" and a.get("name"):
            self.values[a["name"]] = a.get("value", "")
        elif tag == "select":
            self._select = a["name"]
        elif tag == "option" and self._select and ("selected" in a or self._select not in self.values):
            self.values[self._select] = a["value"]

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None


@pytest.mark.parametrize("partition", ["a100", "big", "gpu"])
def test_the_form_offers_every_field_and_what_it_shows_is_accepted(partition):
    """One profile that uses every field (GPU types, memory, accounts): the form has an input for each field the
    validation knows, and the defaults it shows for each partition, submitted, are a valid request."""
    from jupyter_hpcdl.spawner.form import render_form

    req = validate_options({"partition": partition}, PROFILE, "alice")
    page = render_form(PROFILE, "alice", {}, {"script": "", "gpu_hours": 0}, request_to_options(req), "/preview")
    fields = _FormFields()
    fields.feed(page)
    assert set(fields.values) == set(FIELDS), "the form's fields and the validation's are two lists"
    shown = dict(fields.values, partition=partition)
    if not PROFILE.partitions[partition].gpu_types:
        shown.pop("gpu_type")  # the form disables it for such a partition: it is not sent
    if not PROFILE.partitions[partition].max_memory_gb:
        shown.pop("memory_gb")  # disabled likewise
    assert validate_options(shown, PROFILE, "alice").partition == partition
    if partition == "a100":
        assert req.gpu_type == "a100" and fields.values["gpu_type"] == "a100", "a typed partition's default type"
