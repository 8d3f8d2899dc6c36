#!/bin/bash
# The test bed's Grid Engine starter_method: GPU binding, which Son of Grid Engine 8.1.9 lacks (RSMAP is Univa's).
# A job's GPUs on a host are its gpu request per slot x its slots on that host; free indices are taken with flock on
# that host's lock files (held by the job's processes across exec, released when the last of them ends) and
# exported as CUDA_VISIBLE_DEVICES, and recorded for the job's later tasks there.
# - The job's script, on its first host, takes them there.
# - A task of the job (qrsh -inherit: QRSH_PORT is set) gets what the job holds on its host; the first task on
#   another host takes them there (under a lock, so tasks starting together agree), counting its slots there in the
#   copy of $PE_HOSTFILE the script's start left (a task has no $PE_HOSTFILE). Those GPUs are held while that first
#   task runs: enough for the bed, whose jobs start one supervised task per rank and end them together.
# The bed installs it beside its lock directories (gpus/HOST/, with gpu0.lock ... gpuN-1.lock); sge_execd runs it
# with the job's command as its arguments.
set -u
dir=${0%/*}/gpus/$HOSTNAME
record=$dir/job-$JOB_ID
pe_hosts=${0%/*}/gpus/job-$JOB_ID.hosts

take() {
  local gpus per_slot slots want i fd took=()
  gpus=$(ls "$dir" | grep -c '^gpu[0-9]*\.lock$')
  per_slot=$(timeout 30 qstat -j "$JOB_ID" 2>/dev/null | sed -n 's/^hard resource_list: *//p' | tr ',' '\n' | sed -n 's/^gpu=//p')
  slots=1
  if [[ -r $pe_hosts ]]; then
    slots=$(awk -v h="$HOSTNAME" '$1 == h { s += $2 } END { print s + 0 }' "$pe_hosts")
  fi
  want=$(( ${per_slot:-0} * slots ))
  for (( i = 0; i < gpus && ${#took[@]} < want; i++ )); do
    exec {fd}<"$dir/gpu$i.lock"
    if flock -n "$fd"; then took+=("$i"); else exec {fd}<&-; fi
  done
  if (( want > 0 )); then
    (IFS=,; echo "${took[*]}") > "$record"
  fi
}

if [[ -n ${QRSH_PORT:-} ]]; then
  exec {guard}>>"$record.lock"
  flock "$guard"
  [[ -e $record ]] || take
  exec {guard}>&-
  [[ -r $record ]] && export CUDA_VISIBLE_DEVICES="$(<"$record")"
  exec /bin/sh -c "$*"  # as without a starter: a task's command line goes through the shell
fi
rm -f "$record" "$pe_hosts"
if [[ -n ${PE_HOSTFILE:-} && -r ${PE_HOSTFILE:-} ]]; then cp "$PE_HOSTFILE" "$pe_hosts"; fi
take
[[ -r $record ]] && export CUDA_VISIBLE_DEVICES="$(<"$record")"
exec "$@"
