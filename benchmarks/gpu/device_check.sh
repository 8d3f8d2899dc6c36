#!/usr/bin/env bash
# The GPU checks of containers on a lent GPU machine that has no bed (run as root from the checkout, with the bundle
# of benchmarks/gpu/bundle.sh in .devgpu): tests/test_gpu_containers.py in both modes, then the GPU benchmark.
# Its findings go to $OUT (where the machine's tool collects them), else /tmp/hpcdl-gpu-check. The machine needs
# python3 with pip, pytest, pytest-timeout and psutil (the bundle carries udocker and traitlets only). Sourced with
# HPCDL_GPU_SETUP_ONLY=1 it only prepares this shell's environment for a command of one's own.
sourced=0 && (return 0 2>/dev/null) && sourced=1
[[ $sourced == 1 ]] || set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=${HPCDL_GPU_BUNDLE_DIR:-$repo/.devgpu}
out=${OUT:-/tmp/hpcdl-gpu-check}
rounds=${1:-5}
mkdir -p "$out"
work=/tmp/hpcdl-gpu && rm -rf "$work" && mkdir -p "$work/site" "$work/probe"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$bundle"/wheels/*.whl || { echo "the bundle's wheels did not install" >&2; return 2 2>/dev/null || exit 2; }
export PYTHONPATH=$work/site:$repo
python3 -m jupyter_hpcdl.containers.tools install "$bundle/tools.tar.gz" "$work/tools" || { return 2 2>/dev/null || exit 2; }
# Debian's proot needs libtalloc, which this machine may not have
if ldd "$work/tools/bin/"proot-*.real | grep -q 'libtalloc.* not found'; then
  cp "$bundle/lib/libtalloc.so.2" /usr/lib/x86_64-linux-gnu/ && ldconfig
fi
# the driver's libraries where neither the loader's cache nor LD_LIBRARY_PATH has them (as a site's `module load`)
if ! grep -q 'libcuda\.so\.1' < <(ldconfig -p) && [ -d /usr/local/nvidia/lib64 ]; then
  export LD_LIBRARY_PATH=/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
cp "$bundle/gpu_probe" "$work/probe/" && chmod 755 "$work/probe/gpu_probe"
export HPCDL_GPU_UDOCKER=$work/site/bin/udocker HPCDL_GPU_TOOLS=$work/tools HPCDL_GPU_ROOTFS=$bundle/rootfs.tar \
  HPCDL_GPU_PROBE=$work/probe/gpu_probe HPCDL_REQUIRE_GPU=1
if [[ $sourced == 1 && ${HPCDL_GPU_SETUP_ONLY:-0} == 1 ]]; then return 0; fi
{
  echo "== the machine"; uname -r; grep PRETTY /etc/os-release; python3 --version
  nvidia-smi -L; command -v nvidia-smi; ls /dev/nvidia*; ldconfig -p | grep -E 'libcuda|libnvidia-ml'
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  echo "user namespaces: $(cat /proc/sys/user/max_user_namespaces 2>&1)"; unshare -Ur id 2>&1
  echo "== native probe"; "$HPCDL_GPU_PROBE" info
} 2>&1 | tee "$out/machine.txt"
echo "== tests/test_gpu_containers.py"
timeout 300 python3 -m pytest -p no:cacheprovider -v -rA --timeout=300 --rootdir="$repo" \
  "$repo/tests/test_gpu_containers.py" 2>&1 | tee "$out/tests.txt"
tests=${PIPESTATUS[0]}
echo "== benchmarks/gpu/container_overhead.py --rounds $rounds"
timeout 200 python3 "$repo/benchmarks/gpu/container_overhead.py" --rounds "$rounds" --out "$out/bench.json" 2>&1 \
  | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}
echo "tests exit: $tests, benchmark exit: $bench"
(( tests == 0 && bench == 0 ))
