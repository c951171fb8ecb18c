#!/usr/bin/env bash
# Stage the suite for Kaggle: one push-ready folder per notebook (kernel-metadata.json checked
# against the CLI's rules) and the offline wheels dataset, under build/kaggle/. Pushing is left to
# you (build/kaggle/PUSH.md lists the commands): every push starts a GPU run.
#   bash scripts/stage_kaggle.sh --username YOUR_KAGGLE_NAME [--offline] [--only 01 02] [--wheelhouse DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m helpers.suite.kaggle "$@"
