"""Pure renderers of the test bed's configuration files (Slurm, gres, registry, hub, site)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

NODES = {"node1": 16821, "node2": 16822}
GPUS_PER_NODE = 4
CTLD_PORT = 16817
REGISTRY = "127.0.0.1:5000"
HUB_PORT = 8000
SGE_HUB_PORT = 8100  # a second hub for the same site on Son of Grid Engine
#: Grid Engine's second execution host: a name and loopback address of its own (see gridengine.py)
SGE_SECOND_HOST, SGE_SECOND_ADDR = "sge2", "127.0.0.2"
#: The site's name for its per-node PEs (not the adapter's default, mpi-G): set in the Grid Engine hub's
#: configuration, so the jobs a kernel submits work only if the hub's configuration reaches them
SGE_PE_MULTI_NODE = "gpus-{gpus_per_node}"
WORKSHOP_PORT = 8092  # the instructor's page (a hub-managed service on loopback)
WORKSHOP_GROUP = "workshop"
PARTITION = "gpu"
CPU_PARTITION = "cpu"  # the same nodes without GPUs: a workshop's first steps
#: The same GPU nodes once more, in a partition whose GPUs are asked for by type (the nodes' GPUs have this type in
#: Slurm: a request without a type still gets any of them). Slurm's hub only: Grid Engine's needs a complex for it.
TYPED_PARTITION, GPU_TYPE = "typed", "sim"
CPUS_PER_NODE = 16


def slurm_conf(state: Path, cpus: int = CPUS_PER_NODE, memory_mb: int = 4000) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus} RealMemory={memory_mb} "
        f"Gres=gpu:{GPU_TYPE}:{GPUS_PER_NODE} State=UNKNOWN" for n, p in NODES.items()
    )
    return f"""# jupyter-hpcdl test bed: one controller, {len(NODES)} slurmd on this machine playing GPU nodes.
ClusterName=hpcdl
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/slurm/ctld
SlurmdSpoolDir={state}/slurm/d-%n
SlurmctldPidFile={state}/run/slurmctld.pid
SlurmdPidFile={state}/run/slurmd-%n.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd-%n.log
# Each node offers more CPU slots than this machine has cores (a training rank per GPU, and CPU-only servers for a
# workshop beside them): trust the config.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={state}/log/jobcomp.log
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
MpiDefault=none
# Slurm's job ids start where Grid Engine's do not reach on the bed: a user's jobs of both share the home's
# ~/.jupyter-hpcdl/jobs/<job id>, and the two schedulers' tests run side by side.
FirstJobId=100000
KillWait=5
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=1-00:00:00 DefaultTime=01:00:00 State=UP
PartitionName={CPU_PARTITION} Nodes={",".join(NODES)} MaxTime=04:00:00 DefaultTime=01:00:00 State=UP
PartitionName={TYPED_PARTITION} Nodes={",".join(NODES)} MaxTime=04:00:00 DefaultTime=01:00:00 State=UP
"""


def gres_conf(state: Path) -> str:
    # Slurm needs device files for GPUs: symlinks to /dev/null stand in for /dev/nvidia0..3.
    return (f"NodeName={','.join(NODES)} Name=gpu Type={GPU_TYPE} "
            f"File={state}/gpu/nvidia[0-{GPUS_PER_NODE - 1}]\n")


def registry_conf(state: Path) -> str:
    return f"""version: 0.1
log: {{level: warn}}
storage:
  filesystem: {{rootdirectory: {state}/registry/data}}
  delete: {{enabled: true}}
http:
  addr: {REGISTRY}
"""


def site_json(prefix: Path) -> str:
    return json.dumps({"ContainerSite": {
        "udocker": str(prefix / "venv/bin/udocker"),
        "tools_dir": str(prefix / "udocker-tools"),
        "registry": f"http://{REGISTRY}",
        "allowed_mounts": ["~", "/tmp", str(prefix)],
    }}, indent=2) + "\n"


def hub_config(state: Path, prefix: Path, users: list[str], password: str, workshop_users: list[str] = ()) -> str:
    return _hub_config(state, prefix, users, password, workshop_users, HUB, list(NODES))


def sge_hub_config(state: Path, prefix: Path, users: list[str], password: str, hosts: list[str]) -> str:
    """The same site on Son of Grid Engine (its execution hosts: ``hosts``): only the scheduler, the nodes and the
    hub's own ports and files differ."""
    return _hub_config(state, prefix, users, password, (), SGE_HUB, hosts) + \
        f"c.GridEngine.pe_multi_node = {SGE_PE_MULTI_NODE!r}  # the site's own PE names\n"


