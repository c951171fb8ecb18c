#!/usr/bin/env bash
# One command: set up, then run the test suite on the CPU (Triton kernels under the interpreter).
# Extra arguments go to pytest (e.g. -k gate).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m pytest "$@"
