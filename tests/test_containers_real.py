"""The container layer against real udocker (offline tools, P1): catalogue, containers created once, environment by
name, whole-tree stop, and a clear error for each bad input before anything starts."""
import glob
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from jupyter_hpcdl.containers.errors import InvalidSpec, ModeNotSupported, MountNotAllowed, ToolsMissing, UnknownImage
from jupyter_hpcdl.containers.spec import Mount, RunSpec, SitePolicy, UdockerInstall
from jupyter_hpcdl.containers.udocker import Udocker

pytestmark = pytest.mark.testbed
IMAGE = "test/os:1"


def _client(bed, repo, tools_dir=None, policy=None, **env):
    install = UdockerInstall(executable=f"{bed['venv']}/bin/udocker", udocker_dir=str(repo), allow_root=True,
                             tools_dir=tools_dir or f"{bed['prefix']}/udocker-tools")
    return Udocker(install, policy or SitePolicy(allowed_mount_roots=("/tmp",)), environ={**os.environ, **env})


@pytest.fixture(scope="module")
def ud(bed, tmp_path_factory):
    repo = tmp_path_factory.mktemp("udocker")
    client = _client(bed, repo, SECRET_TOKEN="s3cret-value-42", CUDA_VISIBLE_DEVICES="1,3")
    os_tar = sorted(glob.glob(f"{bed['cache']}/image/os-*.tar"))[0]
    client.import_tarball(os_tar, IMAGE)
    return client


@pytest.fixture(scope="module")
def container(ud):
    return ud.ensure_container(IMAGE)


def test_catalogue_lists_verifies_and_identifies(ud):
    assert IMAGE in ud.images()
    ud.verify(IMAGE)
    assert ud.image_id(IMAGE) == ud.image_id(IMAGE)


def test_container_is_created_once_and_reused(ud, container):
    assert ud.ensure_container(IMAGE) == container
    assert ud.containers().count(container) == 1 and len(ud.containers()) == 1


def test_run_passes_environment_by_name_never_on_a_command_line(ud, container):
    proc = ud.start(RunSpec(container, ["sh", "-c", 'echo "$SECRET_TOKEN $CUDA_VISIBLE_DEVICES"; sleep 5'],
                            env_names=["SECRET_TOKEN", "CUDA_VISIBLE_DEVICES", "NOT_SET"]),
                    stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(tree) >= 2
        assert not any("s3cret-value-42" in " ".join(p.cmdline()) for p in tree)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.stop()
    assert out.strip() == "s3cret-value-42 1,3"
    assert proc._private_dir is None, "the private env-file was not removed"


def test_mounts_workdir_and_exit_status(ud, container, tmp_path_factory):
    data = Path("/tmp") / f"hpcdl-mount-{os.getpid()}"
    data.mkdir(exist_ok=True)
    (data / "in.txt").write_text("hello\n")
    r = ud.run(RunSpec(container, ["sh", "-c", "cat in.txt; pwd; echo out > out.txt; exit 7"],
                       mounts=[Mount(str(data), "/data")], workdir="/data"), timeout=60)
    assert (r.returncode, r.stdout.split()) == (7, ["hello", "/data"])
    assert (data / "out.txt").read_text() == "out\n"


def test_stop_ends_the_whole_tree(ud, container):
    proc = ud.start(RunSpec(container, ["sh", "-c", "sleep 300 & sleep 300 & wait"]))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(psutil.Process(proc.pid).children(recursive=True)) < 3:
        time.sleep(0.2)
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert any("sleep" in " ".join(p.cmdline()) for p in tree)
    proc.stop(timeout=5)
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_load_an_oci_archive(bed, tmp_path):
    client = _client(bed, tmp_path / "repo")
    assert client.load(bed["os_archive"], "test/oci") == ["test/oci:latest"]
    name = client.ensure_container("test/oci:latest")
    r = client.run(RunSpec(name, ["cat", "/etc/debian_version"], bind_home=False), timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("12.")


def test_unknown_image_says_what_there_is_and_creates_nothing(ud):
    before = ud.containers()
    with pytest.raises(UnknownImage, match=r"'nope/none:1' is not in your udocker repository \(you have: test/os:1\).*pull"):
        ud.ensure_container("nope/none:1")
    assert ud.containers() == before


def test_unknown_container_is_refused_before_udocker_looks_online(ud):
    with pytest.raises(UnknownImage, match="ensure_container"):
        ud.start(RunSpec("not-a-container", ["true"]))


def test_missing_tools_are_reported_before_anything_starts(bed, tmp_path):
    client = _client(bed, tmp_path / "repo", tools_dir=str(tmp_path / "empty"))
    with pytest.raises(ToolsMissing, match="hpcdl-udocker-tools build"):
        client.images()
    assert not (tmp_path / "repo").exists()


def test_missing_udocker_is_reported(bed, tmp_path):
    client = Udocker(UdockerInstall(executable=str(tmp_path / "udocker")), environ={"PATH": "/nonexistent"})
    with pytest.raises(ToolsMissing, match="pip install udocker"):
        client.images()


def test_a_mode_that_cannot_run_here_is_refused(ud):
    with pytest.raises(ModeNotSupported, match="F1 can't run on this site"):
        ud.ensure_container(IMAGE, mode="F1")


def test_mount_outside_the_site_roots_is_refused(ud, container):
    with pytest.raises(MountNotAllowed, match="must be under /tmp"):
        ud.start(RunSpec(container, ["true"], mounts=[Mount("/etc")]))


def test_missing_tarball_is_named(ud):
    with pytest.raises(FileNotFoundError, match="/nonexistent.tar does not exist"):
        ud.import_tarball("/nonexistent.tar", "test/x:1")


def test_remove_container_and_image(bed, tmp_path):
    client = _client(bed, tmp_path / "repo")
    with pytest.raises(InvalidSpec, match="without a tag"):
        client.load(bed["os_archive"], "test/rm:1")
    client.load(bed["os_archive"], "test/rm")
    name = client.ensure_container("test/rm:latest")
    client.remove_container(name)
    client.remove_image("test/rm:latest")
    assert client.containers() == [] and client.images() == []