#: The hubs' timings (the tests compute their bounds from these, as the hub does). JupyterHub polls each server
#: every POLL_INTERVAL seconds (with up to 10 % jitter); the spawner reads the queue once every QUEUE_INTERVAL
#: seconds for all servers, backs off up to QUEUE_MAX_BACKOFF while the scheduler does not answer, gives each
#: scheduler command SCHEDULER_TIMEOUT seconds, a stop CANCEL_TIMEOUT, and sweeps for orphans every ORPHAN_INTERVAL.
POLL_INTERVAL = 10
QUEUE_INTERVAL = 2.0
QUEUE_MAX_BACKOFF = 8.0
SCHEDULER_TIMEOUT = 10.0
CANCEL_TIMEOUT = 30.0
ORPHAN_INTERVAL = 10.0


@dataclass(frozen=True)
class HubPlace:
    """Where one of the bed's hubs lives: its directory under the state, its ports, its batch system."""

    dirname: str
    port: int
    internal_port: int
    proxy_api_port: int
    scheduler: str
    internal_ssl: bool = False  # JupyterHub's mutual TLS between the hub, its proxy and the servers


HUB = HubPlace("hub", HUB_PORT, 8081, 8001, "slurm")
#: The Grid Engine hub runs as a site with shared nodes should: with internal_ssl.
SGE_HUB = HubPlace("hub-sge", SGE_HUB_PORT, 8181, 8101, "gridengine", internal_ssl=True)


