"""The pure builders of udocker command lines, alone."""
import pytest
from hypothesis import given, strategies as st

from jupyter_hpcdl.containers.errors import InvalidSpec, ModeNotSupported, MountNotAllowed
from jupyter_hpcdl.containers.nsexec import CONTAINER_FAILURE, ContainerFailed, resolve_in_root
from jupyter_hpcdl.containers.spec import (
    Mount, RunSpec, SitePolicy, UdockerInstall, build_create_command, build_pull_command, build_run_command,
    build_setup_command, check_image_ref, check_mode, check_run_spec, container_name_for, env_file_text, udocker_env,
)

INSTALL = UdockerInstall(executable="/opt/u/bin/udocker", udocker_dir="~/.udocker", tools_dir="/opt/tools")
POLICY = SitePolicy(allowed_mount_roots=("~", "/scratch"), home="/home/alice")


def test_run_command_has_every_option_and_no_env_value():
    spec = check_run_spec(RunSpec(
        container="c1", command=["python3", "-c", "print(1)"], mounts=[Mount("/scratch/data", "/data"), Mount("/home/alice/x")],
        env_names=["CUDA_VISIBLE_DEVICES", "JUPYTERHUB_API_TOKEN"], workdir="/data", user="alice", cpuset="0-1"), POLICY)
    argv = build_run_command(spec, INSTALL, env_file="/tmp/p/env")
    assert argv == ["/opt/u/bin/udocker", "-q", "run", "--nobanner", "--hostauth", "--bindhome", "--user=alice",
                    "--workdir=/data", "--cpuset-cpus=0-1", "--volume=/scratch/data:/data",
                    "--volume=/home/alice/x:/home/alice/x", "--env-file=/tmp/p/env", "c1", "python3", "-c", "print(1)"]


def test_root_gets_allow_root_and_plain_run_is_minimal():
    argv = build_run_command(RunSpec("c1", ["true"], hostauth=False, bind_home=False),
                             UdockerInstall(executable="udocker", allow_root=True))
    assert argv == ["udocker", "-q", "--allow-root", "run", "--nobanner", "c1", "true"]


def test_env_names_need_an_env_file():
    with pytest.raises(InvalidSpec, match="env_file"):
        build_run_command(RunSpec("c1", ["true"], env_names=["A"]), INSTALL)


def test_env_file_text_carries_values_by_name_only_for_set_variables():
    text = env_file_text(["A", "SECRET", "UNSET"], {"A": "1", "SECRET": "s3cr=t", "OTHER": "x"})
    assert text == "A=1\nSECRET=s3cr=t\n"
    with pytest.raises(InvalidSpec, match="line break"):
        env_file_text(["A"], {"A": "1\nB=2"})


def test_udocker_env_never_downloads_and_points_at_shared_tools():
    env = udocker_env(INSTALL, {"HOME": "/home/alice", "PATH": "/usr/bin"})
    assert env["UDOCKER_DIR"] == "/home/alice/.udocker"
    assert env["UDOCKER_TARBALL"] == ""
    assert env["UDOCKER_BIN"] == "/opt/tools/bin" and env["UDOCKER_LIB"] == "/opt/tools/lib"
    assert env["UDOCKER_DEFAULT_EXECUTION_MODE"] == "P1" and env["PATH"] == "/usr/bin"


@pytest.mark.parametrize("path", ["/etc", "/home/bob/data", "/home/alice/../bob", "/scratchy", "/"])
def test_mounts_outside_allowed_roots_are_refused(path):
    with pytest.raises(MountNotAllowed, match=r"must be under /home/alice, /scratch"):
        check_run_spec(RunSpec("c1", ["true"], mounts=[Mount(path)]), POLICY)


@pytest.mark.parametrize("mount", [Mount("relative/dir"), Mount("/scratch/a:b"), Mount("/scratch/a\nb"), Mount("/scratch/a", "rel")])
def test_malformed_mounts_are_refused(mount):
    with pytest.raises(InvalidSpec, match="absolute path"):
        check_run_spec(RunSpec("c1", ["true"], mounts=[mount]), POLICY)


@pytest.mark.parametrize("field,value,message", [
    ("container", "bad name", "container name"),
    ("container", "-x", "container name"),
    ("command", "echo hi", "argv"),
    ("command", [], "argv"),
    ("env_names", ["A-B"], "variable name"),
    ("user", "alice;id", "user"),
    ("cpuset", "0;1", "cpuset"),
    ("workdir", "data", "absolute path"),
])
def test_each_bad_field_is_named(field, value, message):
    kwargs = {"container": "c1", "command": ["true"], field: value}
    with pytest.raises(InvalidSpec, match=message):
        check_run_spec(RunSpec(**kwargs), POLICY)


