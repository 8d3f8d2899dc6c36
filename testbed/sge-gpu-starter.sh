#!/bin/bash
# The test bed's Grid Engine starter_method: GPU binding, which Son of Grid Engine 8.1.9 lacks (RSMAP is Univa's).
# A job's GPUs on this host are its gpu request per slot x its slots here; free indices are taken with flock on
# lock files the bed made (held by the job's processes across exec, released when the last of them ends) and
# exported as CUDA_VISIBLE_DEVICES. A task of a running job (qrsh -inherit: QRSH_PORT is set) gets its job's.
# The bed installs it beside its lock directory (gpus/, with gpu0.lock ... gpuN-1.lock); sge_execd runs it with
# the job's command as its arguments.
set -u
dir=${0%/*}/gpus
gpus=$(ls "$dir" | grep -c '^gpu[0-9]*\.lock$')
if [[ -n ${QRSH_PORT:-} ]]; then
  [[ -r $dir/job-$JOB_ID.$HOSTNAME ]] && export CUDA_VISIBLE_DEVICES="$(<"$dir/job-$JOB_ID.$HOSTNAME")"
  exec /bin/sh -c "$*"  # as without a starter: a task's command line goes through the shell
fi
per_slot=$(timeout 30 qstat -j "$JOB_ID" 2>/dev/null | sed -n 's/^hard resource_list: *//p' | tr ',' '\n' | sed -n 's/^gpu=//p')
slots=1
if [[ -n ${PE_HOSTFILE:-} && -r ${PE_HOSTFILE:-} ]]; then
  slots=$(awk -v h="$HOSTNAME" '$1 == h { s += $2 } END { print s + 0 }' "$PE_HOSTFILE")
fi
want=$(( ${per_slot:-0} * slots ))
took=()
for (( i = 0; i < gpus && ${#took[@]} < want; i++ )); do
  exec {fd}<"$dir/gpu$i.lock"
  if flock -n "$fd"; then took+=("$i"); else exec {fd}<&-; fi
done
if (( want > 0 )); then
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${took[*]}")
  export CUDA_VISIBLE_DEVICES
  echo "$CUDA_VISIBLE_DEVICES" > "$dir/job-$JOB_ID.$HOSTNAME"
fi
exec "$@"
