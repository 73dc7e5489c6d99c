#!/usr/bin/env bash
# The other end of the supported TRL range: the core end-to-end tests (marker `core`) under the oldest supported TRL,
# in a virtual environment of its own. The main suite runs under the newest TRL (the one `pip install -e ".[test]"`
# resolves); this runs TRL 0.29.1 with transformers 5.3.0, the transformers that was current when it came out.
#
#   bash tests/compat.sh                      # the floor (about 1 minute to set up with pip's cache, then the tests)
#   bash tests/compat.sh 1.10.0               # another release, with the transformers pip resolves for it
#   OOMGUARD_COMPAT_VENV=DIR bash tests/compat.sh   # the environment's directory (default .venv-trl-RELEASE)
#   bash tests/compat.sh --setup | --test     # only build the environment, or only run the tests in it (tests/ci.sh
#                                             # builds it in the background while the main suite runs)
#
# It also checks what the issue promises users: installing oomguard into an environment whose TRL and transformers
# are inside its range leaves both as they were.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/stackenv.sh
mode=all
case "${1:-}" in --setup|--test) mode=${1#--}; shift ;; esac
trl_version=${1:-0.29.1}
if [ "$trl_version" = "0.29.1" ]; then stack=("trl==0.29.1" "transformers==5.3.0"); else stack=("trl==$trl_version"); fi
venv=${OOMGUARD_COMPAT_VENV:-.venv-trl-$trl_version}
start=$(date +%s)
py="$venv/bin/python"
if [ "$mode" != test ]; then
  [ -x "$py" ] || python3 -m venv "$venv"
  "$py" -m pip install -q --no-compile torch==2.13.0
  # TRL 0.29.1 imports `requests` without declaring it (through its vLLM client); environments of its time had it. Its
  # tools need `jmespath` (response parsing), which it does not declare either (TRL 1.x does).
  "$py" -m pip install -q --no-compile "${stack[@]}" requests jmespath
  before=$("$py" -m pip list --format=freeze 2>/dev/null | grep -iE '^(trl|transformers)==' | sort)
  "$py" -m pip install -q --no-compile -e ".[all]" "pytest>=8" "pytest-xdist>=3.6" "hypothesis>=6.100"
  after=$("$py" -m pip list --format=freeze 2>/dev/null | grep -iE '^(trl|transformers)==' | sort)
  if [ "$before" != "$after" ]; then
    echo "installing oomguard changed the environment's TRL or transformers: $(echo "$before" | tr '\n' ' ')-> $(echo "$after" | tr '\n' ' ')" >&2
    exit 1
  fi
  # DeepSpeed as the main suite has it (no ops built, from its source distribution against this torch), for the ZeRO
  # configs in the forms users write: a stage-only dict and an accelerate YAML. Runs without DeepSpeed installed are
  # the stack environments' (tests/vllm.sh, swift.sh, unsloth.sh install none)
  "$py" -m pip install -q --no-compile --no-build-isolation deepspeed==0.19.8 einops
  compile_env "$py"  # tests/stackenv.sh: bytecode valid after tests/ci.sh links files between environments
  echo "compat: $(echo "$after" | tr '\n' ' ')kept by pip install -e . ($(( $(date +%s) - start )) s to set up)"
fi
[ "$mode" = setup ] && exit 0
[ -x "$py" ] || { echo "compat: no environment in $venv: run bash tests/compat.sh --setup first" >&2; exit 1; }
# two workers, as the main suite has on two cores (a run given a path would otherwise stay in one process)
export OOMGUARD_TEST_WORKERS=${OOMGUARD_TEST_WORKERS:-2}
"$py" -m pytest -q -m core
echo "compat: TRL $trl_version done in $(( $(date +%s) - start )) s"
