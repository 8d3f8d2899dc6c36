"""The offline udocker tools: built from the distribution's packages, with the proot wrapper's two fixes."""
import os
import subprocess
import sys
import tarfile

import pytest

from jupyter_hpcdl.containers.errors import ToolsMissing
from jupyter_hpcdl.containers.tools import TOOLS_RELEASE, build_tools_tarball, check_tools, install_tools, tool_names


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    tarball = build_tools_tarball(str(tmp / "tools.tar.gz"))
    return install_tools(tarball, str(tmp / "installed"))


def test_tarball_has_udocker_layout(tmp_path):
    tarball = build_tools_tarball(str(tmp_path / "t.tar.gz"))
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    for rel in tool_names().values():
        assert f"udocker_dir/{rel}" in names
    assert f"udocker_dir/{tool_names()['proot']}.real" in names


def test_installed_tools_pass_the_check(tools_dir):
    assert check_tools(tools_dir) == tools_dir
    with open(os.path.join(tools_dir, "lib/VERSION")) as f:
        assert f.read().strip() == TOOLS_RELEASE


def _fake_real_proot(tools_dir, tmp_path, body):
    """Copy the wrapper beside a stand-in for the real proot, so what the wrapper passes on can be seen."""
    wrapper = tmp_path / "proot"
    wrapper.write_bytes(open(os.path.join(tools_dir, tool_names()["proot"]), "rb").read())
    wrapper.chmod(0o755)
    real = tmp_path / "proot.real"
    real.write_text(f"#!{sys.executable}\n{body}")
    real.chmod(0o755)
    return str(wrapper)


def test_wrapper_drops_kernel_release_before_root_only(tools_dir, tmp_path):
    wrapper = _fake_real_proot(tools_dir, tmp_path, "import sys, json; print(json.dumps(sys.argv[1:]))")
    out = subprocess.run([wrapper, "-b", "/x", "-k", "6.1.0", "--kernel-release=5.0", "-r", "/root", "-w", "/",
                          "prog", "-k", "keep"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == '["-b", "/x", "-r", "/root", "-w", "/", "prog", "-k", "keep"]'


def test_wrapper_makes_statx_and_faccessat2_fall_back(tools_dir, tmp_path):
    body = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for nr in (332, 439):\n"
            "    libc.syscall(nr, -100, b'/', 0, 0, 0)\n"
            "    print(nr, ctypes.get_errno())\n"
            "print('stat', os.stat('/').st_ino > 0)\n")
    wrapper = _fake_real_proot(tools_dir, tmp_path, body)
    out = subprocess.run([wrapper], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:3] == ["332 38", "439 38", "stat True"]  # 38 = ENOSYS


def test_missing_tools_say_how_to_build_them(tmp_path):
    with pytest.raises(ToolsMissing, match="hpcdl-udocker-tools build"):
        check_tools(str(tmp_path))


def test_missing_distribution_binary_names_the_package(tmp_path):
    with pytest.raises(ToolsMissing, match="install the distribution's proot package"):
        build_tools_tarball(str(tmp_path / "t.tar.gz"), proot=str(tmp_path / "nope"))
