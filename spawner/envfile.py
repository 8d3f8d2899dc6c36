"""The job's secrets in a file only its user can read, for batch systems that show a job's environment to every
user (Grid Engine's ``qstat -j``): the hub writes it as the user (values on stdin, never on a command line), and the
job's side reads it once and removes it."""
from __future__ import annotations

import json
import os
import sys

from functools import partial

from jupyter_hpcdl.atomic import atomic_write, write_json


def env_file_path(home: str, server_name: str = "") -> str:
    return os.path.join(home, ".jupyter-hpcdl", "jobs", f"env-{server_name or 'default'}.json")


#: With JupyterHub's ``internal_ssl``: the variable naming the file that holds the server's key, certificate and CA
#: bundle (PEM texts by the name of the variable that names each file), written by the hub like the env file.
TLS_BUNDLE_ENV = "HPCDL_TLS_BUNDLE"
#: JupyterHub's variable for each file → (its key in ``Spawner.cert_paths``, the file's name in :func:`tls_dir`).
TLS_FILES = {"JUPYTERHUB_SSL_KEYFILE": ("keyfile", "server.key"), "JUPYTERHUB_SSL_CERTFILE": ("certfile", "server.crt"),
             "JUPYTERHUB_SSL_CLIENT_CA": ("cafile", "ca.crt")}


def tls_bundle_path(home: str, server_name: str = "") -> str:
    return os.path.join(home, ".jupyter-hpcdl", "jobs", f"tls-{server_name or 'default'}.json")


def tls_dir(home: str, server_name: str = "") -> str:
    """Where the job puts the server's key and certificates (a directory of mode 0700, files of mode 0600)."""
    return os.path.join(home, ".jupyter-hpcdl", "tls", server_name or "default")


def load(path: str) -> dict[str, str]:
    """The variables in ``path``, which is then removed (one job, one reading)."""
    with open(path) as f:
        values = json.load(f)
    os.unlink(path)
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise ValueError(f"{path}: not an object of strings")
    return values


def unpack_tls(bundle: str) -> list[str]:
    """The job's side of ``internal_ssl``: write each PEM text of the hub's ``bundle`` (read once, then removed) to
    the path that its JupyterHub variable names, in a directory of mode 0700, as a file of mode 0600 (whole or not
    at all); return the paths written."""
    texts = load(bundle)
    unknown = sorted(set(texts) - set(TLS_FILES))
    missing = sorted(var for var in texts if not os.environ.get(var))
    if unknown or missing:
        raise ValueError(f"{bundle}: " + (f"unexpected entries {unknown}" if unknown else
                                          f"the hub did not say where {', '.join(missing)} go"))
    written = []
    old = os.umask(0o077)
    try:
        for var, text in texts.items():
            path = os.environ[var]
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            os.chmod(os.path.dirname(path), 0o700)
            atomic_write(path, partial(_write_text, text=text))
            written.append(path)
    finally:
        os.umask(old)
    return written


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    """``python -m jupyter_hpcdl.spawner.envfile PATH`` (as the user): the JSON object on stdin, written 0600."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m jupyter_hpcdl.spawner.envfile PATH  (a JSON object of strings on stdin)", file=sys.stderr)
        return 2
    old = os.umask(0o077)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args[0])), mode=0o700, exist_ok=True)
        write_json(args[0], json.load(sys.stdin))  # mkstemp's file is 0600; the rename keeps it
    finally:
        os.umask(old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
