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
