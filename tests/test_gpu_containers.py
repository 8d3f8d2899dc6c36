"""The GPU inside the user's container, in each mode — the fast path (user namespaces) and P1 (the fast path turned
off by the site) — with the driver's libraries that ``udocker setup --nvidia`` copies in: the container sees the
node's GPUs as the host does, runs a CUDA kernel with the right result, and sees only what CUDA_VISIBLE_DEVICES,
passed by name, gives it. Needs an NVIDIA GPU (skipped elsewhere); the kit is the bed's, or a lent GPU machine's
(``benchmarks/gpu/device_check.sh``)."""
import os
import shutil
import subprocess

import pytest

from gpukit import IMAGE, MODES, NoKit, client, find_kit, last_json, probe_spec
from jupyter_hpcdl.containers.spec import RunSpec

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    try:
        return find_kit(tmp_path_factory.mktemp("gpu-probe"))
    except NoKit as e:
        if os.environ.get("HPCDL_REQUIRE_GPU") == "1":
            pytest.fail(f"HPCDL_REQUIRE_GPU=1 but {e}", pytrace=False)
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def native(kit):
    r = subprocess.run([kit.probe, "info"], capture_output=True, text=True, timeout=120)
    answer = last_json(r.stdout)
    assert answer["ok"] and answer["count"] >= 1 and answer["kernel_ok"], answer
    return answer


@pytest.fixture(scope="module", params=sorted(MODES))
def gpu_container(kit, tmp_path_factory, request):
    """A udocker repository of its own per mode, the image imported and the container created, which sets up the
    driver's libraries because the node has them."""
    repo = tmp_path_factory.mktemp(f"udocker-gpu-{request.param}")
    ud = client(kit, repo, request.param)
    ud.import_tarball(kit.rootfs, IMAGE)
    return ud, ud.ensure_container(IMAGE)


def test_the_container_sees_the_hosts_gpus_and_runs_a_kernel_in_each_mode(kit, native, gpu_container):
    ud, name = gpu_container
    assert ud.mode_for(name).mode == MODES[ud.policy.fast_path]
    r = ud.run(probe_spec(name, kit, "info"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    inside = last_json(r.stdout)
    assert inside["ok"] and inside["kernel_ok"], inside
    assert (inside["count"], inside["devices"], inside["driver"]) == (native["count"], native["devices"],
                                                                       native["driver"])
    said = ud.run(RunSpec(name, ["sh", "-c", 'echo "$HPCDL_CONTAINER_MODE"']), timeout=120)
    assert said.stdout.strip() == MODES[ud.policy.fast_path]


def test_nvidia_smi_copied_in_lists_the_gpus_in_each_mode(native, gpu_container):
    smi = shutil.which("nvidia-smi", path="/usr/bin")
    with open(smi or os.devnull, "rb") as f:
        if f.read(4) != b"\x7fELF":  # a lent machine had a script there that runs the driver's own elsewhere
            pytest.skip("this node's nvidia-smi is not a program in /usr/bin, where udocker setup --nvidia copies it from")
    ud, name = gpu_container
    r = ud.run(RunSpec(name, ["nvidia-smi", "-L"]), timeout=120)
    assert r.returncode == 0, r.stderr
    assert [line.startswith("GPU ") for line in r.stdout.splitlines()].count(True) == native["count"], r.stdout


@pytest.mark.parametrize("visible", ["", "0"])
def test_cuda_visible_devices_passed_by_name_decides_what_the_container_sees(kit, native, gpu_container, visible):
    ud, name = gpu_container
    ud_with = client(kit, ud.install.udocker_dir, ud.policy.fast_path, CUDA_VISIBLE_DEVICES=visible)
    r = ud_with.run(probe_spec(name, kit, "info", env_names=("CUDA_VISIBLE_DEVICES",)), timeout=300)
    inside = last_json(r.stdout)
    assert inside["ok"], inside
    if visible == "":
        assert inside["count"] == 0, inside
    else:
        assert inside["count"] == 1 and inside["devices"][0] == native["devices"][0] and inside["kernel_ok"], inside