def test_modes_that_cannot_run_here_say_why_and_what_to_use():
    with pytest.raises(ModeNotSupported, match=r"F1 can't run on this site \(fakechroot.*use one of: P1, P2"):
        check_mode("F1", POLICY)
    with pytest.raises(ModeNotSupported, match="unknown execution mode"):
        check_mode("X9", POLICY)
    assert check_mode("P2", POLICY) == "P2"


def test_create_setup_pull_commands():
    assert build_create_command("hpcdl/base:1", "c1", INSTALL)[-3:] == ["create", "--name=c1", "hpcdl/base:1"]
    assert build_setup_command("c1", INSTALL, mode="P1", nvidia=True)[-5:] == ["setup", "--execmode=P1", "--nvidia", "--force", "c1"]
    assert build_pull_command("hpcdl/base:1", INSTALL, "http://127.0.0.1:5000/")[-3:] == [
        "pull", "--registry=http://127.0.0.1:5000", "hpcdl/base:1"]
    with pytest.raises(InvalidSpec, match="registry"):
        build_pull_command("hpcdl/base:1", INSTALL, "127.0.0.1:5000")


@pytest.mark.parametrize("ref", ["127.0.0.1:5000/hpcdl/base:1", "Hpcdl/Base", "a b", "x:y:z", "hpcdl/base:1;rm -rf /", ""])
def test_bad_image_references_are_refused(ref):
    with pytest.raises(InvalidSpec, match="image reference"):
        check_image_ref(ref)


def test_container_name_follows_image_content():
    a = container_name_for("hpcdl/base:latest", "a" * 64)
    assert a == "hpcdl-hpcdl_base_latest-aaaaaaaaaaaa"
    assert container_name_for("hpcdl/base:latest", "b" * 64) != a


@given(st.text(max_size=40))
def test_no_generated_container_name_can_carry_shell_syntax(name):
    try:
        check_run_spec(RunSpec(name, ["true"]), POLICY)
    except InvalidSpec:
        return
    assert all(c.isalnum() or c in "_.-" for c in name) and name[0].isalnum()


def test_variables_passed_by_prefix_are_the_set_ones_with_valid_names():
    from jupyter_hpcdl.containers.spec import InvalidSpec, names_with_prefixes

    env = {"PMIX_RANK": "0", "PMIX_SERVER_URI4": "x", "SLURM_PROCID": "1", "HOME": "/h", "PMIX-BAD": "1"}
    assert names_with_prefixes(env, ["PMIX_"]) == ["PMIX_RANK", "PMIX_SERVER_URI4"]
    assert names_with_prefixes(env, ["PMIX_", "SLURM_"]) == ["PMIX_RANK", "PMIX_SERVER_URI4", "SLURM_PROCID"]
    assert names_with_prefixes(env, []) == []
    with pytest.raises(InvalidSpec, match="prefix"):
        names_with_prefixes(env, ["PMIX;"])


# -- the fast path's plan and its choice per node (pure) ----------------------------------------------------------------
def test_userns_plan_binds_what_udocker_binds_and_keeps_env_values_off_the_argv():
    from jupyter_hpcdl.containers.spec import build_userns_plan

    spec = check_run_spec(RunSpec("c1", ["python3", "-c", "print(1)"], mounts=[Mount("/scratch/data", "/data")],
                                  env_names=["SECRET", "UNSET"], env_files=["/home/alice/e.env"], workdir="/data",
                                  cpuset="0,2-3"), POLICY)
    plan = build_userns_plan(spec, "/u/c1/ROOT", ["PATH=/venv/bin:/usr/bin", "LANG=C.UTF-8"], {"SECRET": "s3", "TERM": "xterm"},
                             {"/home/alice/e.env": "# mine\nMY=1\n"}, ["/etc/hosts"], "/home/alice", 1001, 1001, "alice",
                             exists=lambda p: p != "/lib/modules")
    targets = [b["target"] for b in plan["binds"]]
    assert targets == ["/dev", "/proc", "/sys", "/etc/resolv.conf", "/etc/host.conf", "/etc/hosts", "/etc/passwd",
                       "/etc/group", "/home/alice", "/data"]
    assert [b for b in plan["binds"] if b.get("readonly")] == [
        {"source": "/etc/passwd", "target": "/etc/passwd", "readonly": True},
        {"source": "/etc/group", "target": "/etc/group", "readonly": True}]
    assert plan["env"] == {"PATH": "/venv/bin:/usr/bin", "LANG": "C.UTF-8", "TERM": "xterm", "HOME": "/home/alice",
                           "USER": "alice", "LOGNAME": "alice", "USERNAME": "alice", "SECRET": "s3", "MY": "1"}
    assert (plan["uid"], plan["gid"], plan["workdir"], plan["cpus"]) == (1001, 1001, "/data", [0, 2, 3])
    assert plan["argv"] == ["python3", "-c", "print(1)"] and "s3" not in " ".join(plan["argv"])


