"""The PBS Pro / OpenPBS and LSF adapters alone: every argv builder and parser, on outputs recorded from the
vendors' documented formats (tests/recorded/README.md says which); no batch system is needed."""
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from traitlets.config import Config

from jupyter_hpcdl.batchsystems.lsf import Lsf
from jupyter_hpcdl.batchsystems.scheduler import JobRequest
from jupyter_hpcdl.spawner.orphans import JobMark, is_orphan
from jupyter_hpcdl.batchsystems.pbs import Pbs
from jupyter_hpcdl.batchsystems.scheduler import ENDED, PENDING, RUNNING, Availability, JobInfo, load_scheduler
from jupyter_hpcdl.spawner.script import ScriptContext, build_batch_script

RECORDED = Path(__file__).parent / "recorded"
ROOT = Path(__file__).parent.parent
MARK = JobMark("testhub", "alice", "").comment()
REQ = JobRequest("gpu", 2, 4, 90, "base", "hpcdl/base:latest", account="proj-a", memory_gb=64)
ONE_CPU = JobRequest("cpu", 1, 0, 30, "base", "hpcdl/base:latest")


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


# -- PBS -------------------------------------------------------------------------------------------------------------
def test_pbs_options_build_select_place_and_walltime():
    out = "/home/alice/.jupyter-hpcdl/jobs/" + Pbs.job_id_placeholder + ".log"
    assert Pbs().options(REQ, "jupyterhub-hpcdl", out, "/home/alice", MARK) == [
        "-N jupyterhub-hpcdl", "-q gpu", "-l select=2:ncpus=4:ngpus=4:mpiprocs=4:mem=64gb", "-l place=scatter",
        "-l walltime=01:30:00", "-o /home/alice/.jupyter-hpcdl/jobs/", "-j oe", "-r n", "-A proj-a",
        "-P jupyterhub-hpcdl@testhub@alice@"]


def test_pbs_one_cpu_node_reservation_and_gpu_type():
    lines = Pbs().options(ONE_CPU, "j", "/tmp/x.log", "/tmp")
    assert lines == ["-N j", "-q cpu", "-l select=1:ncpus=1:mpiprocs=1", "-l walltime=00:30:00", "-o /tmp/x.log",
                     "-j oe", "-r n"]
    req = JobRequest("gpu", 1, 2, 60, "base", "r", gpu_type="a100", reservation="R123.pbs01")
    assert Pbs().options(req, "j", "/tmp/x.log", "/tmp")[1:3] == ["-q R123", "-l select=1:ncpus=2:ngpus=2:mpiprocs=2"]
    typed = Pbs(config=Config({"Pbs": {"gpu_type_resource": "gputype"}}))
    assert typed.options(req, "j", "/tmp/x.log", "/tmp")[2] == "-l select=1:ncpus=2:ngpus=2:gputype=a100:mpiprocs=2"
    assert not any(o.startswith("-P") for o in Pbs(config=Config({"Pbs": {"mark_in_project": False}})).options(
        req, "j", "/tmp/x.log", "/tmp", MARK))
    with pytest.raises(ValueError, match="PBS project"):
        Pbs().options(req, "j", "/tmp/x.log", "/tmp", "jupyterhub-hpcdl:a/b")


def test_pbs_header_puts_the_sites_directives_after_the_built_ones():
    pbs = Pbs(config=Config({"Pbs": {"extra_directives": ["-l software=jupyter", "-W umask=077"]}}))
    header = pbs.header(ONE_CPU, "j", "/tmp/x.log", "/tmp")
    assert header[0] == "#PBS -N j" and header[-2:] == ["#PBS -l software=jupyter", "#PBS -W umask=077"]
    assert all(line.startswith("#PBS ") for line in header)
    script = build_batch_script(REQ, pbs, ScriptContext(python="/opt/venv/bin/python", workdir="/home/alice",
                                                         output="/home/alice/.jupyter-hpcdl/jobs/%PBS_JOBID%.log",
                                                         comment=MARK))
    assert "#PBS -P jupyterhub-hpcdl@testhub@alice@\n#PBS -l software=jupyter\n" in script


def test_pbs_submit_cancel_and_query_argv():
    pbs = Pbs()
    assert pbs.submit_argv(["HOME", "JUPYTERHUB_API_TOKEN"]) == ["qsub", "-v", "HOME,JUPYTERHUB_API_TOKEN"]
    assert pbs.submit_argv([]) == ["qsub"]
    assert pbs.cancel_argv("1234.pbs01") == ["qdel", "1234.pbs01"]
    assert pbs.queue_argv() == ["qstat", "-f", "-F", "json"]
    assert pbs.job_argv("1234.pbs01") == ["qstat", "-f", "-F", "json", "-x", "1234.pbs01"]
    assert pbs.comment_argv("1234.pbs01") == ["qstat", "-f", "-F", "json", "1234.pbs01"]
    assert pbs.named_jobs_argv("jupyterhub-hpcdl") == ["qselect", "-N", "jupyterhub-hpcdl"]
    assert pbs.availability_argv() == ["pbsnodes", "-a", "-F", "json"]
    assert pbs.accounting_argv("1234.pbs01") is None


