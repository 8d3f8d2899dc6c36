"""``%%ranks``: run a notebook cell on every rank of the latest started session and show each rank's output
(runs in the kernel; IPython's own magic machinery).

    %%ranks
    import horovod.tensorflow as hvd
    print(hvd.rank(), hvd.size())

``%%ranks --quiet`` shows only errors; ``%%ranks`` then names any rank whose code raised."""
from __future__ import annotations

import weakref

_SESSION: weakref.ref | None = None


def register_cell_magic(session) -> bool:
    """Make ``%%ranks`` run cells on ``session``'s ranks; False outside IPython."""
    global _SESSION
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    _SESSION = weakref.ref(session)
    shell.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
    return True


def format_outputs(outputs: dict[int, dict]) -> str:
    """Each rank's output under its own heading (pure)."""
    parts = []
    for rank, out in sorted(outputs.items()):
        body = "".join(f"{out[k]}" for k in ("stdout", "stderr") if out.get(k))
        if out.get("result") is not None:
            body += f"Out: {out['result']}\n"
        parts.append(f"[rank {rank}]\n{body}" if body else f"[rank {rank}] (no output)\n")
    return "".join(parts)


def ranks_magic(line: str, cell: str) -> None:
    session = _SESSION() if _SESSION is not None else None
    if session is None or not session.world:
        raise RuntimeError("%%ranks needs a started TrainingSession: session.start() first")
    outputs = session.run_cell(cell)
    if line.strip() != "--quiet":
        print(format_outputs(outputs), end="")
