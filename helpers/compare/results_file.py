"""The one results format of everything that times: JSON Lines, a meta record first.

``python -m helpers bench`` and the GPU scripts (``scripts/gpu/_common.py``) write through it, so a
run folder under ``docs/measurements/`` reads the same whoever produced it::

    {"record": "meta", "schema": 1, "time": "2026-12-02T10:00:00+00:00", "command": [...],
     "device": {...}, "versions": {"python": ..., "torch": ..., "triton": ..., "helpers": ...}, ...}
    {"record": "result", ...one measurement...}
    {"record": "result", ...}

Results are appended as they come, so a run that dies keeps what it measured. The meta record
may grow during the run (the bench adds the facts of each trained model it builds): it is
rewritten in place, the results after it untouched.

``read_results`` also reads the two formats that came before (``docs/measurements`` up to
2026-12-02): a bench's JSON Lines with its ``.meta.json`` beside it, and a GPU script's one JSON
object ``{"meta": ..., "records": [...]}``.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

SCHEMA_VERSION = 1


def _versions() -> dict:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in ("torch", "triton", "helpers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def run_meta(device=None, command: list[str] | None = None, **extra) -> dict:
    """The meta record: schema version, time (UTC), the command line, the device
    (``helpers.cce.device.device_info``), the versions of python, torch, triton and helpers, and
    ``extra`` (what the run wants on record: its gate, its options)."""
    from helpers.cce.device import device_info

    return {
        "record": "meta",
        "schema": SCHEMA_VERSION,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(sys.argv if command is None else command),
        "device": device_info(device).as_dict(),
        "versions": _versions(),
        **extra,
    }


class ResultsWriter:
    """Starts ``path`` with ``meta`` (replacing what was there) and appends one result a line."""

    def __init__(self, path: str | Path, meta: dict):
        self.path = Path(path)
        self.meta = {"record": "meta", "schema": SCHEMA_VERSION, **meta}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(_line(self.meta))

    def append(self, result: dict) -> None:
        with self.path.open("a") as f:
            f.write(_line({"record": "result", **result}))

    def replace(self, index: int, result: dict) -> None:
        """Put ``result`` in place of the ``index``-th result appended (0 is the first)."""
        lines = self.path.read_text().splitlines(keepends=True)
        if not 0 <= index < len(lines) - 1:
            raise IndexError(f"index must be in [0, {len(lines) - 1}), got {index}")
        lines[index + 1] = _line({"record": "result", **result})
        self.path.write_text("".join(lines))

    def update_meta(self, **fields) -> None:
        """Add ``fields`` to the meta record, keeping the results already written."""
        self.meta.update(fields)
        lines = self.path.read_text().splitlines(keepends=True)
        self.path.write_text(_line(self.meta) + "".join(lines[1:]))


def _line(record: dict) -> str:
    return json.dumps(record, default=str) + "\n"


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """(meta, results) of a results file, each result without its ``"record"`` key; also reads the
    formats before schema 1 (module doc), whose meta comes back as it was written."""
    path = Path(path)
    text = path.read_text()
    if text.lstrip().startswith("{") and not text.lstrip().startswith('{"record"'):
        try:  # one JSON object: a GPU script's {"meta", "records"} before schema 1
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and "records" in whole:
            return whole.get("meta", {}), whole["records"]
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if rows and rows[0].get("record") == "meta":
        meta, results = rows[0], rows[1:]
        return meta, [{k: v for k, v in r.items() if k != "record"} for r in results]
    side = path.with_suffix(".meta.json")  # a bench's JSON Lines before schema 1
    return (json.loads(side.read_text()) if side.exists() else {}), rows
