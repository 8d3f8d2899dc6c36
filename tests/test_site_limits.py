"""Limits per user and per JupyterHub group (a workshop's partition, GPUs, walltime, reservation): what the form
offers, what a request may ask for, and what reaches the batch script."""
from __future__ import annotations

import pytest
from traitlets.config import Config

from jupyter_hpcdl.spawner.options import OptionsError, validate_options
from jupyter_hpcdl.spawner.profile import SiteProfile
from jupyter_hpcdl.spawner.script import ScriptContext, build_batch_script
from jupyter_hpcdl.batchsystems.slurm import Slurm


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
