"""Training ranks in alice's container in each mode: on the fast path (user namespaces, the bed's default) and in
P1 (the site's fast_path turned off by configuration): two ranks in containers join one world, train, and report
their mode. (Kernels on the fast path: the hub and browser tests, which run in the bed's default mode.)"""
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.testbed

CODE = r'''
import json
out = {}
from jupyter_hpcdl.training import TrainingSession
from jupyter_hpcdl.training.examples import digits_loss, digits_model, digits_shard
with TrainingSession(ranks=2, where="local", containers=True, start_timeout=180) as s:
    out["ranks"] = sorted(w["container_mode"] for w in s.world)
    s.setup(digits_model, digits_shard, loss=digits_loss, lr=0.1)
    out["epochs"] = s.fit(epochs=1).epochs_done
print(json.dumps(out))
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fast_path, mode", [("auto", "userns"), ("off", "P1")])
def test_ranks_run_in_each_mode(bed, alice, fast_path, mode):
    site = json.loads(Path(bed["site_config"]).read_text())
    site.setdefault("ContainerSite", {})["fast_path"] = fast_path
    config = alice.write(Path(alice.home) / f"hpcdl-site-{fast_path}.json", json.dumps(site))
    try:
        r = alice.run(alice.bed["venv"] + "/bin/python", "-c", CODE, timeout=560, HPCDL_SITE_CONFIG=str(config))
    finally:
        os.unlink(config)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ranks"] == [mode, mode] and out["epochs"] == 1


def test_a_second_start_takes_the_front_door_and_a_changed_site_the_full_path_again(bed, alice):
    """``hpcdl-containers run``: the first start on a node resolves everything (the site's settings: traitlets);
    the next of the same shape starts from what it resolved, without those imports, with the same environment
    by name, working directory, exit code and stderr apart; a change of the site's file sends it the full way
    again (``python -X importtime`` shows what a start imported)."""
    site = json.loads(Path(bed["site_config"]).read_text())
    config = alice.write(Path(alice.home) / "hpcdl-site-front.json", json.dumps(site))
    code = ("import os, sys; print(os.environ['HPCDL_CONTAINER_MODE'], os.environ.get('HPCDL_PROBE'), os.getcwd()); "
            "print('to stderr', file=sys.stderr); sys.exit(int(os.environ['HPCDL_PROBE']))")

    def start(probe: str):
        return alice.run(bed["venv"] + "/bin/python", "-X", "importtime", "-m", "jupyter_hpcdl.containers", "run",
                         "-e", "HPCDL_PROBE", bed["image"], "--", "python3", "-c", code, timeout=120,
                         HPCDL_SITE_CONFIG=str(config), HPCDL_PROBE=probe)

    try:
        first, second = start("3"), start("4")
        config.write_text(json.dumps(site) + "\n")  # the same settings, a new stamp
        third = start("5")
    finally:
        os.unlink(config)
    for r, probe in ((first, "3"), (second, "4"), (third, "5")):
        assert r.returncode == int(probe), r.stderr[-2000:]
        assert r.stdout.split() == ["userns", probe, alice.home] and "to stderr" in r.stderr, r.stdout
    imported = [{line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
                for r in (first, second, third)]
    assert "traitlets" in imported[0] and "traitlets" in imported[2], "the full path resolves the site"
    assert "traitlets" not in imported[1] and "jupyter_hpcdl.containers.quickstart" in imported[1], \
        "the second start resolved everything again"
