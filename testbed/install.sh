#!/usr/bin/env bash
# Install what the test bed needs, idempotently: Debian packages, one shared Python environment that the
# test users can execute (built from Debian's /usr/bin/python3, never from a home directory), Horovod built
# once from PyPI and cached as a wheel, configurable-http-proxy. A second run only checks.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${HPCDL_PREFIX:-/opt/jupyter-hpcdl}
cache=${HPCDL_CACHE:-/var/cache/jupyter-hpcdl}
venv=$prefix/venv
log() { printf '[install] %s\n' "$*" >&2; }

apt_packages=(slurm-wlm munge sudo openmpi-bin libopenmpi-dev proot runc patchelf libfakechroot mmdebstrap
  umoci skopeo docker-registry python3-venv python3-dev build-essential ca-certificates nodejs chromium fonts-dejavu-core)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm >/dev/null || missing+=(npm)  # Debian's nodejs comes without npm; other nodejs builds bring it
if ((${#missing[@]})); then
  log "apt: ${missing[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$prefix" "$cache/wheels"
# The environment is rebuilt only when what it is made of changes.
stamp=$(cat "$repo/testbed/constraints.txt" "$repo/testbed/install.sh" "$repo/pyproject.toml" | sha256sum | cut -c1-16)
if [[ ! -x $venv/bin/python || $(cat "$venv/.hpcdl-stamp" 2>/dev/null) != "$stamp" ]]; then
  log "python environment at $venv"
  [[ -x $venv/bin/python ]] || /usr/bin/python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install -c "$repo/testbed/constraints.txt" pip setuptools wheel tensorflow-cpu
  if ! ls "$cache"/wheels/horovod-0.28.1-*.whl >/dev/null 2>&1; then
    log "building horovod 0.28.1 (once; about 5 minutes)"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITH_MPI=1 MAKEFLAGS=-j2 "${pip[@]}" wheel --no-build-isolation --no-deps -w "$cache/wheels" horovod==0.28.1
  fi
  "${pip[@]}" install --no-build-isolation -c "$repo/testbed/constraints.txt" --find-links "$cache/wheels" \
    "$repo[tensorflow-cpu,rank,hub,lab,test]"
  echo "$stamp" >"$venv/.hpcdl-stamp"
fi
# The project itself, always (it is small): not editable, so users and containers never read the checkout.
bash "$repo/labextension/build.sh"
"$venv/bin/python" -m pip --disable-pip-version-check -q install --no-build-isolation --no-deps --force-reinstall "$repo"

if [[ ! -x $prefix/node/bin/configurable-http-proxy ]]; then
  log "configurable-http-proxy"
  npm install -g -q --prefix "$prefix/node" configurable-http-proxy@5 >/dev/null 2>&1
fi
chmod -R a+rX "$prefix"
log "ready: $venv"
