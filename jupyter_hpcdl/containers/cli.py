"""``hpcdl-containers``: the user's image catalogue and containers from a shell or a batch job."""
from __future__ import annotations

import argparse
import os
import sys

from . import quickstart
from .errors import ContainerError
from .quickstart import cwd_in_home
from .runner import run_foreground
from .site import load_site
from .spec import FAST_MODE, Mount, RunSpec, names_with_prefixes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcdl-containers", description=__doc__)
    p.add_argument("--site", help="site configuration file (default: $HPCDL_SITE_CONFIG or /etc/jupyter-hpcdl/site.json)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("images", help="list your images")
    sub.add_parser("ps", help="list your containers")
    s = sub.add_parser("pull", help="pull an image from the site's registry")
    s.add_argument("image")
    s.add_argument("--registry", help="registry URL (default: the site's)")
    s = sub.add_parser("load", help="add an OCI or Docker archive to your images (tags from the archive)")
    s.add_argument("tarball")
    s.add_argument("repository")
    s = sub.add_parser("import", help="add a root file system tarball to your images")
    s.add_argument("tarball")
    s.add_argument("image")
    for name, what in (("verify", "check an image's layers"), ("rmi", "remove an image"),
                       ("ensure", "create your container for an image once; print its name")):
        sub.add_parser(name, help=what).add_argument("image")
    sub.add_parser("rm", help="remove a container").add_argument("container")
    r = sub.add_parser("run", help="run a command in your container for an image (created on first use)")
    r.add_argument("image")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    r.add_argument("-e", "--env", action="append", default=[], metavar="NAME", help="pass this variable by name")
    r.add_argument("--env-file", action="append", default=[], help="pass the variables in this file")
    r.add_argument("--env-prefix", action="append", default=[], metavar="PREFIX",
                   help="pass every variable whose name starts with PREFIX, by name")
    r.add_argument("-v", "--volume", action="append", default=[], metavar="HOST[:CONTAINER]", help="bind mount")
    r.add_argument("-w", "--workdir")
    return p


def main(argv: list[str] | None = None) -> int:
    """The full path (the front door, :mod:`.quickstart`, hands over every call it cannot start itself)."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        site = load_site(args.site)
        ud = site.client()
        if args.cmd == "images":
            print("\n".join(ud.images()))
        elif args.cmd == "ps":
            print("\n".join(ud.containers()))
        elif args.cmd == "pull":
            ud.pull(args.image, args.registry or site.registry)
        elif args.cmd == "load":
            print("\n".join(ud.load(args.tarball, args.repository)))
        elif args.cmd == "import":
            ud.import_tarball(args.tarball, args.image)
        elif args.cmd == "verify":
            ud.verify(args.image)
        elif args.cmd == "rmi":
            ud.remove_image(args.image)
        elif args.cmd == "ensure":
            print(ud.ensure_container(args.image))
        elif args.cmd == "rm":
            ud.remove_container(args.container)
        elif args.cmd == "run":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise ContainerError("run needs a command: hpcdl-containers run IMAGE -- CMD [ARGS...]")
            mounts = [Mount(*v.split(":", 1)) if ":" in v else Mount(v) for v in args.volume]
            spec = RunSpec(container=ud.ensure_container(args.image), command=command, mounts=mounts,
                           env_names=[*args.env, *names_with_prefixes(os.environ, args.env_prefix)],
                           env_files=args.env_file, workdir=args.workdir or cwd_in_home())
            call = quickstart.parse(argv)
            if call is not None and ud.mode_for(spec.container).mode == FAST_MODE:
                try:  # the next such start: at once (before this one starts: nothing then runs unwatched)
                    ud.remember_start(call.site, args.image, spec.container)
                except (OSError, ValueError):  # a read-only or full home: every start takes the full path
                    pass
            return run_foreground(ud.start(spec))
    except (ContainerError, FileNotFoundError, ValueError) as e:
        print(f"hpcdl-containers: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
