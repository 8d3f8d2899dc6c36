"""The jupyter-hpcdl test bed: a small HPC cluster on this one machine, brought up idempotently and torn down by
the pids it recorded.  ``python testbed/bed.py up|down|purge|status``  (as root, after testbed/install.sh).

- munge and Slurm (a controller and slurmd ``node1``, ``node2``, each with 4 fake GPUs as generic resources)
- Son of Grid Engine beside it (qmaster, two execution hosts with 4 GPUs each as a consumable, queue ``gpu``)
- users alice and bob, who submit their own jobs
- udocker's tools built from the distribution's packages into a shared directory, and the site's settings
- a Docker registry on loopback serving the image built here; alice's udocker pulls it and creates her container
- JupyterHub with configurable-http-proxy on 127.0.0.1, and a second hub for the same site on Grid Engine
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import config  # noqa: E402
import gridengine  # noqa: E402
import image  # noqa: E402
from daemons import Daemon, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PREFIX = Path(os.environ.get("HPCDL_PREFIX", "/opt/jupyter-hpcdl"))
CACHE = Path(os.environ.get("HPCDL_CACHE", "/var/cache/jupyter-hpcdl"))
STATE = Path(os.environ.get("HPCDL_TESTBED_STATE", "/var/lib/jupyter-hpcdl-testbed"))
VENV = PREFIX / "venv"
#: A workshop's attendees (the hub's load test spawns them all at once); each gets the small OS image.
WORKSHOP_USERS = tuple(f"w{i:02d}" for i in range(1, 21))
USERS = ("alice", "bob", *WORKSHOP_USERS)
IMAGE_USERS = ("alice",)  # users whose udocker gets the image at start-up (bob's stays empty)
TORCH_USERS = ("alice",)  # and the PyTorch image
SLURM_ETC = Path("/etc/slurm")
SITE_JSON = Path("/etc/jupyter-hpcdl/site.json")
#: The hubs run as this system account, not root: what they do as a user goes through the sudo rule that
#: ``docs/admin.md`` gives (``python -m jupyter_hpcdl.spawner.sudoers``), installed here for both schedulers.
HUB_ACCOUNT = "hpcdl-hub"
SUDO_RULE = Path("/etc/sudoers.d/jupyter-hpcdl-testbed")
MUNGE_SOCKET = "/run/munge/munge.socket.2"


def log(msg: str) -> None:
    print(f"[testbed] {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, text=True, capture_output=True, **kw)


def write_if_changed(path: Path, text: str, mode: int = 0o644) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
    return True


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def as_user(user: str, *argv: str, **kw) -> subprocess.CompletedProcess:
    """Run a command as ``user`` with a login-like environment (what sudo would give a job)."""
    home = pwd.getpwnam(user).pw_dir
    env = {"HOME": home, "USER": user, "LOGNAME": user, "PATH": f"{VENV}/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
                          text=True, capture_output=True, cwd=home, **kw)


# -- components ---------------------------------------------------------------------------------------------------
def ensure_users() -> None:
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            log(f"user {user}")
            sh("useradd", "--create-home", "--shell", "/bin/bash", user)
        os.chmod(pwd.getpwnam(user).pw_dir, 0o700)


def ensure_hub_account() -> None:
    """The hubs' system account and its sudo rule (checked by visudo before it is put in place)."""
    try:
        pwd.getpwnam(HUB_ACCOUNT)
    except KeyError:
        log(f"system account {HUB_ACCOUNT}")
        sh("useradd", "--system", "--user-group", "--no-create-home", "--home-dir", str(STATE / "hub"),
           "--shell", "/usr/sbin/nologin", HUB_ACCOUNT)
    rule = sh(str(VENV / "bin/python"), "-m", "jupyter_hpcdl.spawner.sudoers", "--hub-user", HUB_ACCOUNT,
              *(f"--scheduler={p.scheduler}" for p in hubs()), "--python", str(VENV / "bin/python")).stdout
    if not SUDO_RULE.exists() or SUDO_RULE.read_text() != rule:
        part = SUDO_RULE.with_name(".jupyter-hpcdl-testbed.part")  # sudo skips names with a dot
        part.write_text(rule)
        part.chmod(0o440)
        sh("visudo", "-cf", str(part))
        part.rename(SUDO_RULE)
        log(f"sudo rule {SUDO_RULE}")


