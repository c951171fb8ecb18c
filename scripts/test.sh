#!/usr/bin/env bash
# One command: set up, then run the test suite on the CPU (Triton kernels under the interpreter).
# Extra arguments go to pytest (e.g. -k gate).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# Tests in parallel, one worker per core up to 4 (2 cores: 13-16 minutes against 22 in one process).
# worksteal: the slowest tests (the notebook suite, the GPU scripts' --tiny runs) sit at the end
# of the collection, and an idle worker takes them from a busy one.
# Extra arguments come after and win (-n 0: one process).
workers=$(python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
if [ "$workers" -ge 2 ]; then
  exec python -m pytest -n "$workers" --dist worksteal "$@"
fi
exec python -m pytest "$@"
