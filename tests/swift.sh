#!/usr/bin/env bash
# ms-swift's `swift rlhf --rlhf_type grpo` under oomguard, for real: the tests marked `swift` (tests/test_swift.py) in
# an environment of ms-swift's own, as tests/compat.sh runs the core tests under the oldest TRL.
#
#   bash tests/swift.sh                          # build .venv-swift if needed (about 8 minutes from scratch), then test
#   OOMGUARD_SWIFT_VENV=DIR bash tests/swift.sh  # the environment's directory (default .venv-swift)
#   bash tests/swift.sh --setup | --test    # only build the environment, or only run the tests in it
#
# ms-swift 4.6.0 (the newest) pins peft<0.21, trl<1.0 and transformers<5.20; it resolves TRL 0.29.1, transformers
# 5.19.0 and peft 0.20.0 here. It imports msgspec and, for its accuracy reward, math-verify without declaring them.
# torch 2.13.0 (the CPU build) goes first and a constraint keeps it. The script also checks what issue 31 promises
# users: installing oomguard into the environment changes the version of none of its packages (it may add its own).
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/stackenv.sh
stack_mode "$@"
venv=${OOMGUARD_SWIFT_VENV:-.venv-swift}
start=$(date +%s)
if [ "$mode" != test ]; then
  stack_env "$venv"
  "$py" -m pip install -q --no-compile -c "$constraints" ms-swift==4.6.0 msgspec math-verify "${TEST_TOOLS[@]}"
  install_oomguard_unchanged "$py" "$constraints" swift
  compile_env "$py"
  echo "swift: environment ready in $(( $(date +%s) - start )) s"
fi
[ "$mode" = setup ] && exit 0
stack_ready "$venv" swift
"$py" -m pytest -q -m swift tests/test_swift.py
echo "swift: done in $(( $(date +%s) - start )) s"
