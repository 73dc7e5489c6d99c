#!/usr/bin/env bash
# The test command's stages, after the main environment's set-up: the README's second command ends with
# `bash tests/ci.sh`, and .ci/run runs exactly that command in a fresh clone.
#
#   bash tests/ci.sh             # everything CI runs, with each stage's time
#   OOMGUARD_CI_LOGS=DIR bash tests/ci.sh   # where the background builds log (default .ci-logs, ignored by git)
#
# 1. The other environments (tests/compat.sh: the oldest TRL; tests/vllm.sh, tests/swift.sh, tests/unsloth.sh: each
#    stack in its own) are built one after another in the background while the main suite runs: building them is
#    mostly downloading and unpacking, which overlaps with the suite's CPU-bound tests.
# 2. mypy over oomguard/ (`python -m mypy`, configured in pyproject.toml: strict where the code is pure), before the
#    suite so that a type error fails CI in seconds (about 10 s with a cold cache); meanwhile the main environment's
#    bytecode is written once (the README's command installs it with pip's --no-compile).
# 3. The main suite, the default run and the `slow` tests in one pytest run (one collection, one build of the tiny
#    models, no worker idle between the two). `python -m pytest -q` alone is the default run (within 5 minutes).
# 4. Each environment's tests, once it is built, on two workers.
#
# Disk: the five environments take about 11 GiB, each with its own copy of the same torch. After each build, files
# that are the same in two environments become one (util-linux's `hardlink`, where the machine has it), which brings
# them to about 7 GiB; pip never writes into an installed file, so a later install in one leaves the others as they
# are. CI says at its start when the disk has less than that free, since a full disk fails hundreds of tests at once.
#
# CI=1 is exported, so a test that needs a tool CI must have (Chromium for the HTML reports) fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI=${CI:-1}
logs=${OOMGUARD_CI_LOGS:-.ci-logs}
mkdir -p "$logs"
rm -f "$logs"/*.rc
t0=$(date +%s)
stamp() { echo "ci: $1 ($(( $(date +%s) - t0 )) s since the start)"; }
STACKS=(compat vllm swift unsloth)
free_gib=$(( $(df -Pk . | awk 'NR == 2 { print $4 }') / 1048576 ))
[ "$free_gib" -ge 8 ] || echo "ci: warning: $free_gib GiB free on this disk, where the environments take about 7 GiB" >&2

# A process group of its own, so that it can be stopped whole (its pip processes included) if CI ends early.
setsid bash -c '
  for s in "$@"; do
    start=$(date +%s)
    if bash "tests/$s.sh" --setup > "'"$logs"'/$s-setup.log" 2>&1; then rc=0; else rc=$?; fi
    command -v hardlink > /dev/null && { hardlink -q -t .venv .venv-* > /dev/null 2>&1 || true; }
    echo "$rc $(( $(date +%s) - start ))" > "'"$logs"'/$s.rc"
  done
' builder "${STACKS[@]}" &
builder=$!
# Stop it whole at the end: its process group, or, where setsid has not yet made the group (a suite that failed at
# once), the process itself; then once more, in case the group was made in between.
stop_builder() {
  local _
  for _ in 1 2 3; do
    kill -- -"$builder" 2>/dev/null || kill "$builder" 2>/dev/null || return 0
    sleep 0.2
  done
}
trap stop_builder EXIT

# The main environment's bytecode, written while mypy runs (the README's command installs with pip's --no-compile):
# in unchecked-hash mode, as each stack's (tests/stackenv.sh, compile_env: valid after `hardlink -t`, and needed where
# PYTHONDONTWRITEBYTECODE keeps a process from writing what it compiles); oomguard's own sources and the tests' in
# the default mode, which checks their times
source tests/stackenv.sh
{ compile_env python; python -m compileall -q oomguard tests > /dev/null 2>&1 || true; } &
compiling=$!
python -m mypy
wait "$compiling" || true
stamp "mypy passed"

python -m pytest -q -m "slow or not slow"
stamp "the main suite passed"

for s in "${STACKS[@]}"; do
  while [ ! -f "$logs/$s.rc" ]; do
    kill -0 "$builder" 2>/dev/null || { echo "ci: the background build stopped before $s" >&2; exit 1; }
    sleep 2
  done
  read -r rc took < "$logs/$s.rc"
  if [ "$rc" != 0 ]; then
    tail -n 40 "$logs/$s-setup.log" >&2
    echo "ci: building the $s environment failed (exit $rc; the whole log: $logs/$s-setup.log)" >&2
    exit 1
  fi
  stamp "the $s environment was built in the background in $took s"
  bash "tests/$s.sh" --test
  stamp "the $s tests passed"
done
