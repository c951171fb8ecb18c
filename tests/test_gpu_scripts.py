"""The GPU scripts behind the closing notes' figures run on a CPU with ``--tiny``.

They are how every GPU number in docs/PERFORMANCE.md was produced; a script that no longer runs
would only be found on the next GPU run, whose minutes are scarce. ``--tiny`` shrinks every shape
so the Triton kernels run under the interpreter: this checks the scripts' code paths and their
JSON, not any figure (timings under the interpreter mean nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
# speed_v3.py: the sections whose code the others do not run ("trained" runs the accuracy check and
# the time measure of "accuracy" and "time" on one shape; "profile" needs CUDA for what it measures).
@pytest.mark.parametrize("script", ["cce_check.py", "tune.py", "speed_v3.py --sections trained checks"])
def test_gpu_script_runs_tiny_on_cpu(script, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    name, *options = script.split()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / name), *options, "--tiny", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["failed"] == 0
    assert result["records"], "no case ran"
    errors = [r for r in result["records"] if r.get("status") == "error"]
    assert not errors, errors
