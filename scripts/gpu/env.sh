#!/usr/bin/env bash
# Source on a GPU box that cannot reach a package registry: installs the wheels
# carried in .whl/ (the peers, papermill and its kernel stack; fetched beforehand with
# `pip download --no-deps`) into /tmp/site without touching the machine's torch and triton, and puts
# this checkout on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch, triton, helpers
print(f"torch {torch.__version__}, triton {triton.__version__}, {helpers.device_info().describe()}")
PY
