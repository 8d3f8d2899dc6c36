"""Son of Grid Engine on the bed, beside Slurm: Debian's qmaster and two execution hosts on this one machine, with
GPUs as a consumable, parallel environments and the queues ``gpu`` and ``cpu`` (Slurm's partitions).

The first host is this machine under its own name. The second has a name and a loopback address of its own
(``config.SGE_SECOND_HOST``, in /etc/hosts): ``sge-hostaddr.c``, preloaded into its execd, gives the daemon and
its shepherds that name and binds their sockets to that address, so the qmaster, which names a host by the address
it hears from, sees two hosts (Grid Engine has one execd port for all hosts, so the first execd is bound to its own
address too). Jobs then span two hosts as on a cluster: ``$PE_HOSTFILE`` names both, ``$HOSTNAME`` is the host's,
and ``qrsh -inherit`` reaches either. The jobs' own processes are this machine's (its host name, its address),
which is all Grid Engine's clients in them need.

The daemons run in the foreground (``SGE_ND``), so the bed records their pids itself; the configuration is applied
with ``qconf`` from files, and only what differs is changed (a second ``up`` changes nothing). See
../shared/notes/gridengine.md for what was measured."""
from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import tempfile
from pathlib import Path

import config
from daemons import Daemon, wait_for

ROOT = Path("/var/lib/gridengine")
CELL = "default"
SPOOL = Path("/var/spool/gridengine")
CLIENT_ENV = {"SGE_ROOT": str(ROOT), "SGE_CELL": CELL}
ENV = {**CLIENT_ENV, "SGE_ND": "1"}  # the daemons stay in the foreground, so the bed records their pids
QUEUE = config.PARTITION  # the same names as Slurm's partitions, so the site profile carries over unchanged
QUEUES = (config.PARTITION, config.CPU_PARTITION)
PES = {"smp": "$pe_slots", **{config.SGE_PE_MULTI_NODE.format(gpus_per_node=n): str(n)
                               for n in range(1, config.GPUS_PER_NODE + 1)}}
SHIM_SOURCE = Path(__file__).parent / "sge-hostaddr.c"


def host() -> str:
    """This machine as Grid Engine names it (its resolver, with the cell's host aliases), which is what queue
    instances and $PE_HOSTFILE say; the plain host name where that tool fails."""
    try:
        out = client(["/usr/lib/gridengine/gethostname", "-aname"]).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or socket.gethostname()


def hosts() -> list[str]:
    """The execution hosts, the machine's own first."""
    return [host(), config.SGE_SECOND_HOST]


def address(name: str) -> str:
    """The address a host's execd binds and speaks from."""
    return config.SGE_SECOND_ADDR if name == config.SGE_SECOND_HOST else socket.gethostbyname(name)


def installed() -> bool:
    return Path("/usr/sbin/sge_qmaster").exists() and (ROOT / CELL / "common/bootstrap").exists()


def client(argv: list[str], timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
    """A Grid Engine client command for this cell (output captured, never waiting past ``timeout``)."""
    return subprocess.run(argv, text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, **CLIENT_ENV, **env})


