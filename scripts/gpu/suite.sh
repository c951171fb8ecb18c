#!/usr/bin/env bash
# The whole notebook suite on a GPU box in one call (device time is scarce), in one of these modes:
#   bash scripts/gpu/suite.sh pretend-t4 [seconds] [notebook prefixes...]  every notebook as a T4 sees it
#   bash scripts/gpu/suite.sh pretend-<card> [seconds] [...]               as another card of helpers.cce.device.CARDS
#                                                                          sees it: a100-40gb (pretend-a100 for short),
#                                                                          a100-80gb, l4 (the gpu profile, bf16)
#   bash scripts/gpu/suite.sh t4 [seconds] [...]                            the T4 profile (fp16), this GPU as itself
#   bash scripts/gpu/suite.sh gpu [seconds] [...]                           the gpu profile (bf16, full sizes)
# QUICK=1 in the environment adds --quick (each notebook's short run).
# Results are packed into $OUT/results-<mode>.tgz even when the run is cut by its time limit, and
# the summary (each notebook's status and seconds) and the REPORT's first lines are printed last.
source scripts/gpu/env.sh || exit 1
mode=${1:-pretend-t4}
limit=${2:-570}
shift 2 2>/dev/null
only=()
[ $# -gt 0 ] && only=(--only "$@")
case "$mode" in
  pretend-a100) mode=pretend-a100-40gb; args=(--pretend a100-40gb) ;;
  pretend-*) args=(--pretend "${mode#pretend-}") ;;
  t4|gpu) args=(--profile "$mode") ;;
  *) echo "mode must be pretend-<card> (t4, a100, a100-40gb, a100-80gb, l4), t4 or gpu, not $mode"; exit 2 ;;
esac
R=/tmp/results-$mode
mkdir -p "$R"
[ -n "$QUICK" ] && args+=(--quick)
t0=$SECONDS
timeout "$limit" python3 -m helpers run "${args[@]}" --output "$R" "${only[@]}"
echo "== exit $? after $((SECONDS - t0)) s: helpers run ${args[*]} ${only[*]}"
tar czf "$OUT/results-$mode.tgz" -C /tmp "results-$mode"
python3 - "$R" <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
report = r / "REPORT.md"
if report.exists():
    print(report.read_text()[:5000])
s = r / "summary.json"
if s.exists():
    for run in json.loads(s.read_text())["runs"]:
        print(f"{run['notebook']:<24} {run['status']:<7} {run['seconds']:>7.1f} s  {run['error'][:300]}")
PY