def test_pbs_parse_submit():
    assert Pbs().parse_submit(recorded("pbs/qsub_stdout.txt")) == "1234.pbs01"
    for bad in ("", "qsub: Unknown queue\n", "1234.pbs01\n1235.pbs01\n"):
        with pytest.raises(ValueError, match="qsub printed no job id"):
            Pbs().parse_submit(bad)


def test_pbs_queue_pending_running_and_forged():
    jobs = Pbs().parse_queue(recorded("pbs/qstat_f_json.json"))
    assert sorted(jobs) == ["1234.pbs01", "1235.pbs01", "1236.pbs01"]  # no array job, nothing forged
    assert jobs["1234.pbs01"] == JobInfo(
        "1234.pbs01", PENDING, "QUEUED", "Not Running: Insufficient amount of resource: ngpus (R: 4 A: 0 T: 8)",
        "Mon Jun 10 11:00:00 2024", "", "", (), "alice")
    assert jobs["1235.pbs01"] == JobInfo("1235.pbs01", RUNNING, "RUNNING", "", "", "gpu01", "", ("gpu01", "gpu02"), "bob")
    held = jobs["1236.pbs01"]
    assert (held.phase, held.state, held.user) == (PENDING, "HELD", "mallory")
    assert Pbs().parse_queue(recorded("pbs/qstat_no_jobs.json")) == {}
    assert Pbs().parse_queue("") == {}
    for unreadable in ("qstat: cannot connect to server pbs01 (errno=15010)\n", '["Jobs"]', '{"Jobs": '):
        with pytest.raises(ValueError, match="not the JSON object"):  # no answer, never "no jobs"
            Pbs().parse_queue(unreadable)


def test_pbs_finished_job_and_forgotten_one():
    pbs = Pbs()
    info = pbs.parse_job(recorded("pbs/qstat_f_json_x_finished.json"))
    assert info == JobInfo("1233.pbs01", ENDED, "FINISHED",
                           "Job run at Mon Jun 10 at 07:55 on (gpu01:ncpus=4:ngpus=4) and finished", "", "gpu01", "271",
                           ("gpu01",), "alice")
    assert pbs.parse_job(recorded("pbs/qstat_f_json.json")) is None  # several jobs: not one job's details
    assert pbs.parse_job("") is None
    assert pbs.job_forgotten(recorded("pbs/qstat_unknown_stderr.txt"))
    assert pbs.job_forgotten(recorded("pbs/qdel_finished_stderr.txt"))
    assert not pbs.job_forgotten("qstat: cannot connect to server pbs01 (errno=15010)\n")


def test_pbs_named_jobs_and_comment():
    pbs = Pbs()
    assert pbs.parse_job_ids(recorded("pbs/qselect_N.txt")) == ["1234.pbs01", "1235.pbs01"]
    comment = pbs.parse_comment(recorded("pbs/qstat_f_json_comment.json"))
    assert comment == "jupyterhub-hpcdl:testhub:bob:lab" and JobMark.parse(comment) == JobMark("testhub", "bob", "lab")
    bob = JobInfo("1235.pbs01", RUNNING, "RUNNING", user="bob")
    assert is_orphan(bob, comment, "testhub") == JobMark("testhub", "bob", "lab")
    assert pbs.parse_comment(recorded("pbs/qstat_f_json.json")) == ""  # not one job
    held = '{"Jobs": {"1236.pbs01": {"project": "_pbs_project_default"}}}'
    assert pbs.parse_comment(held) == ""


def test_pbs_availability_counts_queues_and_leaves_out_down_nodes():
    avail = Pbs().parse_availability(recorded("pbs/pbsnodes_a_json.json"))
    assert avail == {"gpu": Availability("gpu", 4, 1, 16, 6), "cpu": Availability("cpu", 1, 1, 0, 0),
                     "debug": Availability("debug", 1, 1, 0, 0), "workq": Availability("workq", 1, 1, 0, 0)}
    assert Pbs().parse_availability("not json") == {}


