#!/usr/bin/env bash
# GPU check of the vLLM-Omni engine (rollout/vllm_omni). Run from the repo root on a CUDA box.
# Installs into its own venv (.venv-vllm): vllm==0.30.0 pins torch==2.13.0 (CUDA 13 wheels), which
# must govern there, so the project's CPU constraints.txt (torch==2.14.1) is NOT applied. vllm,
# vllm-omni and the project resolve in ONE pip call so vllm's torch pin wins.
set -uo pipefail
VENV=${VENV:-.venv-vllm}
summary=()
step() { local name=$1; shift; if "$@"; then summary+=("PASS $name"); else summary+=("FAIL $name"); fi; }

if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
step install "$VENV/bin/pip" install -q "vllm==0.30.0" "vllm-omni==0.30.0" -e ".[dev]"
step torch-pin "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__; assert torch.cuda.is_available()"
step import "$VENV/bin/python" -c "import vllm_omni; from vllm_omni.entrypoints.async_omni import AsyncOmni; from rollout.vllm_omni.api import load_real_api; load_real_api()"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
step engine "$VENV/bin/python" -m pytest -q -s -m gpu tests/test_vllm_omni_gpu.py -p no:cacheprovider

printf '%s\n' "----- vLLM-Omni GPU check -----" "${summary[@]}"
! printf '%s\n' "${summary[@]}" | grep -q '^FAIL'