def munge() -> Daemon:
    d = STATE / "munge"
    return Daemon("munged", ["/usr/sbin/munged", f"--socket={MUNGE_SOCKET}", f"--key-file={d}/munge.key",
                             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                  pidfile=d / "munged.pid", log=STATE / "log/munged.out", forks=True, user="munge",
                  ready=lambda: sh("munge", "-n", check=False).returncode == 0)


def prepare_munge() -> None:
    d = STATE / "munge"
    munge_user = pwd.getpwnam("munge")
    for path in (d, Path("/run/munge")):
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, munge_user.pw_uid, munge_user.pw_gid)
        path.chmod(0o755 if path.name == "munge" and path.parent == Path("/run") else 0o700)
    key = d / "munge.key"
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
    os.chown(key, munge_user.pw_uid, munge_user.pw_gid)
    key.chmod(0o400)


def slurm_daemons() -> list[Daemon]:
    ctld = Daemon("slurmctld", ["/usr/sbin/slurmctld", "-i"], pidfile=STATE / "run/slurmctld.pid",
                  log=STATE / "log/slurmctld.out", forks=True,
                  ready=lambda: sh("scontrol", "ping", check=False).stdout.count("UP") > 0)
    nodes = [Daemon(f"slurmd-{n}", ["/usr/sbin/slurmd", "-N", n], pidfile=STATE / f"run/slurmd-{n}.pid",
                    log=STATE / f"log/slurmd-{n}.out", forks=True) for n in config.NODES]
    return [ctld, *nodes]


