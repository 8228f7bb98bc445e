#!/usr/bin/env bash
# A device script run in the background of the warm machine, so that it goes on while later
# calls carry files (a process in a session of its own outlives the call that started it, and
# runs until the machine goes back). Each job gets a copy of this tree, its own package folder
# (SPIN_PKG) and results folder under /tmp/bg/NAME:
#   bash benchmarks/gpu_background.sh NAME SCRIPT     start SCRIPT (env passes through); returns at once
#   bash benchmarks/gpu_background.sh --collect       every job's results into $OUT/NAME/, and
#                                                     its state: running, or its exit status
# Every later call should start with --collect: what a job wrote comes back, however the
# session ends. A job may wait for another with `wait_job NAME SECONDS` (below, sourced).
set -o pipefail
BG=/tmp/bg
wait_job() {  # NAME SECONDS: until job NAME has ended (or never started), at most SECONDS
  local i
  [ -d "$BG/$1" ] || return 0
  for ((i = 0; i < $2; i++)); do [ -f "$BG/$1/rc" ] && return 0; sleep 1; done
  echo "job $1 still running after $2 s; going on beside it"
}
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced for wait_job
if [ "$1" = --collect ]; then
  : "${OUT:?set OUT}"
  for job in "$BG"/*/; do
    [ -d "$job" ] || continue
    name=$(basename "$job")
    mkdir -p "$OUT/$name" && cp -r "$job/out/." "$OUT/$name/" 2>/dev/null
    cp "$job/log" "$OUT/$name/job.log" 2>/dev/null
    state=running; [ -f "$job/rc" ] && state="exit $(cat "$job/rc")"
    echo "== job $name: $state, $(( $(date +%s) - $(cat "$job/started") )) s"
    tail -n "${TAIL:-6}" "$job/log"
  done
  exit 0
fi
name=${1:?job name} script=${2:?script}
job=$BG/$name
[ -f "$job/started" ] && [ ! -f "$job/rc" ] && { echo "job $name is already running"; exit 1; }
rm -rf "$job" && mkdir -p "$job/out"
cp -r . "$job/repo"
date +%s > "$job/started"
# setsid: a session of its own, so that the call's end does not end it.
OUT=$job/out SPIN_PKG=$job/pkg setsid bash -c "cd '$job/repo' && bash '$script' > '$job/log' 2>&1; echo \$? > '$job/rc'" \
  < /dev/null > /dev/null 2>&1 &
echo "job $name started: $script"
