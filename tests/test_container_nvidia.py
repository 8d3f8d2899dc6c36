"""The driver's libraries in a container, made whole after ``udocker setup --nvidia`` (no GPU needed): a node whose
driver lives in its own directory, with absolute links to it elsewhere, as the GPU machine of the device check had
(``/usr/local/nvidia/lib64`` and links in ``/usr/lib``)."""
import os

from jupyter_hpcdl.containers.nvidia import container_has_driver, host_has_nvidia, repair_driver_links, resolve_in_root

LIBDIR = "usr/lib/x86_64-linux-gnu"


def _node_and_container(tmp_path):
    """The node: the driver in nvidia/lib64, absolute links to it in usr/lib. The container: what udocker copies
    when the usr/lib directory is walked last (absolute links), and the driver's file copied from nvidia/lib64."""
    driver = tmp_path / "node" / "nvidia" / "lib64"
    driver.mkdir(parents=True)
    (driver / "libcuda.so.580.1").write_bytes(b"cuda" * 100)
    (driver / "libnvidia-ml.so.580.1").write_bytes(b"nvml")
    os.symlink("libcuda.so.580.1", driver / "libcuda.so.1")
    inside = tmp_path / "root" / LIBDIR
    inside.mkdir(parents=True)
    (inside / "libc.so.6").write_bytes(b"libc")
    (inside / "libcuda.so.580.1").write_bytes(b"cuda" * 100)
    os.symlink(str(driver / "libcuda.so.1"), inside / "libcuda.so.1")  # as udocker copies /usr/lib's link
    os.symlink(str(driver / "libnvidia-ml.so.580.1"), inside / "libnvidia-ml.so.1")  # its file not copied
    os.symlink("/nowhere/libnvidia-tls.so.1", inside / "libnvidia-tls.so.1")  # neither inside nor on the node
    return str(tmp_path / "root"), driver


def test_links_that_lead_out_of_the_container_are_pointed_at_the_copied_files(tmp_path):
    root, driver = _node_and_container(tmp_path)
    assert not container_has_driver(root), "an absolute link to the node's directory does not resolve inside"
    assert sorted(repair_driver_links(root)) == ["libcuda.so.1", "libnvidia-ml.so.1"]
    assert container_has_driver(root)
    assert os.readlink(os.path.join(root, LIBDIR, "libcuda.so.1")) == "libcuda.so.580.1"
    copied = resolve_in_root(root, f"/{LIBDIR}/libnvidia-ml.so.1")
    assert copied == os.path.join(root, LIBDIR, "libnvidia-ml.so.580.1") and open(copied, "rb").read() == b"nvml"
    assert os.readlink(os.path.join(root, LIBDIR, "libnvidia-tls.so.1")) == "/nowhere/libnvidia-tls.so.1"
    assert repair_driver_links(root) == [], "a second repair finds nothing to do"


def test_a_container_without_the_driver_or_with_links_climbing_out_has_none(tmp_path):
    root = tmp_path / "root"
    (root / LIBDIR).mkdir(parents=True)
    assert not container_has_driver(str(root)) and repair_driver_links(str(root)) == []
    (tmp_path / "outside.so").write_bytes(b"x")
    os.symlink("../../../../outside.so", root / LIBDIR / "libcuda.so.1")
    assert resolve_in_root(str(root), f"/{LIBDIR}/libcuda.so.1") is None
    assert not container_has_driver(str(root))
    os.unlink(root / LIBDIR / "libcuda.so.1")
    os.symlink("libcuda.so.1", root / LIBDIR / "libcuda.so.1")  # a loop
    assert resolve_in_root(str(root), f"/{LIBDIR}/libcuda.so.1") is None


def test_links_never_lead_out_of_the_root_and_the_repair_writes_only_inside(tmp_path):
    root = tmp_path / "root"
    (root / LIBDIR).mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "libcuda.so.1").write_bytes(b"host")
    os.symlink(f"/../../{secret.name}/libcuda.so.1", root / LIBDIR / "libcuda.so.1")  # '..' stops at the root
    assert resolve_in_root(str(root), f"/{LIBDIR}/libcuda.so.1") is None
    os.symlink(str(secret), root / "usr" / "esc")  # a directory link is followed inside the root, not on the host
    assert resolve_in_root(str(root), "/usr/esc/libcuda.so.1") is None
    os.symlink("/etc/passwd", root / LIBDIR / "libfoo.so")  # not a driver library: never copied in
    os.symlink("/etc/passwd", root / LIBDIR / "libnvidia-x.so.1")  # a driver name, but the node's file is not one
    assert repair_driver_links(str(root)) == []
    assert not (root / LIBDIR / "passwd").exists()

    outside = tmp_path / "hostlib"  # an image whose library directory is a link out of the container
    outside.mkdir()
    (outside / "libcuda.so.580.1").write_bytes(b"cuda")
    os.symlink(str(outside / "libcuda.so.580.1"), outside / "libcuda.so.1")
    other = tmp_path / "other"
    (other / "usr" / "lib").mkdir(parents=True)
    os.symlink(str(outside), other / LIBDIR)
    assert repair_driver_links(str(other)) == [] and sorted(os.listdir(outside)) == ["libcuda.so.1", "libcuda.so.580.1"]


def test_the_node_has_the_driver_where_ld_library_path_says(tmp_path):
    (tmp_path / "libcuda.so.1").write_bytes(b"")
    assert not host_has_nvidia(globs=(), environ={"LD_LIBRARY_PATH": "/nowhere"})
    assert host_has_nvidia(globs=(), environ={"LD_LIBRARY_PATH": f"/nowhere:{tmp_path}"})
