#!/usr/bin/env bash
# Build, on the bed's machine (Debian 12, after testbed/install.sh), what a lent GPU machine without the bed needs to
# run the GPU checks of containers (benchmarks/gpu/device_check.sh): udocker's and traitlets' wheels, the udocker
# tools built from Debian's packages (and proot's libtalloc), the CUDA probe, and a small image: busybox and the C
# library, into which `udocker setup --nvidia` copies the GPU node's driver. About 8 MB; nothing is downloaded
# there. Needs nvcc (CUDA's compiler) and the bed's installation. Usage: bash benchmarks/gpu/bundle.sh [DIR]
# (default: .devgpu in the checkout; add it to .git/info/exclude before carrying it to a lent machine)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/.devgpu}
py=${HPCDL_PREFIX:-/opt/jupyter-hpcdl}/venv/bin/python
if [[ -e $out && ! -e $out/.hpcdl-gpu-bundle ]] && [[ -n $(ls -A "$out" 2>/dev/null) ]]; then
  echo "bundle.sh: $out exists and is not a bundle; give an empty or new directory" >&2
  exit 2
fi
rm -rf "$out" && mkdir -p "$out/wheels" "$out/lib" && touch "$out/.hpcdl-gpu-bundle"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT

# wheels of the versions the bed runs (both are pure Python)
for name in udocker traitlets; do
  version=$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" "$name==$version"
done
"$py" -m jupyter_hpcdl.containers.tools build "$out/tools.tar.gz" >/dev/null
cp -L /lib/x86_64-linux-gnu/libtalloc.so.2 "$out/lib/"
(cd "$repo/testbed" && "$py" -c "import sys, gpukit; gpukit.build_probe(sys.argv[1])" "$out")

# the image: busybox (static) as the shell and its tools, and the C and C++ libraries the probe and the driver need
(cd "$tmp" && apt-get download -q busybox-static 2>&1 | { grep -v "^W: Download is performed unsandboxed" || true; } >&2; dpkg -x busybox-static_*.deb pkg)
root=$tmp/root
mkdir -p "$root"/{bin,usr/bin,usr/lib/x86_64-linux-gnu,lib64,etc,tmp,dev,proc,sys,root,home}
ln -s usr/lib "$root/lib"
cp "$tmp/pkg/bin/busybox" "$root/bin/busybox"
for tool in sh cat echo id ls env sleep test true false; do ln -s busybox "$root/bin/$tool"; done
for lib in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libgcc_s.so.1 libstdc++.so.6; do
  cp -L "/lib/x86_64-linux-gnu/$lib" "$root/usr/lib/x86_64-linux-gnu/"
done
cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
chmod 1777 "$root/tmp"
tar -C "$root" -cf "$out/rootfs.tar" .
du -sh "$out"
