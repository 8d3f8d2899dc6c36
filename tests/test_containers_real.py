"""The container layer against real udocker (offline tools): catalogue, containers created once, environment by
name, whole-tree stop, and a clear error for each bad input before anything starts — each run twice: on the fast
path (user namespaces, no ptrace) and in P1 (the fast path turned off by the site's configuration)."""
import glob
import os
import shutil
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


def _client(bed, repo, tools_dir=None, policy=None, fast_path="auto", **env):
    install = UdockerInstall(executable=f"{bed['venv']}/bin/udocker", udocker_dir=str(repo), allow_root=True,
                             tools_dir=tools_dir or f"{bed['prefix']}/udocker-tools")
    return Udocker(install, policy or SitePolicy(allowed_mount_roots=("/tmp",), fast_path=fast_path),
                   environ={**os.environ, **env})


MODES = {"userns": "userns", "off": "P1"}  # the site's fast_path -> the mode the containers run in


@pytest.fixture(scope="module", params=sorted(MODES))
def ud(bed, tmp_path_factory, request):
    repo = tmp_path_factory.mktemp("udocker")
    client = _client(bed, repo, fast_path=request.param, SECRET_TOKEN="s3cret-value-42", CUDA_VISIBLE_DEVICES="1,3")
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


def test_the_mode_it_runs_in_is_the_sites_and_said_inside(ud, container):
    r = ud.run(RunSpec(container, ["sh", "-c", 'echo "$HPCDL_CONTAINER_MODE"']), timeout=60)
    assert r.stdout.strip() == MODES[ud.policy.fast_path] == ud.mode_for(container).mode


def test_stdout_and_stderr_stay_apart_and_the_exit_code_is_the_commands(ud, container):
    r = ud.run(RunSpec(container, ["sh", "-c", "echo out; echo err >&2; exit 3"]), timeout=60)
    assert (r.returncode, r.stdout, r.stderr.strip().splitlines()[-1:]) == (3, "out\n", ["err"])
    missing = ud.run(RunSpec(container, ["no-such-command"]), timeout=60)
    assert "no-such-command" in missing.stderr  # 127 as a shell says it on the fast path; udocker's P1 says 2
    assert missing.returncode == {"userns": 127, "P1": 2}[MODES[ud.policy.fast_path]]


def test_the_users_own_uid_and_loopback_tcp_inside(ud, container):
    import socket
    r = ud.run(RunSpec(container, ["id", "-u"]), timeout=60)
    assert r.stdout.strip() == str(os.getuid())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = ud.start(RunSpec(container, ["python3", "-c", "import socket,sys; s=socket.create_connection(('127.0.0.1',"
                                            f" {port}), timeout=20); s.sendall(b'hi from inside'); s.close()"]))
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            assert conn.recv(100) == b"hi from inside"
        assert proc.wait(60) == 0


def test_a_signal_reaches_the_command_and_its_exit_code_comes_back(ud, container):
    proc = ud.start(RunSpec(container, ["sh", "-c", "trap 'echo got TERM; exit 9' TERM; echo ready; "
                                                    "while :; do sleep 0.1; done"]),
                    stdout=subprocess.PIPE, text=True)
    try:
        assert proc.popen.stdout.readline().strip() == "ready"
        assert proc.signal_payload(15) >= 1
        assert proc.wait(30) == 9
        assert proc.popen.stdout.read().strip() == "got TERM"
    finally:
        proc.stop()


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


def test_an_images_links_keep_binds_in_its_root_and_the_node_its_fast_path(bed, tmp_path):
    """An image whose /home is a link to a host path and whose /etc/resolv.conf dangles: a mount through the link
    lands inside the container root (nothing is made on the host), the dangling optional bind costs the node
    nothing, and a mount source that links out of the allowed roots is judged where it leads."""
    client = _client(bed, tmp_path / "repo")
    client.import_tarball(sorted(glob.glob(f"{bed['cache']}/image/os-*.tar"))[0], "test/links:1")
    container = client.ensure_container("test/links:1")
    root = Path(client.container_dir(container)) / "ROOT"
    escape = Path(f"/tmp/hpcdl-escape-{os.getpid()}")
    shutil.rmtree(escape, ignore_errors=True)
    shutil.rmtree(root / "home")
    os.symlink(escape, root / "home")
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    os.symlink("../run/hpcdl-nowhere/stub-resolv.conf", root / "etc/resolv.conf")
    data = Path(f"/tmp/hpcdl-links-{os.getpid()}")
    data.mkdir(exist_ok=True)
    (data / "in.txt").write_text("through the link\n")
    r = client.run(RunSpec(container, ["cat", "/home/alice/data/in.txt"], mounts=[Mount(str(data), "/home/alice/data")]),
                   timeout=60)
    assert (r.returncode, r.stdout) == (0, "through the link\n"), r.stderr
    assert not escape.exists(), f"a bind target was made on the host, outside the container root: {escape}"
    assert (root / escape.relative_to("/") / "alice/data").is_dir()
    assert client.mode_for(container).mode == "userns" and "P1" not in r.stderr, r.stderr
    link = Path(f"/tmp/hpcdl-link-{os.getpid()}")
    link.unlink(missing_ok=True)
    os.symlink("/etc", link)
    with pytest.raises(MountNotAllowed, match="mount of /etc is not allowed"):
        client.start(RunSpec(container, ["true"], mounts=[Mount(str(link), "/host")]))
    link.unlink()
    shutil.rmtree(data)


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


