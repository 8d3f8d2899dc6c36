"""The end of a job's log as the hub shows it: read as the user, a regular file only, bounded, any encoding, with
control characters escaped; whatever the user put at the log's path (a link to a secret, a FIFO, a device, a huge or
binary file) yields a short answer, never the hub's rights, a hang or a flood."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest

from jupyter_hpcdl.controls import escape_controls
from jupyter_hpcdl.spawner.usertail import NotShown, tail

SECRET = "hub-api-token-0123456789"


def test_the_last_lines_of_a_regular_file(tmp_path):
    log = tmp_path / "7.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail(str(log), lines=3) == "line 97\nline 98\nline 99\n"
    assert tail(str(log), lines=0) == ""


def test_only_the_last_bytes_are_read_and_a_cut_line_is_dropped(tmp_path):
    log = tmp_path / "7.log"
    log.write_text("x" * 50 + "\nend one\nend two\n")
    assert tail(str(log), lines=20, max_bytes=14) == "end two\n"  # "d one" is what is left of a cut line
    huge = tmp_path / "huge.log"
    with open(huge, "wb") as f:  # 64 GiB, sparse: reading it whole would never end
        f.truncate(64 << 30)
        f.seek(-12, os.SEEK_END)
        f.write(b"\nlast words\n")
    assert tail(str(huge), lines=1, max_bytes=4096) == "last words\n"


def test_a_link_a_fifo_and_a_device_are_refused_without_being_opened_for_reading(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    (tmp_path / "link.log").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo.log")
    for path, why in ((tmp_path / "link.log", "a symbolic link"), (tmp_path / "fifo.log", "not a regular file"),
                      ("/dev/zero", "not a regular file")):
        with pytest.raises(NotShown, match=why):
            tail(str(path))
    with pytest.raises(FileNotFoundError):
        tail(str(tmp_path / "missing.log"))


def test_invalid_utf8_and_control_sequences_come_out_harmless(tmp_path):
    log = tmp_path / "7.log"
    log.write_bytes(b"bad \xff\xfe bytes\n\x1b[2J\x1b]0;owned\x07 title\ttab\n")
    out = tail(str(log))
    assert out == "bad \ufffd\ufffd bytes\n\\x1b[2J\\x1b]0;owned\\x07 title\ttab\n"
    assert escape_controls("\x9b31m") == "\\x9b31m"  # a C1 control sequence introducer too
    assert escape_controls("ok\u202egnp.exe\u2028") == "ok\\u202egnp.exe\\u2028"  # reordering, hidden line breaks
    log.write_bytes(b"one\x0bstill one\x85\n" + b"x" * 9 + b"\nwhole\n")
    assert tail(str(log), lines=2) == "x" * 9 + "\nwhole\n"  # only newlines end lines
    assert tail(str(log), max_bytes=16) == "x" * 9 + "\nwhole\n"  # the line read whole is kept whole


def test_the_command_line_says_why_a_file_is_not_shown(tmp_path):
    (tmp_path / "link.log").symlink_to("/etc/shadow")
    r = subprocess.run([sys.executable, "-m", "jupyter_hpcdl.spawner.usertail", "--lines", "5", str(tmp_path / "link.log")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "a symbolic link" in r.stderr and r.stdout == "", r


def _spawner(**traits):
    from jupyter_hpcdl.spawner.spawner import HpcdlSpawner

    return HpcdlSpawner(user=SimpleNamespace(name="nobody", url="/user/nobody/"), orm_spawner=None, **traits)


def test_the_spawner_shows_the_tail_or_why_not_and_never_the_target_of_a_link(tmp_path):
    spawner = _spawner(exec_prefix=[], log_tail_lines=2, scheduler_timeout=20)
    (tmp_path / "7.log").write_text("preparing\nimage not found\nexit 2\n")
    (tmp_path / "secret").write_text(SECRET)
    (tmp_path / "8.log").symlink_to(tmp_path / "secret")
    os.mkfifo(tmp_path / "9.log")

    async def tails():
        return [await spawner.log_tail(str(tmp_path / f"{n}.log")) for n in (7, 8, 9, 10)]

    shown, link, fifo, missing = asyncio.run(asyncio.wait_for(tails(), 60))
    assert missing == ""  # a job that ended before writing its log: nothing to show
    assert shown == "image not found\nexit 2\n"
    assert SECRET not in link and "not shown" in link and "a symbolic link" in link
    assert "not shown" in fifo and "not a regular file" in fifo


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_the_spawner_reads_as_the_user_not_with_its_own_rights():
    spawner = _spawner(exec_prefix=["runuser", "-u", "{username}", "--"], scheduler_timeout=20)
    home = tempfile.mkdtemp(prefix="hpcdl-usertail-")  # where nobody may look (pytest's tmp_path is root's only)
    try:
        os.chmod(home, 0o755)
        readable, root_only = os.path.join(home, "7.log"), os.path.join(home, "8.log")
        for path, mode in ((readable, 0o644), (root_only, 0o600)):
            with open(path, "w") as f:
                f.write(f"{SECRET} in {os.path.basename(path)}\n")
            os.chmod(path, mode)

        async def both():
            return await asyncio.gather(spawner.log_tail(readable), spawner.log_tail(root_only))

        shown, refused = asyncio.run(asyncio.wait_for(both(), 60))
    finally:
        shutil.rmtree(home)
    assert shown == f"{SECRET} in 7.log\n", shown  # the tool runs as nobody and reads what nobody may read
    assert SECRET not in refused and "not shown" in refused and "Permission denied" in refused, refused