# -- LSF -------------------------------------------------------------------------------------------------------------
def test_lsf_options():
    out = "/home/alice/.jupyter-hpcdl/jobs/%J.log"
    req = JobRequest("gpu", 2, 4, 90, "base", "r", account="proj-a", gpu_type="a100", memory_gb=64, reservation="workshop")
    assert Lsf().options(req, "jupyterhub-hpcdl", out, "/home/alice", MARK) == [
        "-J jupyterhub-hpcdl", "-q gpu", "-n 8", "-R span[ptile=4]", "-gpu num=4:gmodel=a100", "-W 1:30",
        f"-o {out}", "-cwd /home/alice", "-rn", "-M 64GB", "-P proj-a", "-U workshop", f"-Jd {MARK}"]
    assert Lsf().options(ONE_CPU, "j", "/tmp/%J.log", "/tmp") == [
        "-J j", "-q cpu", "-n 1", "-R span[ptile=1]", "-W 0:30", "-o /tmp/%J.log", "-cwd /tmp", "-rn"]
    assert Lsf.job_id_placeholder == "%J"


def test_lsf_header_puts_the_sites_directives_after_the_built_ones():
    lsf = Lsf(config=Config({"Lsf": {"extra_directives": ["-app jupyter"]}}))
    header = lsf.header(ONE_CPU, "j", "/tmp/%J.log", "/tmp", MARK)
    assert header[-2:] == [f"#BSUB -Jd {MARK}", "#BSUB -app jupyter"] and header[0] == "#BSUB -J j"


def test_lsf_submit_cancel_and_query_argv():
    lsf = Lsf()
    assert lsf.submit_argv(["HOME", "JUPYTERHUB_API_TOKEN"]) == ["bsub", "-env", "HOME,JUPYTERHUB_API_TOKEN"]
    assert lsf.submit_argv([]) == ["bsub", "-env", "none"]
    assert lsf.cancel_argv("5001") == ["bkill", "5001"]
    fields = "jobid stat user exec_host pend_reason exit_code"
    assert lsf.queue_argv() == ["bjobs", "-u", "all", "-a", "-o", fields, "-json"]
    assert lsf.job_argv("5001") == ["bjobs", "-a", "-o", fields, "-json", "5001"]
    assert lsf.comment_argv("5001") == ["bjobs", "-o", "job_description", "-json", "5001"]
    assert lsf.named_jobs_argv("jupyterhub-hpcdl") == ["bjobs", "-u", "all", "-a", "-o", "jobid job_name", "-json"]
    assert lsf.availability_argv() == ["bhosts", "-X", "-o", "host_name status njobs ngpus ngpus_alloc", "-json"]


def test_lsf_parse_submit():
    assert Lsf().parse_submit(recorded("lsf/bsub_stdout.txt")) == "5001"
    assert Lsf().parse_submit(recorded("lsf/bsub_default_queue_stdout.txt")) == "5007"
    for bad in ("", "Request aborted by esub. Job not submitted.\n", "Job <12[3]> is submitted to queue <gpu>.\n"):
        with pytest.raises(ValueError, match="bsub printed no job id"):
            Lsf().parse_submit(bad)


def test_lsf_queue_states():
    jobs = Lsf().parse_queue(recorded("lsf/bjobs_queue.json"))
    assert jobs["5001"] == JobInfo("5001", PENDING, "PEND", "Job's requirements for resource reservation not "
                                   "satisfied (Resource: ngpus_physical);", user="alice")
    assert jobs["5002"] == JobInfo("5002", RUNNING, "RUN", batch_host="gpu01", nodes=("gpu01", "gpu02"), user="bob")
    assert (jobs["5003"].phase, jobs["5003"].batch_host) == (RUNNING, "gpu03")  # UNKWN: the host is unreachable
    assert (jobs["5000"].phase, jobs["5000"].exit_code) == (ENDED, "143")
    assert (jobs["5004"].phase, jobs["5004"].state) == (PENDING, "PSUSP")
    assert Lsf().parse_queue("No job found\n") == {} and Lsf().parse_queue("No unfinished job found\n") == {}
    for unreadable in ("LSF is down. Please wait ...\n", '{"RECORDS": [', "[]"):
        with pytest.raises(ValueError, match="not the JSON of -json"):  # no answer, never "no jobs"
            Lsf().parse_queue(unreadable)


def test_lsf_one_job_done_exit_and_not_found():
    lsf = Lsf()
    assert lsf.parse_job(recorded("lsf/bjobs_job_done.json")) == JobInfo(
        "4999", ENDED, "DONE", batch_host="gpu02", exit_code="0", nodes=("gpu02",), user="alice")
    assert lsf.parse_job(recorded("lsf/bjobs_job_exit.json")).exit_code == "143"
    assert lsf.parse_job(recorded("lsf/bjobs_job_not_found.json")) is None
    assert lsf.job_forgotten(recorded("lsf/bjobs_not_found_stderr.txt"))
    assert not lsf.job_forgotten("LSF is down. Please wait ...\nbjobs: batch system daemon not responding ...\n")