IN_A_CHROOT = r"""
import json, os, sys
from jupyter_hpcdl.containers.spec import RunSpec, SitePolicy, UdockerInstall
from jupyter_hpcdl.containers.udocker import Udocker
bed, repo, name, fast_path = sys.argv[1:5]
bed = json.loads(bed)
install = UdockerInstall(executable=bed["venv"] + "/bin/udocker", udocker_dir=repo, allow_root=True,
                         tools_dir=bed["prefix"] + "/udocker-tools")
ud = Udocker(install, SitePolicy(allowed_mount_roots=("/tmp",), fast_path=fast_path))
try:
    r = ud.run(RunSpec(name, ["sh", "-c", 'echo "$HPCDL_CONTAINER_MODE"; exit 5']), timeout=60)
    print(json.dumps({"rc": r.returncode, "out": r.stdout, "err": r.stderr, "mode": ud.mode_for(name).mode}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def _in_a_chroot(bed, tmp_path, repo, name, fast_path):
    """Run a container start from inside a chroot (a bind of / in a private mount namespace): the kernel refuses
    user namespaces to a chrooted process, as it does inside many containers."""
    import json
    top = tmp_path / "chroot"
    top.mkdir(exist_ok=True)
    script = (f"mount --rbind / {top} && exec chroot {top} {bed['venv']}/bin/python -c \"$0\" \"$@\"")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, IN_A_CHROOT,
                          json.dumps({k: bed[k] for k in ("venv", "prefix")}), str(repo), name, fast_path],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "said": out.stderr}


@pytest.mark.skipif(os.geteuid() != 0, reason="making a chroot for the test needs root")
def test_where_user_namespaces_are_refused_p1_runs_and_a_failure_midway_falls_back_saying_so(bed, tmp_path):
    """auto: where the kernel refuses user namespaces (here: a chrooted caller, as inside many containers) the
    probe picks P1 and says why; a node whose cached answer was 'userns' but that fails at start falls back to P1
    with a message, and remembers; a site that forces the fast path gets an error instead."""
    from jupyter_hpcdl.containers.fastpath import cache_file, read_cached, cache_key

    repo = tmp_path / "repo"
    client = _client(bed, repo, fast_path="auto")
    client.import_tarball(sorted(glob.glob(f"{bed['cache']}/image/os-*.tar"))[0], IMAGE)
    name = client.ensure_container(IMAGE)
    assert client.mode_for(name).mode == "userns"  # probed outside the chroot: this machine has them
    fell_back = _in_a_chroot(bed, tmp_path, repo, name, "auto")
    assert (fell_back["rc"], fell_back["out"].strip(), fell_back["mode"]) == (5, "P1", "P1"), fell_back
    assert "the fast path failed on this node (unshare" in fell_back["said"], fell_back  # the caller's stderr
    assert "running in P1 instead" in fell_back["said"]
    assert read_cached(cache_file(str(repo)), cache_key()).mode == "P1", "the failure was not remembered"
    os.unlink(cache_file(str(repo)))
    probed = _in_a_chroot(bed, tmp_path, repo, name, "auto")
    assert (probed["out"].strip(), probed["mode"]) == ("P1", "P1") and "failed" not in probed["said"], probed
    assert "unshare" in read_cached(cache_file(str(repo)), cache_key()).reason
    os.unlink(cache_file(str(repo)))
    forced = _in_a_chroot(bed, tmp_path, repo, name, "userns")
    assert "the site asks for the fast path, but it does not run on this node" in forced.get("error", ""), forced
