"""The notebooks that come with the package, and a copy of them into the user's home that keeps what the user
changed (runs in the user's own server: the panel's **Get the notebooks**; or ``hpcdl-notebooks`` in a terminal).

A file already there is never overwritten, whatever it holds: the copy adds what is missing and says what it kept.
Each file appears whole or not at all (written beside, then linked into place)."""
from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

#: Where the notebooks go, under the user's home (the server's root directory).
NOTEBOOKS_DIR = "hpcdl-notebooks"
FIRST = "01-first-training.ipynb"
#: The scripts notebooks 5 and 7 run (a Horovod one, a torchrun one), shipped beside the notebooks.
EXAMPLE_SCRIPTS = ("horovod_keras_digits.py", "torchrun_digits.py")


@dataclass
class CopyResult:
    """What a copy did: the directory, the files it wrote, those it left as they were (changed by the user, or
    another file of that name) and those already the same."""

    directory: str
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    same: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"directory": self.directory, "first": os.path.join(self.directory, FIRST), "copied": self.copied,
                "kept": self.kept, "same": self.same}

    def lines(self) -> list[str]:
        out = [f"notebooks in {self.directory}: {len(self.copied)} copied, {len(self.same)} already there"]
        if self.kept:
            out.append(f"kept as you left them (not overwritten): {', '.join(self.kept)}; to get a file as shipped, "
                       "rename yours and copy again")
        return out


def shipped() -> dict[str, Path]:
    """The shipped files by name: the installed package's ``notebooks/`` (with the example scripts beside them), or
    a source checkout's ``notebooks/`` and ``examples/``."""
    package = Path(__file__).resolve().parent.parent
    for notebooks, scripts in ((package / "notebooks", package / "notebooks"),
                               (package.parent / "notebooks", package.parent / "examples")):
        if (notebooks / FIRST).is_file():
            files = {p.name: p for p in sorted(notebooks.glob("*.ipynb"))}
            files.update({name: scripts / name for name in EXAMPLE_SCRIPTS if (scripts / name).is_file()})
            return files
    raise FileNotFoundError(f"this installation of jupyter-hpcdl has no notebooks (looked in {package}/notebooks); "
                            "reinstall it from its wheel")


def copy_notebooks(directory: str | os.PathLike) -> CopyResult:
    """Copy the shipped files into ``directory`` (made if missing), never replacing a file that is there."""
    dest = Path(directory)
    dest.mkdir(mode=0o755, parents=True, exist_ok=True)
    result = CopyResult(str(dest))
    for name, source in shipped().items():
        data, target = source.read_bytes(), dest / name
        if os.path.lexists(target):
            same = target.is_file() and not target.is_symlink() and target.read_bytes() == data
            (result.same if same else result.kept).append(name)
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=dest)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.link(tmp, target)  # fails, and replaces nothing, if the name appeared meanwhile
            result.copied.append(name)
        except FileExistsError:
            result.kept.append(name)
        finally:
            os.unlink(tmp)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hpcdl-notebooks", description="Copy jupyter-hpcdl's notebooks into a "
                                "directory of yours, keeping every file already there.")
    p.add_argument("directory", nargs="?", default=os.path.join("~", NOTEBOOKS_DIR),
                   help=f"where to (default: ~/{NOTEBOOKS_DIR})")
    args = p.parse_args(argv)
    try:
        result = copy_notebooks(os.path.expanduser(args.directory))
    except OSError as e:
        p.exit(1, f"hpcdl-notebooks: {e}\n")
    print("\n".join(result.lines()))
    print(f"start with {os.path.join(result.directory, FIRST)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
