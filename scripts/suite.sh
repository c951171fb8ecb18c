#!/usr/bin/env bash
# One command: set up, then run every notebook headless for the hardware found.
# Extra arguments go to `python -m helpers run` (e.g. --profile t4 --output /tmp/results).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m helpers run "$@"
