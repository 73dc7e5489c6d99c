# Sourced by tests/vllm.sh, tests/swift.sh and tests/unsloth.sh, each of which tests one stack in its own environment.
#
#   stack_env DIR        create the environment DIR if needed, with torch 2.13.0 (the CPU build) first and a constraint
#                        file that keeps it; sets $py and $constraints
#   compile_env PYTHON   write the bytecode of every package in PYTHON's environment once (see below); each
#                        script's --setup ends with it, and installs with pip's --no-compile before it
#   install_oomguard_unchanged PYTHON CONSTRAINTS LABEL
#                        install oomguard into a stack's environment and show that it changes the version of none of
#                        its packages (issue 31: installing oomguard must not break the stack's pins); oomguard is
#                        uninstalled first, so a reused environment proves it again
TEST_TOOLS=("pytest>=8" "pytest-xdist>=3.6" "hypothesis>=6.100")

stack_env() {
  local venv=$1
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  py="$venv/bin/python"
  constraints="$venv/torch-constraint.txt"
  echo "torch==2.13.0" > "$constraints"
  "$py" -m pip install -q --no-compile torch==2.13.0
}

# Bytecode in unchecked-hash mode: valid whatever the sources' modification times. tests/ci.sh links the files that
# are the same in two environments (`hardlink -t`), which gives each linked source one of the two times, and a
# timestamp-checked .pyc no longer matches it; where PYTHONDONTWRITEBYTECODE is set (as on the CI machines), nothing
# is written back either, so every process of every test compiled torch, transformers and TRL again from source
# (`from trl import GRPOTrainer`: 12.7 s instead of 5.8 s, measured 2026-11-29). pip writes it again for what it
# upgrades, and removes the old files' bytecode with them. oomguard's own sources (an editable install) are not here.
compile_env() {
  local site
  site=$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$1" -m compileall -q -f -j 0 --invalidation-mode unchecked-hash "$site" > /dev/null 2>&1 || true
}

install_oomguard_unchanged() {
  local py=$1 constraints=$2 label=$3 before after changed added
  "$py" -m pip uninstall -q -y oomguard 2>/dev/null || true
  before=$("$py" -m pip list --format=freeze 2>/dev/null | grep -viE '^(oomguard|-e )' | sort)
  "$py" -m pip install -q --no-compile -c "$constraints" -e .
  after=$("$py" -m pip list --format=freeze 2>/dev/null | grep -viE '^(oomguard|-e )' | sort)
  changed=$(comm -23 <(echo "$before") <(echo "$after"))
  if [ -n "$changed" ]; then
    echo "$label: installing oomguard changed these packages of the environment: $(echo "$changed" | tr '\n' ' ')" >&2
    return 1
  fi
  added=$(comm -13 <(echo "$before") <(echo "$after") | tr '\n' ' ')
  echo "$label: installing oomguard changed no package of the environment ($(echo "$before" | wc -l) kept);" \
    "it added ${added:-nothing but itself}"
}

#   stack_mode "$@"      read the script's first argument: --setup (only build the environment), --test (only run
#                        the tests, in the environment built before) or none (both); sets $mode
#   stack_ready DIR LABEL
#                        before --test: the environment must exist; sets $py and exports two test workers (a run
#                        given a path would otherwise stay in one process)
stack_mode() {
  mode=all
  case "${1:-}" in
    --setup|--test) mode=${1#--} ;;
    "") ;;
    *) echo "usage: bash $0 [--setup|--test]" >&2; exit 2 ;;
  esac
}

stack_ready() {
  py="$1/bin/python"
  [ -x "$py" ] || { echo "$2: no environment in $1: run bash $0 --setup first" >&2; exit 1; }
  export OOMGUARD_TEST_WORKERS=${OOMGUARD_TEST_WORKERS:-2}
}
