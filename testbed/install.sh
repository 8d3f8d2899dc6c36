#!/usr/bin/env bash
# Install what the test bed needs, idempotently: Debian packages, one shared Python environment that the test users
# can execute (built from Debian's /usr/bin/python3, never from a home directory), Horovod built once from PyPI and
# kept as a wheel, jupyter-hpcdl built as a wheel the standard way (its build builds the JupyterLab extension) and
# installed from that wheel, configurable-http-proxy. A second run only checks.
#
#   HPCDL_PREFIX     the installation (default /opt/jupyter-hpcdl): the environment, node tools, udocker tools
#   HPCDL_CACHE      what is built from this repository (default /var/cache/jupyter-hpcdl): wheel, image layers
#   HPCDL_DOWNLOADS  downloads and pinned third-party builds that may outlive both (default
#                    /var/cache/jupyter-hpcdl-downloads): yarn's cache, the Horovod wheel per version and build flags
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${HPCDL_PREFIX:-/opt/jupyter-hpcdl}
cache=${HPCDL_CACHE:-/var/cache/jupyter-hpcdl}
downloads=${HPCDL_DOWNLOADS:-/var/cache/jupyter-hpcdl-downloads}
venv=$prefix/venv
log() { printf '[install] %s\n' "$*" >&2; }
t0=$SECONDS

apt_packages=(slurm-wlm munge sudo openmpi-bin libopenmpi-dev proot runc patchelf libfakechroot mmdebstrap
  umoci skopeo docker-registry python3-venv python3-dev build-essential ca-certificates nodejs chromium fonts-dejavu-core
  gridengine-master gridengine-exec gridengine-client gridengine-common)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm >/dev/null || missing+=(npm)  # Debian's nodejs comes without npm; other nodejs builds bring it
if ((${#missing[@]})); then
  log "apt: ${missing[*]}"
  apt-get update -q >/dev/null
  # Grid Engine's daemons and clients must resolve this host's name (a bare container may not).
  getent hosts "$(hostname)" >/dev/null || echo "127.0.0.1 $(hostname)" >>/etc/hosts
  # Grid Engine's packages set up their cell at install time, from debconf: this host is the master.
  for p in common master client exec; do
    printf 'gridengine-%s shared/gridengineconfig boolean true\ngridengine-%s shared/gridenginecell string default\ngridengine-%s shared/gridenginemaster string %s\n' \
      "$p" "$p" "$p" "$(hostname)"
  done | debconf-set-selections
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

mkdir -p "$prefix" "$cache" "$downloads/yarn"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
[[ -x $venv/bin/python ]] || { log "python environment at $venv"; /usr/bin/python3 -m venv "$venv"; }

# 1. What Horovod is built against, then Horovod itself: a pinned third-party build, kept per version, flags, TF, Python.
stack_stamp=$(cat "$repo/testbed/constraints.txt" "$repo/testbed/install.sh" | sha256sum | cut -c1-16)
if [[ $(cat "$venv/.hpcdl-stack" 2>/dev/null) != "$stack_stamp" ]]; then
  log "TensorFlow into $venv"
  "${pip[@]}" install -c "$repo/testbed/constraints.txt" pip setuptools wheel tensorflow-cpu
  echo "$stack_stamp" >"$venv/.hpcdl-stack"
fi
hvd_flags="HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1"
hvd_version=$(sed -n 's/^horovod==//p' "$repo/testbed/constraints.txt")
tf_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')
py_version=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
hvd_dir=$downloads/horovod/$(echo "$hvd_version $hvd_flags tf$tf_version py$py_version" | sha256sum | cut -c1-16)
if ! ls "$hvd_dir"/horovod-"$hvd_version"-*.whl >/dev/null 2>&1; then
  log "building horovod $hvd_version against TensorFlow $tf_version (once; about 5 minutes)"
  mkdir -p "$hvd_dir.partial"
  env $hvd_flags MAKEFLAGS=-j2 "${pip[@]}" wheel --no-build-isolation --no-deps -w "$hvd_dir.partial" "horovod==$hvd_version"
  rm -rf "$hvd_dir" && mv "$hvd_dir.partial" "$hvd_dir"
fi

# 2. jupyter-hpcdl as a wheel, built the standard way (isolated; hatch-jupyter-builder builds the extension with
#    jlpm), rebuilt when its sources change.
src_stamp=$(cd "$repo" && find pyproject.toml README.md jupyter-config jupyter_hpcdl spawner labextension notebooks examples \
    \( -name node_modules -o -name lib -o -name .yarn -o -name __pycache__ -o -path jupyter_hpcdl/labextension \) -prune \
    -o -type f ! -name '*.tsbuildinfo' -print | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
wheel=$(ls "$cache"/dist/jupyter_hpcdl-*.whl 2>/dev/null | head -n1 || true)
if [[ -z $wheel || $(cat "$cache/dist/.hpcdl-src" 2>/dev/null) != "$src_stamp" ]]; then
  log "building the jupyter-hpcdl wheel (with its JupyterLab extension)"
  rm -rf "$cache/dist" "$cache/dist.partial"
  YARN_CACHE_FOLDER=$downloads/yarn YARN_ENABLE_IMMUTABLE_INSTALLS=true \
    "${pip[@]}" wheel --no-deps -w "$cache/dist.partial" "$repo"
  mv "$cache/dist.partial" "$cache/dist"
  echo "$src_stamp" >"$cache/dist/.hpcdl-src"
  wheel=$(ls "$cache"/dist/jupyter_hpcdl-*.whl)
fi

# 3. The environment: the wheel with its extras (dependencies resolved once per stack), or the wheel alone.
requires=$("$venv/bin/python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
print("\n".join(line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist")))' "$wheel")
deps_stamp=$(echo "$stack_stamp $hvd_dir $requires" | sha256sum | cut -c1-16)
installed=$(cat "$venv/.hpcdl-wheel" 2>/dev/null || true)
if [[ $(cat "$venv/.hpcdl-deps" 2>/dev/null) != "$deps_stamp" ]]; then
  log "jupyter-hpcdl and its dependencies into $venv"
  "${pip[@]}" install -c "$repo/testbed/constraints.txt" --find-links "$hvd_dir" --force-reinstall --no-deps "$wheel"
  "${pip[@]}" install -c "$repo/testbed/constraints.txt" --find-links "$hvd_dir" "$wheel[tensorflow-cpu,torch,rank,mpi,hub,lab,test]"
  echo "$deps_stamp" >"$venv/.hpcdl-deps"
  echo "$src_stamp" >"$venv/.hpcdl-wheel"
elif [[ $installed != "$src_stamp" ]]; then
  log "jupyter-hpcdl into $venv"
  "${pip[@]}" install --no-deps --force-reinstall "$wheel"
  echo "$src_stamp" >"$venv/.hpcdl-wheel"
fi

if [[ ! -x $prefix/node/bin/configurable-http-proxy ]]; then
  log "configurable-http-proxy"
  npm install -g -q --prefix "$prefix/node" configurable-http-proxy@5 >/dev/null 2>&1
fi
chmod -R a+rX "$prefix"
log "ready: $venv ($((SECONDS - t0)) s)"
