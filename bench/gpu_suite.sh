#!/usr/bin/env bash
# The lent-H200 run behind the closing notes, in one call (device time is scarce): the whole suite
# on the gpu profile, then notebook 02 again as a pretend 16 GB T4, then whatever time is left on
# the Gemma-2-2B benchmark. Results are packed into $OUT/results.tgz even when a step times out.
#   bash bench/gpu_suite.sh [suite seconds] [t4 seconds] [bench seconds]
source bench/device_env.sh || exit 1
R=/tmp/results
mkdir -p "$R"
step() { local limit=$1; shift; local t0=$SECONDS; timeout "$limit" "$@"; echo "== exit $? after $((SECONDS - t0)) s: $*"; }
step "${1:-470}" python3 -m helpers run --profile gpu --output "$R"
mkdir -p "$R/02_memory_sweep_t4"
step "${2:-80}" python3 -m papermill notebooks/02_memory_sweep.ipynb "$R/02_memory_sweep_t4/02_memory_sweep.ipynb" \
  -p profile gpu -p output_dir "$R/02_memory_sweep_t4" -p pretend_t4 True --cwd notebooks --no-progress-bar
step "${3:-0}" python3 -m helpers bench --shapes gemma2-2b --methods torch_compile liger cce ours \
  --time-failed --output "$R/bench/gemma2.jsonl"
tar czf "$OUT/results.tgz" -C /tmp results
python3 - <<'PY'
import json, pathlib
r = pathlib.Path("/tmp/results")
for p in [r / "01_correctness/report.md", r / "02_memory_sweep/report.md", r / "02_memory_sweep_t4/report.md"]:
    if p.exists():
        print(f"\n##### {p}\n" + p.read_text()[:6000])
s = r / "summary.json"
if s.exists():
    for run in json.loads(s.read_text())["runs"]:
        print(run["notebook"], run["status"], run["seconds"], run["error"][:300])
PY
