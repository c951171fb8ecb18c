#!/usr/bin/env bash
# One command: set up, lint, then run the test suite on the CPU (Triton kernels under the interpreter).
# Extra arguments go to pytest (e.g. -k gate).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# Lint first (seconds; pyproject.toml [tool.ruff]); the tests run even when it fails, so one
# report shows both, and the exit status is the lint's failure if the tests pass.
lint=0
python -m ruff check . || lint=$?
# Tests in parallel, one worker per core up to 4 (2 cores: pytest 15 minutes alone, the notebook suite the largest part).
# worksteal: an idle worker takes tests from a busy one; the notebook suite's two runs, the slowest, are
# collected first (tests/conftest.py) so that they start at once.
# Extra arguments come after and win (-n 0: one process).
workers=$(python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
# OpenMP threads (torch's, MKL's) sleep as soon as their work is done instead of spinning: with a worker
# per core, a spinning thread takes the core from the other worker (tests/cce/test_cce.py on 2 cores:
# 131 s spinning, 95 s passive, 100 s with one thread; test_sparse.py 133 s either way).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
tests=0
if [ "$workers" -ge 2 ]; then
  python -m pytest -n "$workers" --dist worksteal --durations=25 "$@" || tests=$?
else
  python -m pytest "$@" || tests=$?
fi
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
if [ "$lint" -ne 0 ]; then echo "ruff check failed (above)" >&2; fi
exit "$lint"
