"""Limits per user and per JupyterHub group (a workshop's partition, GPUs, walltime, reservation): what the form
offers, what a request may ask for, what reaches the batch script, and the same limits for the jobs a kernel
submits from the server's job."""
from __future__ import annotations

import pytest
from traitlets.config import Config

from jupyter_hpcdl.batchsystems.gridengine import GridEngine
from jupyter_hpcdl.batchsystems.scheduler import OFFER_ENV
from jupyter_hpcdl.batchsystems.slurm import Slurm
from jupyter_hpcdl.containers.kernelspec import DEFAULT_IMAGE, IMAGE_ENV, container_kernelspec, kernel_image
from jupyter_hpcdl.job.newjob import NewAllocation, rank_job
from jupyter_hpcdl.job.offer import within_offer
from jupyter_hpcdl.spawner.options import OptionsError, validate_options
from jupyter_hpcdl.spawner.profile import SiteProfile, offer_json, offer_profile
from jupyter_hpcdl.spawner.script import ScriptContext, build_batch_script


def site(limits: dict) -> SiteProfile:
    c = Config()
    c.SiteProfile.partitions = {"gpu": {"max_nodes": 2, "max_gpus_per_node": 4, "max_walltime": "08:00:00"},
                                "cpu": {"max_nodes": 2, "max_gpus_per_node": 0, "max_walltime": "04:00:00"}}
    c.SiteProfile.images = {"base": {"ref": "hpcdl/base:latest"}, "os": {"ref": "hpcdl/os:latest"}}
    c.SiteProfile.limits = limits
    return SiteProfile(config=c)


WORKSHOP = {"group:workshop": {"partitions": ["cpu"], "images": ["os"], "max_walltime": "01:30:00",
                               "reservation": "ws-dec"},
            "group:gpu-course": {"max_gpus_per_node": 1, "max_nodes": 1},
            "carol": {"max_walltime": "00:30:00"}}


def test_a_workshop_member_is_offered_the_workshops_partition_image_and_walltime_in_its_reservation():
    mine = site(WORKSHOP).snapshot().for_user("w01", ["workshop"])
    assert list(mine.partitions) == ["cpu"] and list(mine.images) == ["os"]
    assert mine.partitions["cpu"].max_walltime == 90 and mine.partitions["cpu"].reservation == "ws-dec"
    req = validate_options({"walltime": "01:00:00"}, mine, "w01")
    assert (req.partition, req.image, req.reservation, req.gpus_per_node) == ("cpu", "os", "ws-dec", 0)
    script = build_batch_script(req, Slurm(), ScriptContext(python="/opt/venv/bin/python", output="/tmp/%j.log",
                                                           workdir="/home/w01"))
    assert "#SBATCH --reservation=ws-dec\n" in script and "--partition=cpu" in script


def test_what_a_limit_leaves_out_is_refused_with_what_is_allowed():
    mine = site(WORKSHOP).snapshot().for_user("w01", ["workshop"])
    with pytest.raises(OptionsError, match="partition: 'gpu' is not offered; choose one of: cpu"):
        validate_options({"partition": "gpu"}, mine, "w01")
    with pytest.raises(OptionsError, match="longer than partition cpu allows \\(01:30:00\\)"):
        validate_options({"walltime": "02:00:00"}, mine, "w01")
    with pytest.raises(OptionsError, match="image: 'base' is not offered"):
        validate_options({"image": "base"}, mine, "w01")


def test_several_limits_give_the_narrowest_of_each_and_others_are_untouched():
    profile = site(WORKSHOP).snapshot()
    both = profile.for_user("carol", ["gpu-course"])
    assert both.partitions["gpu"].max_gpus_per_node == 1 and both.partitions["gpu"].max_nodes == 1
    assert both.partitions["gpu"].max_walltime == 30 and both.partitions["cpu"].max_walltime == 30
    with pytest.raises(OptionsError, match="gpus_per_node: 2 is out of range; allowed: 1 to 1"):
        validate_options({"gpus_per_node": 2}, both, "carol")
    assert profile.for_user("alice", ["other"]) == profile  # no limit names her
    assert validate_options({"gpus_per_node": 4}, profile, "alice").reservation is None


def test_limits_that_leave_nothing_say_so():
    profile = site({"group:a": {"partitions": ["cpu"]}, "group:b": {"partitions": ["gpu"]}}).snapshot()
    with pytest.raises(ValueError, match=r"limits for dave \(groups: a, b\) leave no partition"):
        profile.for_user("dave", ["b", "a"])


@pytest.mark.parametrize("limits, message", [
    ({"group:w": {"partitions": ["nope"]}}, "partitions nope not in the site's partitions"),
    ({"group:w": {"images": ["nope"]}}, "images nope not in the site's images"),
    ({"group:w": {"max_gpu": 1}}, "unknown key\\(s\\) max_gpu"),
    ({"group:w": {"reservation": "a b;rm"}}, "reservation 'a b;rm' is not a plain name"),
    ({"group:bad name": {}}, "give a user name or 'group:NAME'"),
    ({"group:w": {"max_walltime": "forever"}}, "walltime must be HH:MM"),
])
def test_a_bad_limit_is_refused_when_the_profile_is_read(limits, message):
    with pytest.raises(ValueError, match=message):
        site(limits).snapshot()