def test_lsf_named_jobs_filter_by_the_whole_name():
    ids = Lsf().parse_job_ids(recorded("lsf/bjobs_named.json"), "jupyterhub-hpcdl")
    assert ids == ["5001", "5002"]  # not the name with a newline, not another name, no forged id


def test_lsf_comment_read_alone():
    lsf = Lsf()
    comment = lsf.parse_comment(recorded("lsf/bjobs_comment.json"))
    alice = JobInfo("5001", PENDING, "PEND", user="alice")
    assert comment == MARK and is_orphan(alice, comment, "testhub") == JobMark("testhub", "alice", "")
    forged = lsf.parse_comment(recorded("lsf/bjobs_comment_forged.json"))
    assert "\n" in forged and is_orphan(alice, forged, "testhub") is None
    assert lsf.parse_comment(recorded("lsf/bjobs_job_not_found.json")) == ""


def test_lsf_availability():
    avail = Lsf().parse_availability(recorded("lsf/bhosts_json.json"))
    assert avail == {"normal": Availability("normal", 5, 2, 16, 4)}
    by_queue = Lsf(config=Config({"Lsf": {"queue_hosts": {"gpu": ["gpu*"], "cpu": ["cpu*"]}}}))
    assert by_queue.parse_availability(recorded("lsf/bhosts_json.json")) == {
        "gpu": Availability("gpu", 4, 1, 16, 4), "cpu": Availability("cpu", 1, 1, 0, 0)}


# -- registration ------------------------------------------------------------------------------------------------------
def test_pyproject_registers_both_adapters():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["jupyter_hpcdl.schedulers"]
    assert eps["pbs"] == "jupyter_hpcdl.batchsystems.pbs:Pbs" and eps["lsf"] == "jupyter_hpcdl.batchsystems.lsf:Lsf"
    assert (Pbs.name, Pbs.directive, Lsf.name, Lsf.directive) == ("pbs", "#PBS", "lsf", "#BSUB")


@pytest.mark.parametrize("name,cls", [("pbs", Pbs), ("lsf", Lsf)])
def test_load_scheduler_finds_them(name, cls):
    installed = {ep.name for ep in importlib.metadata.entry_points(group="jupyter_hpcdl.schedulers")}
    if name not in installed:
        pytest.skip(f"the installed jupyter_hpcdl metadata ({sorted(installed)}) predates the {name!r} entry point: "
                    "reinstall the package (pip install -e .) to check load_scheduler; pyproject.toml is checked above")
    assert type(load_scheduler(name)) is cls


def test_no_adapter_line_can_carry_a_newline():
    for scheduler in (Pbs(), Lsf()):
        for line in scheduler.header(REQ, "jupyterhub-hpcdl", "/tmp/x.log", "/tmp", MARK):
            assert "\n" not in line and re.fullmatch(r"#(PBS|BSUB) -\S+( \S+)?", line), line


def test_each_adapter_says_which_roles_it_serves_and_refuses_the_others_with_what_it_does():
    from jupyter_hpcdl.batchsystems.gridengine import GridEngine
    from jupyter_hpcdl.batchsystems.scheduler import ROLES, RoleUnsupported, Scheduler, require, serves
    from jupyter_hpcdl.batchsystems.slurm import Slurm

    assert {cls.__name__: [r for r in ROLES if serves(cls, r)] for cls in (Slurm, GridEngine, Pbs, Lsf)} == {
        "Slurm": ["hub", "job", "ranks"], "GridEngine": ["hub", "job", "ranks"], "Pbs": ["hub"], "Lsf": ["hub"]}
    require(Slurm(), "job")
    with pytest.raises(RoleUnsupported, match=r"^the lsf adapter does not serve jobs of ranks that a notebook submits "
                                              r"\(where=\"new\", BatchRun\) yet \(it serves: the hub's servers"):
        require(Lsf(), "ranks")

    class HalfDone(Scheduler):  # the job's queries, but no way to start its tasks
        name = "half"

        def hosts_argv(self, env):
            return None

        def parse_hosts(self, stdout, env):
            return [("n", 1)]

        def resources_argv(self, job_id):
            return ["true"]

        def parse_resources(self, stdout, now):
            return None

    assert not serves(HalfDone, "job") and not serves(HalfDone, "hub")
    with pytest.raises(RoleUnsupported, match="it serves: nothing yet"):
        require(HalfDone(), "hub")
