"""``hpcdl-containers`` (and ``python -m jupyter_hpcdl.containers``): the front door first (:mod:`.quickstart`,
standard library only), the full command line (:mod:`.cli`, imported only then) for every call it cannot take."""
from __future__ import annotations

import sys

from . import quickstart


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = quickstart.run(argv)
    if code is not None:
        return code
    from .cli import main as full  # the site's settings, the image catalogue: about 0.1 s of imports

    return full(argv)