def _offer(user: str, groups: list[str], partition: str, image: str) -> str:
    return offer_json(site(WORKSHOP).snapshot().for_user(user, groups), user, partition, image, None)


def test_the_jobs_a_kernel_submits_keep_to_the_forms_limits_with_its_messages():
    offer = _offer("w01", ["workshop"], "cpu", "os")
    script = build_batch_script(validate_options({}, offer_profile(offer), "w01"), Slurm(), ScriptContext(
        python="/opt/venv/bin/python", output="/tmp/%j.log", workdir="/home/w01", offer=offer))
    assert f"export {OFFER_ENV}='{offer}'\n" in script
    cases = [(NewAllocation(partition="gpu"), "partition: 'gpu' is not offered; choose one of: cpu"),
             (NewAllocation(walltime="02:00:00"), r"longer than partition cpu allows \(01:30:00\)"),
             (NewAllocation(nodes=3), "nodes: 3 is out of range; allowed: 1 to 2"),
             (NewAllocation(gpus_per_rank=1), "gpus_per_node: 2 is out of range; allowed: 0 to 0")]
    for alloc, message in cases:
        with pytest.raises(ValueError, match=message + ".*hold for the jobs a kernel submits"):
            within_offer(alloc, 2, "hpcdl/os:latest", offer, "w01")
    with pytest.raises(ValueError, match="image: 'hpcdl/base:latest' is not offered; choose one of: os"):
        within_offer(NewAllocation(), 2, "hpcdl/base:latest", offer, "w01")
    taken = within_offer(NewAllocation(walltime=30), 2, None, offer, "w01")
    assert (taken.alloc.partition, taken.alloc.reservation, taken.image_ref) == ("cpu", "ws-dec", "hpcdl/os:latest")
    job = rank_job(taken.alloc, 2, "hpcdl-batch-x", "/tmp/out")
    assert "--reservation=ws-dec" in Slurm().rank_job_options(job)
    assert "-ar ws-dec" in GridEngine().rank_job_options(job)


def test_a_kernels_job_defaults_to_its_servers_partition_and_a_server_the_hub_did_not_start_checks_nothing():
    offer = _offer("alice", [], "cpu", "os")  # alice's server runs on cpu: her kernel's jobs go there unless told
    taken = within_offer(NewAllocation(nodes=2, gpus_per_rank=0), 4, "hpcdl/base:latest", offer, "alice")
    assert (taken.alloc.partition, taken.alloc.reservation, taken.image_ref) == ("cpu", None, "hpcdl/base:latest")
    gpu = within_offer(NewAllocation(partition="gpu", nodes=2, gpus_per_rank=2), 4, "hpcdl/base:latest", offer, "alice")
    assert gpu.alloc.partition == "gpu" and gpu.alloc.gpus_per_rank == 2
    free = within_offer(NewAllocation(walltime="99:00:00", partition="anything"), 2, None, "", "alice")
    assert free.alloc.partition == "anything" and free.image_ref == "hpcdl/base:latest"
    with pytest.raises(ValueError, match="not what the hub writes"):
        within_offer(NewAllocation(), 2, None, '{"partitions": 1}', "alice")


def test_a_kernels_ranks_default_to_the_image_it_runs_in_which_its_servers_offer_allows():
    spec = container_kernelspec("hpcdl/os:latest", "/opt/venv/bin/python")
    assert spec["env"] == {IMAGE_ENV: "hpcdl/os:latest"} and f"--env={IMAGE_ENV}" in spec["argv"]
    image = kernel_image(spec["env"])
    offer = _offer("w01", ["workshop"], "cpu", "os")  # the workshop offers its own image only
    assert within_offer(NewAllocation(walltime=30), 2, image, offer, "w01").image_ref == "hpcdl/os:latest"
    assert kernel_image({}) == DEFAULT_IMAGE  # a kernel outside our containers
    with pytest.raises(ValueError, match="image: 'hpcdl/base:latest' is not offered"):
        within_offer(NewAllocation(walltime=30), 2, kernel_image({}), offer, "w01")


def test_an_images_backends_are_a_list_of_names():
    c = Config()
    c.SiteProfile.partitions = {"gpu": {"max_nodes": 1}}
    c.SiteProfile.images = {"torch": {"ref": "hpcdl/torch:latest", "backends": ["horovod", "torch"]}}
    assert SiteProfile(config=c).snapshot().images["torch"].backends == ("horovod", "torch")
    c.SiteProfile.images = {"torch": {"ref": "hpcdl/torch:latest", "backends": "torch; rm -rf /"}}
    with pytest.raises(ValueError, match="must be a list of backend names"):
        SiteProfile(config=c).snapshot()