def qconf(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = client(["qconf", *args], timeout=60, EDITOR="false")
    if check and proc.returncode:
        raise RuntimeError(f"qconf {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def answers() -> bool:
    try:
        return qconf("-sh", check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def daemons(state: Path) -> list[Daemon]:
    """The qmaster, then one execd per host."""
    qmaster = Daemon("sge_qmaster", ["/usr/sbin/sge_qmaster"], pidfile=state / "run/sge_qmaster.pid",
                     log=state / "log/sge_qmaster.out", env=ENV, ready=answers)
    return [qmaster, *execds(state)]


def execds(state: Path) -> list[Daemon]:
    first, second = hosts()
    shim = {"LD_PRELOAD": str(state / "sge/hostaddr.so")}
    return [
        Daemon("sge_execd", ["/usr/sbin/sge_execd"], pidfile=state / "run/sge_execd.pid",
               log=state / "log/sge_execd.out", env={**ENV, **shim, "HPCDL_SGE_HOST_ADDR": address(first)},
               ready=lambda: host_up(first)),
        Daemon(f"sge_execd-{second}", ["/usr/sbin/sge_execd"], pidfile=state / f"run/sge_execd-{second}.pid",
               log=state / f"log/sge_execd-{second}.out",
               env={**ENV, **shim, "HPCDL_SGE_HOST_ADDR": address(second), "HPCDL_SGE_HOST_NAME": second},
               ready=lambda: host_up(second)),
    ]


def host_up(host: str) -> bool:
    out = client(["qhost", "-h", host]).stdout
    return any(line.split()[:1] == [host] and line.split()[3:4] != ["-"] for line in out.splitlines())


def prepare(state: Path) -> bool:
    """What must be in place before the qmaster starts: clients on loopback are this host, not "localhost"; the
    second host's name in /etc/hosts and the shim that gives its execd that address; the GPU starter (Grid Engine
    binds no GPU itself) with each host's lock files."""
    write(ROOT / CELL / "common/host_aliases", f"{socket.gethostname()} localhost\n")
    name, addr = config.SGE_SECOND_HOST, config.SGE_SECOND_ADDR
    etc_hosts = Path("/etc/hosts")
    text = etc_hosts.read_text()
    if not any(line.split()[:1] == [addr] and name in line.split()[1:] for line in text.splitlines()):
        with etc_hosts.open("a") as f:
            f.write(("" if text.endswith("\n") or not text else "\n") + f"{addr} {name}\n")
    (state / "sge").mkdir(parents=True, exist_ok=True)
    (state / "sge").chmod(0o755)
    rebuilt = build_shim(state / "sge/hostaddr.so")
    locks = state / "sge/gpus"
    locks.mkdir(exist_ok=True)
    locks.chmod(0o1777)  # a job records its hosts here, for its tasks on the others
    for h in hosts():
        (locks / h).mkdir(exist_ok=True)
        (locks / h).chmod(0o1777)  # the jobs' users record which GPUs their jobs hold on this host here
        for i in range(config.GPUS_PER_NODE):
            (locks / h / f"gpu{i}.lock").touch(0o644)
    for h in hosts():
        (state / "sge/tmp" / h).mkdir(parents=True, exist_ok=True)
        (state / "sge/tmp" / h).chmod(0o1777)
    starter = state / "sge/gpu-starter.sh"
    if write(starter, (Path(__file__).parent / "sge-gpu-starter.sh").read_text()):
        starter.chmod(0o755)
    return rebuilt


def build_shim(target: Path) -> bool:
    """Compile sge-hostaddr.c into ``target`` when its source changed; return whether it did."""
    stamp = target.with_suffix(".sha256")
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()
    if target.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return False
    subprocess.run(["cc", "-O2", "-Wall", "-shared", "-fPIC", "-o", f"{target}.partial", str(SHIM_SOURCE), "-ldl"],
                   check=True, capture_output=True, timeout=120)
    os.replace(f"{target}.partial", target)
    target.chmod(0o755)
    stamp.write_text(digest + "\n")
    return True


def write(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def _from_file(option: str, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".sge", delete=False) as f:
        f.write(text)
    try:
        qconf(option, f.name)
    finally:
        os.unlink(f.name)


def _apply(add: str, modify: str, text: str, current: str | None) -> bool:
    """Add or modify one object from ``text`` unless it already reads so; return whether it changed."""
    if current is not None and _same(current, text):
        return False
    _from_file(add if current is None else modify, text)
    return True


def _same(current: str, wanted: str) -> bool:
    def values(text: str) -> dict[str, str]:  # qconf breaks long lists after their commas
        return {k: re.sub(r",\s+", ",", v) for k, v in _attrs(text).items()}

    have = values(current)
    return all(have.get(k) == v for k, v in values(wanted).items())


def _attrs(text: str) -> dict[str, str]:
    joined = text.replace("\\\n", " ")
    return {line.split(None, 1)[0]: " ".join(line.split()[1:]) for line in joined.splitlines() if line.strip()}


def _show(*args: str) -> str | None:
    proc = qconf(*args, check=False)
    return proc.stdout if proc.returncode == 0 else None


def configure(state: Path) -> bool:
    """Both hosts as submit and execution hosts with their GPUs; the GPU complex, the PEs and the queues; a
    1-second scheduling interval and accounting written at once. Returns whether anything changed (the execds then
    restart: a running one keeps the old configuration and its queue goes into error)."""
    names = hosts()
    changed = False
    submit_hosts = qconf("-ss", check=False).stdout.split()
    for name in names:
        if name not in submit_hosts:
            qconf("-as", name)
    complexes = qconf("-sc").stdout
    if not any(line.split()[:1] == ["gpu"] for line in complexes.splitlines()):
        _from_file("-Mc", complexes + "gpu gpu INT <= YES YES 0 0\n")
        changed = True
    for name in names:
        exechost = (f"hostname {name}\nload_scaling NONE\ncomplex_values gpu={config.GPUS_PER_NODE}\n"
                    "user_lists NONE\nxuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\n"
                    "report_variables NONE\n")
        changed |= _apply("-Ae", "-Me", exechost, _show("-se", name))
    changed |= _apply("-Ahgrp", "-Mhgrp", f"group_name @allhosts\nhostlist {' '.join(names)}\n",
                      _show("-shgrp", "@allhosts"))
    for pe, rule in PES.items():
        text = (f"pe_name {pe}\nslots 9999\nuser_lists NONE\nxuser_lists NONE\nstart_proc_args NONE\n"
                f"stop_proc_args NONE\nallocation_rule {rule}\ncontrol_slaves TRUE\njob_is_first_task FALSE\n"
                "urgency_slots min\naccounting_summary FALSE\nqsort_args NONE\n")
        changed |= _apply("-Ap", "-Mp", text, _show("-sp", pe))
    for name in QUEUES:
        queue = _show("-sq", name)
        template = queue if queue is not None else qconf("-sq").stdout
        # each host its own directory for jobs' $TMPDIR: in one /tmp, a host that ends a job's last task there
        # would remove the directory the job's tasks on the other host still use
        tmpdirs = ",".join([str(state / "sge/tmp" / names[0]), *(f"[{h}={state / 'sge/tmp' / h}]" for h in names[1:])])
        wanted = {"qname": name, "hostlist": "@allhosts", "load_thresholds": "NONE", "pe_list": " ".join(PES),
                  "slots": str(config.GPUS_PER_NODE), "shell": "/bin/bash", "shell_start_mode": "unix_behavior",
                  "starter_method": str(state / "sge/gpu-starter.sh"), "tmpdir": tmpdirs}
        text = "".join(f"{k} {wanted.get(k, v)}\n" for k, v in _attrs(template).items())
        changed |= _apply("-Aq", "-Mq", text, queue)
    sconf = qconf("-ssconf").stdout
    if _attrs(sconf).get("schedule_interval") != "0:0:1":
        _from_file("-Msconf", "".join(f"{k} {'0:0:1' if k == 'schedule_interval' else v}\n"
                                      for k, v in _attrs(sconf).items()))
    gconf = _attrs(qconf("-sconf").stdout).get("reporting_params", "")
    if "accounting_flush_time=00:00:00" not in gconf:
        script = ("#!/bin/sh\nt=$(sed -e 's/flush_time=[0-9:]*/flush_time=00:00:01/' "
                  "-e 's/joblog=/accounting_flush_time=00:00:00 joblog=/' \"$1\"); printf '%s\\n' \"$t\" > \"$1\"\n")
        with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
            f.write(script)
        os.chmod(f.name, 0o755)
        try:
            client(["qconf", "-mconf", "global"], timeout=60, EDITOR=f.name).check_returncode()
        finally:
            os.unlink(f.name)
        changed = True
    return changed


def up(state: Path, log) -> None:
    """Start, configure, and restart the execd where the configuration changed; wait for the queue."""
    if not installed():
        raise RuntimeError("Son of Grid Engine is not installed: run testbed/install.sh")
    shim_changed = prepare(state)
    qmaster, *execs = daemons(state)
    if qmaster.start():
        log(f"sge_qmaster started (pid {qmaster.pid()})")
    if configure(state) or shim_changed:
        for execd in execs:
            if execd.stop():
                log(f"{execd.name} restarted: configuration or host shim changed")
    for execd in execs:
        if execd.start():
            log(f"{execd.name} started (pid {execd.pid()})")
    for name in hosts():
        wait_for(lambda: _queue_ok(name), 60, f"Grid Engine queue {QUEUE}@{name}")


def _queue_ok(host: str) -> bool:
    out = client(["qstat", "-f", "-q", f"{QUEUE}@{host}"]).stdout
    for line in out.splitlines():
        if line.startswith(f"{QUEUE}@"):
            fields = line.split()
            if len(fields) > 5:  # a state column: u(nknown), E(rror), d(isabled)...
                client(["qmod", "-c", f"{QUEUE}@{host}"])
                client(["qmod", "-e", f"{QUEUE}@{host}"])
                return False
            return True
    return False


def cancel_jobs(timeout: float = 60) -> None:
    """Delete every job (as the manager) and wait until none is left."""
    def none_left() -> bool:
        out = client(["qstat", "-u", "*"])
        return out.returncode == 0 and not out.stdout.strip()

    if none_left():
        return
    client(["qdel", "-f", "-u", "*"], timeout=60)
    wait_for(none_left, timeout, "Grid Engine jobs to end")
