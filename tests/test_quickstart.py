"""``hpcdl-containers``' front door without a container: which calls it takes, how a call's plan is made from a
remembered start, and that a remembered start is used only while everything it was resolved from holds."""
import os

import pytest

from jupyter_hpcdl.containers import quickstart
from jupyter_hpcdl.containers.spec import RunSpec, build_userns_plan


@pytest.mark.parametrize("argv, call", [
    (["run", "img:1", "--", "python3", "-c", "pass"], ("/etc/s.json", "img:1", [], [], ["python3", "-c", "pass"])),
    (["run", "-e", "A", "--env=B", "--env", "C_1", "--env-prefix", "OMPI_", "--env-prefix=PMIX_", "img", "--", "x"],
     ("/etc/s.json", "img", ["A", "B", "C_1"], ["OMPI_", "PMIX_"], ["x"])),
    (["--site", "/x.json", "run", "img", "--", "true"], ("/x.json", "img", [], [], ["true"])),
    (["--site=/y.json", "run", "img", "--", "true"], ("/y.json", "img", [], [], ["true"])),
])
def test_the_calls_it_takes(argv, call, monkeypatch):
    monkeypatch.setenv(quickstart.SITE_CONFIG_ENV, "/etc/s.json")
    assert quickstart.parse(argv) == call


@pytest.mark.parametrize("argv", [
    ["images"], ["--site", "/x.json", "images"], ["--site=", "run", "img", "--", "true"],
    ["run", "-v", "/tmp:/t", "img", "--", "true"],
    ["run", "-w", "/tmp", "img", "--", "true"], ["run", "--env-file", "f", "img", "--", "true"],
    ["run", "img", "true"], ["run", "img", "--"], ["run", "-e", "1BAD", "img", "--", "true"], ["run", "-e"],
    ["run", "--env=A-B", "img", "--", "true"], ["run", "-e", "A"],
])
def test_every_other_call_goes_the_full_way(argv):
    assert quickstart.parse(argv) is None


def test_a_working_directory_the_full_path_would_refuse_goes_the_full_way(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    odd = tmp_path / "a:b"
    odd.mkdir()
    monkeypatch.chdir(odd)
    monkeypatch.setattr(quickstart, "remembered", lambda site, image: {"root": "/", "env": {}, "workdir": "/"})
    assert quickstart.run(["run", "img", "--", "true"]) is None


def test_a_calls_plan_is_the_full_paths(tmp_path, monkeypatch):
    """The plan made from a remembered start equals the one the full path builds for the same call."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    environ = {"TERM": "xterm", "A": "1", "OMPI_X": "2", "OMPI_Y": "3", "HOME": str(tmp_path), "SECRET": "no"}
    image_env = ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"]
    args = dict(root="/r", image_env=image_env, env_files={}, system_mounts=["/etc/hosts"], home=str(tmp_path),
                uid=1001, gid=1001, user="alice", exists=lambda p: True)
    base = build_userns_plan(RunSpec("c", ["true"], user="alice"), environ={}, **args)
    base["env"]["HPCDL_CONTAINER_MODE"] = "userns"
    names = ["A", "HPCDL_CONTAINER_MODE"]  # a name the caller passes cannot change the mode said inside
    full = build_userns_plan(RunSpec("c", ["python3", "-c", "pass"], env_names=[*names, "OMPI_X", "OMPI_Y"],
                                     workdir=str(tmp_path), user="alice"),
                             environ={**environ, "HPCDL_CONTAINER_MODE": "P9"}, **args)
    full["env"]["HPCDL_CONTAINER_MODE"] = "userns"
    mine = quickstart.plan_for(base, names, ["OMPI_"], ["python3", "-c", "pass"],
                               {**environ, "HPCDL_CONTAINER_MODE": "P9"})
    assert mine == full and "SECRET" not in mine["env"]
    monkeypatch.chdir("/")
    assert quickstart.plan_for(base, [], [], ["true"], {})["workdir"] == str(tmp_path)  # outside home: home


def test_a_remembered_start_holds_only_while_what_it_came_from_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    site, manifest, decision = (tmp_path / n for n in ("site.json", "manifest", "decision.json"))
    for f in (site, manifest, decision):
        f.write_text("{}")
    root = tmp_path / "ROOT"
    root.mkdir()
    mounts = [str(tmp_path / "scratch")]  # a site's system mount that this node does not have (yet)
    plan = {"root": str(root), "env": {"HPCDL_CONTAINER_MODE": "userns"}, "binds": [], "uid": 1, "gid": 1}
    quickstart.remember(str(site), "img", plan, str(manifest), str(decision), mounts)
    assert oct(os.stat(os.path.dirname(quickstart.starts_file())).st_mode & 0o777) == "0o700"
    assert quickstart.remembered(str(site), "img") == plan and quickstart.remembered(str(site), "other") is None
    assert quickstart.remembered(str(tmp_path / "other.json"), "img") is None  # another site's file

    def changed(touch) -> bool:
        quickstart.remember(str(site), "img", plan, str(manifest), str(decision), mounts)
        touch()
        return quickstart.remembered(str(site), "img") is None

    assert changed(lambda: site.write_text('{"ContainerSite": {}}'))
    assert changed(lambda: manifest.write_text("new content"))
    assert changed(lambda: decision.write_text('{"mode": "P1"}'))  # the fast path failed here since
    assert changed(lambda: monkeypatch.setenv("USER", "someone-else"))
    assert changed(lambda: root.rename(tmp_path / "gone"))  # the container was removed
    (tmp_path / "gone").rename(root)
    assert changed(lambda: (tmp_path / "scratch").mkdir())  # a system mount appeared: bind it
    assert changed(lambda: site.unlink())  # no site file: the defaults, resolved anew
    quickstart.remember(str(site), "img", plan, str(manifest), str(decision), mounts)
    assert quickstart.remembered(str(site), "img") is not None  # ...and then remembered without one
    site.write_text("{}")
    root.rename(tmp_path / "gone")
    (tmp_path / "gone").rename(root)
    quickstart.remember(str(site), "img", plan, str(manifest), str(decision), mounts)
    quickstart.forget("img")
    assert quickstart.remembered(str(site), "img") is None