def _hub_config(state: Path, prefix: Path, users: list[str], password: str, workshop_users, place: HubPlace,
                node_names: list[str]) -> str:
    nodes = {n: "127.0.0.1" for n in node_names}  # a job's server listens on its route to the hub: loopback
    d = state / place.dirname
    typed = (f""",\n                            "{TYPED_PARTITION}": {{"max_nodes": {len(NODES)}, "max_gpus_per_node": """
             f"""{GPUS_PER_NODE}, "max_walltime": "04:00:00", "gpu_types": ["{GPU_TYPE}"],\n"""
             f"""                                         "description": "the same GPU nodes, by GPU type"}}"""
             if place.scheduler == "slurm" else "")
    tls = (f"""# Mutual TLS between the hub, the proxy and the servers; each server's key goes to its job as the user.
c.JupyterHub.internal_ssl = True
c.JupyterHub.internal_certs_location = "{d}/internal-ssl"
""" if place.internal_ssl else "")
    return f"""# jupyter-hpcdl test bed hub: on loopback only, with configurable-http-proxy.
c = get_config()  # noqa
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {place.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {place.internal_port}
c.ConfigurableHTTPProxy.api_url = "{'https' if place.internal_ssl else 'http'}://127.0.0.1:{place.proxy_api_port}"
c.JupyterHub.db_url = "sqlite:///{d}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{d}/cookie_secret"
c.ConfigurableHTTPProxy.command = ["{prefix}/node/bin/configurable-http-proxy"]
c.ConfigurableHTTPProxy.pid_file = "{d}/proxy.pid"
{tls}c.SiteProfile.scheduler = "{place.scheduler}"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = {password!r}
c.Authenticator.allowed_users = set({users!r})
# The spawner: JupyterLab as a batch job on the GPU nodes, kernels in the user's udocker container; its hub-wide
# part (the hardened callback, the orphan sweep) installed from the hub's start.
from jupyter_hpcdl.spawner.hub import install
install()
c.JupyterHub.spawner_class = "hpcdl"
c.JupyterHub.allow_named_servers = True
c.JupyterHub.tornado_settings = {{"slow_spawn_timeout": 0}}  # straight to the progress page: jobs queue
c.JupyterHub.cleanup_servers = False  # a hub restart leaves the users' jobs alone; the spawner picks them up again
c.Spawner.poll_interval = {POLL_INTERVAL}
c.Spawner.default_url = "/lab"
c.HpcdlSpawner.python = "{prefix}/venv/bin/python"
c.HpcdlSpawner.node_addresses = {nodes!r}  # listen_ip stays the default: the node's address on its route to the hub
c.HpcdlSpawner.queue_interval = {QUEUE_INTERVAL}
# Faults come quickly on the bed: a short backoff, timeout and sweep interval (the defaults suit a real cluster).
c.HpcdlSpawner.hub_tag = "testbed"
c.HpcdlSpawner.queue_max_backoff = {QUEUE_MAX_BACKOFF}
c.HpcdlSpawner.scheduler_timeout = {SCHEDULER_TIMEOUT}
c.HpcdlSpawner.cancel_timeout = {CANCEL_TIMEOUT}
c.HpcdlSpawner.orphan_interval = {ORPHAN_INTERVAL}
c.SiteProfile.partitions = {{"{PARTITION}": {{"max_nodes": {len(NODES)}, "max_gpus_per_node": {GPUS_PER_NODE},
                                         "max_walltime": "04:00:00", "max_memory_gb": 3,
                                         "description": "test-bed GPU nodes"}},
                            "{CPU_PARTITION}": {{"max_nodes": 1, "max_gpus_per_node": 0, "max_walltime": "04:00:00",
                                         "description": "the same nodes, no GPU (workshops)"}}{typed}}}
c.SiteProfile.accounts = {{"*": ["hpcdl"], "alice": ["hpcdl", "alice-project"]}}
c.SiteProfile.images = {{"base": {{"ref": "hpcdl/base:latest", "description": "TensorFlow 2.15, Horovod 0.28.1"}},
                        "torch": {{"ref": "hpcdl/torch:latest", "backends": ["horovod", "torch"],
                                  "description": "PyTorch 2.13 (CPU), and TensorFlow 2.15 with Horovod 0.28.1"}},
                        "os": {{"ref": "hpcdl/os:latest", "description": "Debian 12 and Python, no TensorFlow",
                               "training": False}}}}
# A workshop: its group's members get the CPU partition and the small image, for two hours at most.
c.SiteProfile.limits = {{"group:{WORKSHOP_GROUP}": {{"partitions": ["{CPU_PARTITION}"], "images": ["os"],
                                                  "max_walltime": "02:00:00"}}}}
# A service whose token drives the REST API in tests (the token is in a root-only file), and the instructor's page
# (bob is the instructor: the role gives him access to that service, nothing else).
c.JupyterHub.services = [
    {{"name": "testbed", "api_token": open("{d}/service_token").read().strip()}},
""" + (f"""    {{"name": "hpcdl-workshop", "url": "http://127.0.0.1:{WORKSHOP_PORT}", "oauth_no_confirm": True,
      "command": ["{prefix}/venv/bin/python", "-m", "jupyter_hpcdl.workshop.service", "--group", "{WORKSHOP_GROUP}",
                  "--hub-url", "http://127.0.0.1:{place.port}", "--scheduler", "{place.scheduler}"]}},
""" if workshop_users else "") + """]
c.JupyterHub.load_roles = [
    {"name": "testbed", "services": ["testbed"],
      "scopes": ["admin:users", "admin:servers", "admin:groups", "access:servers", "read:users", "tokens"]},
""" + (f"""    {{"name": "hpcdl-workshop", "services": ["hpcdl-workshop"],
      # the group, its members, their servers and the servers' state (the job's id): no access to any server
      "scopes": ["read:groups!group={WORKSHOP_GROUP}", "read:users!group={WORKSHOP_GROUP}",
                 "read:servers!group={WORKSHOP_GROUP}", "admin:server_state!group={WORKSHOP_GROUP}"]}},
    {{"name": "instructor", "users": ["bob"], "scopes": ["access:services!service=hpcdl-workshop"]}},
""" if workshop_users else "") + "]\n"
