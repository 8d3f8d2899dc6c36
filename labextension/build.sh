#!/usr/bin/env bash
# Build the JupyterLab extension into ../jupyter_hpcdl/labextension (which the Python package ships as
# share/jupyter/labextensions/@jupyter-hpcdl/labextension). Idempotent: skips everything when the sources
# hash to the stamp that the last successful build left in the output folder.
# Needs node and jlpm / jupyter-builder (from the venv with jupyterlab; HPCDL_VENV, default /opt/jupyter-hpcdl/venv).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(cd "$here/.." && pwd)/jupyter_hpcdl/labextension
venv=${HPCDL_VENV:-${HPCDL_PREFIX:-/opt/jupyter-hpcdl}/venv}
export PATH="$venv/bin:$PATH"
export YARN_CACHE_FOLDER=${YARN_CACHE_FOLDER:-${HPCDL_CACHE:-/var/cache/jupyter-hpcdl}/yarn}
log() { printf '[labextension] %s\n' "$*" >&2; }

cd "$here"
hash=$( { for f in package.json yarn.lock tsconfig.json .yarnrc.yml; do [[ -f $f ]] && { echo "== $f"; cat "$f"; }; done
          find src style -type f | LC_ALL=C sort | while read -r f; do echo "== $f"; cat "$f"; done; } |
        sha256sum | cut -c1-16)
if [[ -f $out/package.json && $(cat "$out/.hpcdl-build-stamp" 2>/dev/null) == "$hash" ]]; then
  log "up to date ($hash)"
  exit 0
fi
command -v jlpm >/dev/null || { log "jlpm not found (is jupyterlab installed in $venv?)"; exit 1; }
mkdir -p "$YARN_CACHE_FOLDER"
log "jlpm install"
# --immutable when the lock file is committed: a build never rewrites it silently
if [[ -f yarn.lock ]]; then jlpm install --immutable; else jlpm install; fi
rm -rf "$out"
log "jlpm build:prod"
jlpm build:prod
[[ -f $out/package.json ]] || { log "no $out/package.json after the build"; exit 1; }
echo "$hash" >"$out/.hpcdl-build-stamp"
log "built $out ($hash)"
