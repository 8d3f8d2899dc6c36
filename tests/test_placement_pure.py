"""Placement helpers without a cluster: the engines start only once the controller's connection file is whole."""
import json
import threading
import time

import pytest

from jupyter_hpcdl.training.placement import wait_for_json_file


@pytest.mark.timing
def test_a_connection_file_is_read_only_once_it_is_whole(tmp_path):
    path = tmp_path / "ipcontroller-x-engine.json"
    path.write_text("")  # the controller has opened it, not written it yet

    def write_later():
        time.sleep(0.3)
        path.write_text('{"key": "abc", "interface": "tcp://127.0.0.1"')  # half of it
        time.sleep(0.3)
        path.write_text(json.dumps({"key": "abc", "interface": "tcp://127.0.0.1"}))

    writer = threading.Thread(target=write_later)
    writer.start()
    t0 = time.monotonic()
    assert wait_for_json_file(str(path), 10, "the file") == {"key": "abc", "interface": "tcp://127.0.0.1"}
    assert time.monotonic() - t0 >= 0.5, "it returned before the file was whole"
    writer.join()


@pytest.mark.timing
def test_a_connection_file_never_written_is_named_after_its_deadline(tmp_path):
    path = tmp_path / "missing-engine.json"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the controller's file \(.*missing-engine.json\) was not written in 1 s"):
        wait_for_json_file(str(path), 1, "the controller's file")
    assert time.monotonic() - t0 < 5
