#!/usr/bin/env bash
# Sourced by scripts/suite.sh and scripts/test.sh: make ./.venv hold everything the suite needs.
#
# torch is the one dependency we never choose for a platform that already has it: Kaggle, Colab and
# GPU boxes ship a CUDA torch, and reinstalling it is slow at best and breaks the GPU at worst.
# Only where no torch exists at all do we install one (2.13.0): without an NVIDIA GPU, the CPU
# build (about 200 MB) from the machine's own mirror or PyTorch's CPU index, not PyPI's CUDA build
# (several GB).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "$(uname -s)" != "Linux" ]; then
  echo "Triton, which every kernel here is written in, installs on Linux only ($(uname -s) here)." >&2
  echo "Open the notebooks in Colab or Kaggle (README, 'Open a notebook'), or use Linux (WSL 2 works)." >&2
  exit 1
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # --system-site-packages: a GPU box's preinstalled CUDA torch stays visible and is reused.
  "$PYTHON" -m venv --system-site-packages .venv
fi
export PATH="$PWD/.venv/bin:$PATH"
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"
  else
    python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || python -m pip install -q --timeout 30 --retries 1 --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
      || { echo "no CPU build of torch 2.13.0 reachable: installing PyPI's (a CUDA build, several GB)"
           python -m pip install -q "torch==2.13.0"; }
  fi
fi
python -m pip install -q -r requirements.txt -e ".[suite,test]"
python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
python - <<'PY'
import torch, triton
print(f"environment ready: torch {torch.__version__}, triton {triton.__version__}, "
      f"CUDA {'available' if torch.cuda.is_available() else 'not available (CPU smoke profile)'}")
PY
