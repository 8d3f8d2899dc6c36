"""The notebooks shipped with the package reach a user's home without a terminal, and a second copy keeps every
file the user changed (the panel's "Get the notebooks" and ``hpcdl-notebooks`` share this)."""
import json
import os

from jupyter_hpcdl.job.material import EXAMPLE_SCRIPTS, FIRST, copy_notebooks, main, shipped


def test_the_package_ships_the_notebooks_in_order_with_the_scripts_notebooks_5_and_7_run():
    files = shipped()
    notebooks = [n for n in files if n.endswith(".ipynb")]
    assert notebooks[0] == FIRST and len(notebooks) == 7 and notebooks == sorted(notebooks)
    assert set(EXAMPLE_SCRIPTS) <= set(files)
    for name in notebooks:  # each opens on the job's container kernel (a plain Python kernel elsewhere)
        assert json.loads(files[name].read_text())["metadata"]["kernelspec"]["name"] == "hpcdl", name


def test_a_copy_adds_what_is_missing_and_never_overwrites_what_the_user_has(tmp_path):
    dest = tmp_path / "hpcdl-notebooks"
    first = copy_notebooks(dest)
    assert sorted(first.copied) == sorted(shipped()) and first.kept == first.same == []
    assert (dest / FIRST).read_bytes() == shipped()[FIRST].read_bytes()
    assert oct((dest / FIRST).stat().st_mode & 0o777) == "0o644"

    (dest / FIRST).write_text("my own edits")
    (dest / EXAMPLE_SCRIPTS[0]).unlink()
    secret = tmp_path / "secret"
    secret.write_text("not for the notebooks")
    third = sorted(n for n in shipped() if n.endswith(".ipynb"))[2]
    (dest / third).unlink()
    (dest / third).symlink_to(secret)  # a link the user left: not followed, not replaced
    again = copy_notebooks(dest)
    assert again.copied == [EXAMPLE_SCRIPTS[0]] and sorted(again.kept) == sorted([FIRST, third])
    assert (dest / FIRST).read_text() == "my own edits" and secret.read_text() == "not for the notebooks"
    assert "kept as you left them" in " ".join(again.lines())
    assert not [p for p in os.listdir(dest) if p.startswith(".")], "no temporary file left behind"


def test_the_command_copies_into_the_directory_given_and_says_where_to_start(tmp_path, capsys):
    assert main([str(tmp_path / "nb")]) == 0
    out = capsys.readouterr().out
    assert f"start with {tmp_path / 'nb' / FIRST}" in out and "6 copied" not in out  # 6 notebooks + the script
    assert f"{len(shipped())} copied" in out