def test_userns_plan_never_changes_who_runs():
    from jupyter_hpcdl.containers.spec import build_userns_plan

    with pytest.raises(InvalidSpec, match="the fast path runs as you"):
        build_userns_plan(RunSpec("c1", ["true"], user="root"), "/r", [], {}, {}, [], "/home/alice", 1001, 1001,
                          "alice")


def test_the_choice_per_node_is_cached_and_the_site_decides(tmp_path):
    from jupyter_hpcdl.containers.fastpath import decide

    calls = []

    def prober(root, env):
        calls.append(root)
        return False, "unshare(user and mount namespaces): Operation not permitted (errno 1)"

    assert decide("off", "/r", str(tmp_path), {}, prober).mode == "P1" and calls == []
    first = decide("auto", "/r", str(tmp_path), {}, prober)
    again = decide("auto", "/r", str(tmp_path), {}, prober)
    assert (first.mode, again.mode, len(calls)) == ("P1", "P1", 1), "the probe was not cached"
    with pytest.raises(ModeNotSupported, match="does not run on this node: unshare"):
        decide("userns", "/r", str(tmp_path), {}, prober)
    with pytest.raises(ModeNotSupported, match="fast_path must be one of auto, userns, off"):
        decide("fast", "/r", str(tmp_path), {}, prober)


def test_the_fast_paths_launcher_finds_the_c_library_without_running_ldconfig():
    """The launcher starts with every containerized command: ``ctypes.util.find_library`` would run ``ldconfig -p``
    in a subprocess first (about 0.1 s a start); the interpreter's own symbols serve."""
    import subprocess
    import sys

    from jupyter_hpcdl.containers.fastpath import NSEXEC

    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('nsexec', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print('ctypes.util' in sys.modules, all(hasattr(m._libc, n) for n in ('unshare', 'mount', 'prctl')))")
    out = subprocess.run([sys.executable, "-S", "-E", "-c", code, NSEXEC], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_paths_resolve_inside_the_container_root_as_the_container_sees_them(tmp_path):
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "home").symlink_to("/srv/homes")  # absolute: from the container's root, not the host's
    (root / "up").symlink_to("../../../../..")  # never above the root
    (root / "loop").symlink_to("loop")
    assert resolve_in_root(str(root), "/lib/x.so") == f"{root}/usr/lib/x.so"
    assert resolve_in_root(str(root), "/home/alice/data") == f"{root}/srv/homes/alice/data"
    assert resolve_in_root(str(root), "/up/etc/passwd") == f"{root}/etc/passwd"
    assert resolve_in_root(str(root), "/../../etc") == f"{root}/etc"
    with pytest.raises(ContainerFailed, match="more than 40 symbolic links") as e:
        resolve_in_root(str(root), "/loop/x")
    assert str(e.value).startswith(CONTAINER_FAILURE)


def test_a_mount_is_judged_where_its_links_lead(tmp_path):
    allowed = tmp_path / "scratch"
    allowed.mkdir()
    (allowed / "etc").symlink_to("/etc")
    policy = SitePolicy(allowed_mount_roots=(str(allowed),), home="/home/alice")
    with pytest.raises(MountNotAllowed, match="mount of /etc is not allowed"):
        check_run_spec(RunSpec("c1", ["true"], mounts=[Mount(str(allowed / "etc"))]), policy)
    (allowed / "data").mkdir()
    (allowed / "here").symlink_to("data")
    spec = check_run_spec(RunSpec("c1", ["true"], mounts=[Mount(str(allowed / "here"), "/d")]), policy)
    assert spec.mounts[0].host_path == str(allowed / "data")