def node_states() -> dict[str, str]:
    out = sh("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def prepare_slurm() -> bool:
    """Write Slurm's configuration; return whether it changed (running daemons then restart)."""
    for sub in ("slurm/ctld", "run", "log", "gpu"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    for n in config.NODES:
        (STATE / f"slurm/d-{n}").mkdir(parents=True, exist_ok=True)
    for i in range(config.GPUS_PER_NODE):
        dev = STATE / f"gpu/nvidia{i}"
        if not dev.is_symlink():
            dev.symlink_to("/dev/null")
    changed = write_if_changed(SLURM_ETC / "slurm.conf", config.slurm_conf(STATE))
    changed |= write_if_changed(SLURM_ETC / "gres.conf", config.gres_conf(STATE))
    return changed


def wait_nodes_idle(timeout: float = 60) -> None:
    def idle() -> bool:
        states = node_states()
        for n, s in states.items():
            if s.rstrip("*~#") in ("down", "drained", "draining", "inval"):
                sh("scontrol", "update", f"nodename={n}", "state=resume", check=False)
        return set(states) == set(config.NODES) and all(s.rstrip("*~#") in ("idle", "mixed", "allocated", "planned")
                                                       for s in states.values())
    wait_for(idle, timeout, "slurm nodes")


def registry() -> Daemon:
    conf = STATE / "registry/config.yml"
    return Daemon("registry", ["/usr/bin/docker-registry", "serve", str(conf)], pidfile=STATE / "run/registry.pid",
                  log=STATE / "log/registry.log", ready=lambda: http_ok(f"http://{config.REGISTRY}/v2/"))


def hub(place: config.HubPlace = config.HUB) -> Daemon:
    name = "jupyterhub" if place is config.HUB else f"jupyterhub-{place.scheduler}"
    return Daemon(name, [str(VENV / "bin/jupyterhub"), "-f", str(STATE / place.dirname / "jupyterhub_config.py")],
                  pidfile=STATE / f"run/{name}.pid", log=STATE / f"log/{name}.log", cwd=str(STATE / place.dirname),
                  env={"PATH": f"{VENV}/bin:{PREFIX}/node/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                       "HOME": str(STATE / place.dirname), "USER": HUB_ACCOUNT, "LOGNAME": HUB_ACCOUNT},
                  user=HUB_ACCOUNT,
                  ready=lambda: http_ok(f"http://127.0.0.1:{place.port}/hub/api/"), ready_timeout=90)


def proxy(place: config.HubPlace = config.HUB) -> Daemon:
    """A hub's configurable-http-proxy, which the hub starts and records in its pid file. JupyterHub leaves it
    running when it stops (``cleanup_servers = False``) and a killed hub leaves it too; the next hub takes it over by
    that file, and ``down`` stops it by that file."""
    suffix = "" if place is config.HUB else f"-{place.scheduler}"
    return Daemon(f"configurable-http-proxy{suffix}", [str(PREFIX / "node/bin/configurable-http-proxy")],
                  pidfile=STATE / place.dirname / "proxy.pid", log=STATE / f"log/jupyterhub{suffix}.log")


def hubs() -> list[config.HubPlace]:
    return [config.HUB, config.SGE_HUB]


def prepare_hub(place: config.HubPlace = config.HUB) -> bool:
    """Write a hub's configuration; return whether it changed (a running hub then restarts)."""
    d = STATE / place.dirname
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    for name in ("service_token", "password"):
        if not (d / name).exists():
            write_if_changed(d / name, secrets.token_hex(16) + "\n", 0o600)
    password = (d / "password").read_text().strip()
    if place is config.HUB:
        text = config.hub_config(STATE, PREFIX, list(USERS), password, list(WORKSHOP_USERS))
    else:
        text = config.sge_hub_config(STATE, PREFIX, list(USERS), password, gridengine.hosts())
    changed = write_if_changed(d / "jupyterhub_config.py", text, 0o600)
    account = pwd.getpwnam(HUB_ACCOUNT)
    for path in (d, *d.iterdir()):  # the hub's own: it runs as its account
        os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)
    return changed


def udocker_tools() -> None:
    """Build the tools tarball from the distribution's packages and install it shared, when its sources change."""
    tools = PREFIX / "udocker-tools"
    src = REPO / "jupyter_hpcdl/containers/proot_wrapper.c"
    key = image._sha(src.read_bytes(), *(Path(p).read_bytes()[:4096] for p in ("/usr/bin/proot", "/usr/bin/runc")))[:16]
    stamp = tools / ".hpcdl-stamp"
    if stamp.exists() and stamp.read_text().strip() == key:
        return
    log("udocker tools from the distribution's packages")
    tarball = CACHE / f"udocker-tools-{key}.tar.gz"
    sh(str(VENV / "bin/hpcdl-udocker-tools"), "build", str(tarball))
    sh(str(VENV / "bin/hpcdl-udocker-tools"), "install", str(tarball), str(tools))
    stamp.write_text(key + "\n")


def user_image(user: str, identity: dict, name: str = image.IMAGE) -> None:
    """Pull the image into the user's udocker (the real pull path) and create their container, once per build."""
    stamp = STATE / (f"users/{user}.image.json" if name == image.IMAGE else f"users/{user}.{name.replace('/', '_')}.json")
    if stamp.exists() and json.loads(stamp.read_text()) == identity:
        return
    log(f"{user}: pull {name}:latest and create the container")
    cli = str(VENV / "bin/hpcdl-containers")
    if f"{name}:latest" in as_user(user, cli, "images").stdout.split():
        as_user(user, cli, "rmi", f"{name}:latest")  # drops the earlier build's layers (its container stays)
    for argv in ((cli, "pull", f"{name}:latest"), (cli, "ensure", f"{name}:latest")):
        r = as_user(user, *argv)
        if r.returncode:
            raise RuntimeError(f"{user}: {' '.join(argv[1:])} failed: {r.stderr.strip()}")
    container = r.stdout.strip()
    # Containers of earlier builds of the same image only take space: remove them.
    prefix = container.rsplit("-", 1)[0] + "-"
    for name in as_user(user, cli, "ps").stdout.split():
        if name.startswith(prefix) and name != container:
            as_user(user, cli, "rm", name)
    stamp.write_text(json.dumps(identity) + "\n")


# -- commands -----------------------------------------------------------------------------------------------------
def daemons() -> list[Daemon]:
    return [munge(), *slurm_daemons(), *gridengine.daemons(STATE), registry(), *(hub(p) for p in hubs())]


def up() -> dict:
    if os.geteuid() != 0:
        sys.exit("the test bed is set up as root (it starts daemons and creates users)")
    t0 = time.monotonic()
    for sub in ("run", "log", "users"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    ensure_users()
    ensure_hub_account()
    prepare_munge()
    munge().start()
    if prepare_slurm():
        for d in reversed(slurm_daemons()):
            if d.stop():
                log(f"{d.name} restarted: configuration changed")
    for d in slurm_daemons():
        if d.start():
            log(f"{d.name} started (pid {d.pid()})")
    wait_nodes_idle()
    gridengine.up(STATE, log)
    udocker_tools()
    write_if_changed(SITE_JSON, config.site_json(PREFIX))
    write_if_changed(STATE / "registry/config.yml", config.registry_conf(STATE))
    if registry().start():
        log("registry started")
    identity = image.build(CACHE / "image", VENV, image.project_wheel(CACHE), config.REGISTRY, STATE / "image.json")
    for user in IMAGE_USERS:
        user_image(user, identity)
    if identity.get("torch"):
        for user in TORCH_USERS:
            user_image(user, identity, image.TORCH_IMAGE)
    with ThreadPoolExecutor(4) as pool:  # the attendees' small images, a few at a time
        list(pool.map(lambda user: user_image(user, identity, image.OS_IMAGE), WORKSHOP_USERS))
    for place in hubs():
        changed = prepare_hub(place)
        changed |= write_if_changed(STATE / place.dirname / "package.json", json.dumps(identity) + "\n")  # its code
        if changed and hub(place).stop():
            log(f"{hub(place).name} restarted: configuration or package changed")
        if hub(place).start():
            log(f"{hub(place).name} started")
    info = describe(identity)
    write_if_changed(STATE / "bed.json", json.dumps(info, indent=2) + "\n", 0o600)
    log(f"up in {time.monotonic() - t0:.0f} s")
    return info


def describe(identity: dict | None = None) -> dict:
    return {
        "state": str(STATE), "prefix": str(PREFIX), "venv": str(VENV), "cache": str(CACHE),
        "users": list(USERS), "image_users": list(IMAGE_USERS), "workshop_users": list(WORKSHOP_USERS),
        "nodes": list(config.NODES),
        "gpus_per_node": config.GPUS_PER_NODE, "partition": config.PARTITION,
        "image": f"{image.IMAGE}:latest", "os_image": f"{image.OS_IMAGE}:latest",
        "torch_image": f"{image.TORCH_IMAGE}:latest",
        "identity": identity or json.loads((STATE / "image.json").read_text()),
        "os_archive": str(CACHE / "image/os-oci.tar"),
        "registry": f"http://{config.REGISTRY}", "site_config": str(SITE_JSON),
        "hub_url": f"http://127.0.0.1:{config.HUB_PORT}", "hub_dir": str(STATE / "hub"),
        "sge_hub_url": f"http://127.0.0.1:{config.SGE_HUB_PORT}", "sge_hub_dir": str(STATE / config.SGE_HUB.dirname),
        "sge_host": gridengine.host(), "sge_hosts": gridengine.hosts(), "sge_queue": gridengine.QUEUE,
        "sge_pe_multi_node": config.SGE_PE_MULTI_NODE,
    }


# -- faults, for the fault-injection tests (by the pids the bed recorded, never by name) ---------------------------
def controller() -> Daemon:
    return slurm_daemons()[0]


def node_daemon(node: str) -> Daemon:
    return next(d for d in slurm_daemons() if d.name == f"slurmd-{node}")


def signal_controller(sig: int) -> int:
    """Send ``sig`` to the recorded slurmctld (SIGSTOP: frozen, as an overloaded controller looks; SIGCONT: back;
    SIGKILL: dead). Return its pid."""
    pid = controller().pid()
    if pid is None:
        raise RuntimeError("slurmctld is not running")
    os.kill(pid, sig)
    return pid


def wait_controller_saved(job_ids: list[str], timeout: float = 30) -> None:
    """Wait until slurmctld has written its state since these running jobs started. It saves at most every 5 s: a
    controller killed before that forgets its newest jobs on restart (a real one would too), and the slurmd then end
    them as orphans. The fault tests kill a controller that knows its jobs."""
    starts = sh("squeue", "-h", "-t", "R", "-j", ",".join(job_ids), "-o", "%S", timeout=30).stdout.split()
    since = max((datetime.fromisoformat(s).timestamp() for s in starts), default=time.time()) + 1
    saved = STATE / "slurm" / "ctld" / "job_state"
    wait_for(lambda: saved.exists() and saved.stat().st_mtime >= since, timeout,
             f"slurmctld's saved state ({saved}) with jobs {', '.join(job_ids)}")


def job_processes(job_id: str) -> list[int]:
    """Pids of a job's processes on this machine: its slurmstepd and every process in its environment."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline.startswith(f"slurmstepd: [{job_id}.".encode()) or f"SLURM_JOB_ID={job_id}".encode() in environ:
            pids.append(int(entry.name))
    return pids


def kill_node(node: str) -> list[int]:
    """The node dies: its slurmd and the processes of the jobs running on it are killed (SIGKILL). Return the pids."""
    jobs = sh("squeue", "-h", "-w", node, "-o", "%i", check=False).stdout.split()
    pid = node_daemon(node).pid()
    victims = ([pid] if pid else []) + [p for job in jobs for p in job_processes(job)]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node_daemon(node).pidfile.unlink(missing_ok=True)
    return victims


def heal() -> None:
    """Back to a healthy bed after a fault: the controller thawed or restarted, every slurmd running, nodes idle,
    the hub running."""
    pid = controller().pid()
    if pid is not None:
        os.kill(pid, signal.SIGCONT)
    for d in slurm_daemons():
        d.start()
    wait_nodes_idle(120)
    hub().start()


def cancel_jobs(timeout: float = 60) -> None:
    if not (STATE / "run/slurmctld.pid").exists():
        return
    if sh("scontrol", "ping", check=False).stdout.count("UP") == 0:
        return
    sh("scancel", "--full", f"--partition={config.PARTITION},{config.CPU_PARTITION}", check=False)
    wait_for(lambda: not sh("squeue", "-h", "-o", "%i", check=False).stdout.strip(), timeout, "jobs to end")


def down() -> None:
    cancel_jobs()
    if gridengine.daemons(STATE)[0].pid():
        gridengine.cancel_jobs()
    for d in [*reversed(daemons()), *(proxy(place) for place in hubs())]:
        if d.stop():
            log(f"{d.name} stopped")


def purge() -> None:
    """Down, then remove what the bed made from this repository's sources outside the prefix and cache: its state
    (registry, hub database, stamps) and the test users' udocker repositories (images, containers)."""
    down()
    for user in USERS:
        try:
            home = Path(pwd.getpwnam(user).pw_dir)
        except KeyError:
            continue
        shutil.rmtree(home / ".udocker", ignore_errors=True)
    shutil.rmtree(STATE, ignore_errors=True)
    log(f"purged {STATE} and the users' udocker repositories")


def status() -> int:
    bad = 0
    for d in daemons():
        pid = d.pid()
        print(f"{d.name:16} {'running pid ' + str(pid) if pid else 'stopped'}")
        bad += pid is None
    if (STATE / "run/slurmctld.pid").exists():
        print("nodes:", node_states())
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("up", "down", "purge", "status", "describe"))
    cmd = p.parse_args().command
    if cmd == "up":
        print(json.dumps(up(), indent=2))
    elif cmd == "down":
        down()
    elif cmd == "purge":
        purge()
    elif cmd == "describe":
        print(json.dumps(describe(), indent=2))
    else:
        return status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
