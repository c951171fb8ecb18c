"""The GPU scripts' shared start and finish (``cce_check.py``, ``tune.py``).

Each script checks and times several cases in one call (device time is scarce), keeps going past a
failing case, writes every record to a results file (``helpers.compare.results_file``: JSON Lines,
a meta record first), and exits 1 if any case failed. ``--tiny`` shrinks every
shape so the script runs on a CPU under the Triton interpreter: CI runs each that way, so a script
that no longer runs is found before the next GPU call, not during it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The scripts run from a checkout (or its copy on a GPU box), not from an installed package: this
# checkout's ``helpers`` unless one is on the path already (an A/B puts another tree first on PYTHONPATH).
if importlib.util.find_spec("helpers") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402

import helpers  # noqa: E402,F401  (the environment first: helpers.env)
from helpers.cce.kernels.configs import select_configs  # noqa: E402
from helpers.compare.results_file import ResultsWriter, run_meta  # noqa: E402


def _fmt(v):
    return f"{v:.2e}" if isinstance(v, float) else str(v)


class Checker:
    """Runs cases, records each result or error, never raises; optional cases past the time budget
    are recorded as skipped. With ``out`` each record is appended to that results file as it comes
    (a run killed halfway keeps what it measured); ``finish`` then completes the meta record."""

    def __init__(self, budget_s: float, device: str, out: str | None = None):
        self.t0 = time.time()
        self.budget_s = budget_s
        self.device = device
        self.records: list[dict] = []
        self.failed = 0
        self.writer = ResultsWriter(out, run_meta(device)) if out else None

    def _record(self, record: dict) -> None:
        self.records.append(record)
        if self.writer:
            self.writer.append(record)

    def run(self, name: str, fn, *args, required=False, **kwargs):
        """Run one case; record its result (a dict or a list of dicts) or its error."""
        if not required and time.time() - self.t0 > self.budget_s:
            self._record(dict(case=name, status="skipped (time budget)"))
            print(f"[skip] {name}: past the {self.budget_s:.0f} s budget", flush=True)
            return None
        start = time.time()
        try:
            out = fn(*args, **kwargs)
        except Exception as error:  # a failing case must not stop the others
            self.failed += 1
            self._record(dict(case=name, status="error", error=f"{type(error).__name__}: {error}"))
            print(f"[ERROR] {name}: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
            return None
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for record in out if isinstance(out, list) else [out]:
            record.setdefault("case", name)
            record["seconds"] = round(time.time() - start, 2)
            if record.get("status") == "FAIL":
                self.failed += 1
            self._record(record)
            print(f"[{record.get('status', 'ok')}] {record['case']}: "
                  + ", ".join(f"{k}={_fmt(v)}" for k, v in record.items()
                              if k not in ("case", "status")), flush=True)
        return out


def script_setup(doc: str, out_name: str, budget_s: float, add_arguments=None):
    """--out (default $OUT/out_name), --budget-s, --tiny and any ``add_arguments(parser)`` adds;
    exits without CUDA unless --tiny; on CUDA turns TF32 off (fp32 references and naive paths in
    real fp32) and prints the device, versions and configuration tier.
    Returns (args, cuda, device, scale), ``scale(n, lo)`` shrinking a size for --tiny."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    default_out = os.path.join(os.environ["OUT"], out_name) if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out, help=f"results file, JSON Lines (default $OUT/{out_name})")
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help="optional cases that would start after this many seconds are skipped")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of this script)")
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
              f"configs {select_configs(torch.device('cuda')).name}", flush=True)
    elif not args.tiny:
        sys.exit("no CUDA device: run with --tiny to check the script on a CPU")
    scale = (lambda n, lo: max(lo, n // 256)) if args.tiny else (lambda n, lo: n)
    return args, cuda, "cuda" if cuda else "cpu", scale


def finish(c: Checker, out: str | None, cuda: bool) -> None:
    """Print the count line, write the records to the results file ``out`` (the meta record counts
    the failures and the seconds; a Checker given ``out`` has written them already), exit 1 if
    any case failed."""
    total = time.time() - c.t0
    print(f"{len(c.records)} records, {c.failed} failed, {total:.0f} s")
    if c.writer:
        c.writer.update_meta(seconds=round(total, 1), failed=c.failed)
        print(f"wrote {c.writer.path}")
    elif out:
        writer = ResultsWriter(out, run_meta("cuda" if cuda else "cpu", seconds=round(total, 1), failed=c.failed))
        for record in c.records:
            writer.append(record)
        print(f"wrote {out}")
    sys.exit(1 if c.failed else 0)
