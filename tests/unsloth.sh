#!/usr/bin/env bash
# An Unsloth GRPO notebook under oomguard, for real: the tests marked `unsloth` (tests/test_unsloth.py) in an
# environment of Unsloth's own, as tests/compat.sh runs the core tests under the oldest TRL.
#
#   bash tests/unsloth.sh                            # build .venv-unsloth if needed (about 8 minutes), then test
#   OOMGUARD_UNSLOTH_VENV=DIR bash tests/unsloth.sh  # the environment's directory (default .venv-unsloth)
#   bash tests/unsloth.sh --setup | --test    # only build the environment, or only run the tests in it
#
# unsloth 2026.10.9 (the newest) pins trl<=1.15.0 and transformers<=5.17.0, and asks for an unpinned torchvision whose
# newest release pins a CUDA torch: torch 2.13.0 (the CPU build) goes first and a constraint keeps it. The registry's
# torchvision for that torch is a CUDA build whose operators do not load beside the CPU torch, and `import unsloth`
# refuses it ("torchvision::nms does not exist"): it is uninstalled (nothing on the text path uses it; Unsloth's check
# skips an absent torchvision). On this CPU Unsloth runs its CPU backend ("no GPU found, training on CPU"). The script
# also checks what issue 31 promises users: installing oomguard changes the version of none of its packages.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/stackenv.sh
stack_mode "$@"
venv=${OOMGUARD_UNSLOTH_VENV:-.venv-unsloth}
start=$(date +%s)
if [ "$mode" != test ]; then
  stack_env "$venv"
  if ! "$py" -c "import importlib.metadata as m; assert m.version('unsloth') == '2026.10.9'" 2>/dev/null; then
    "$py" -m pip install -q --no-compile -c "$constraints" unsloth==2026.10.9
  fi
  "$py" -m pip uninstall -q -y torchvision 2>/dev/null || true
  "$py" -m pip install -q --no-compile -c "$constraints" "${TEST_TOOLS[@]}"
  install_oomguard_unchanged "$py" "$constraints" unsloth
  compile_env "$py"
  echo "unsloth: environment ready in $(( $(date +%s) - start )) s"
fi
[ "$mode" = setup ] && exit 0
stack_ready "$venv" unsloth
"$py" -m pytest -q -m unsloth tests/test_unsloth.py
echo "unsloth: done in $(( $(date +%s) - start )) s"
