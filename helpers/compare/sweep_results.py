"""Reading a memory sweep's points (``helpers.compare.sweep``): the article-like table
(``results_pivot``), one sentence per method (``describe_methods``), the report's line and facts
(``headline``, ``report_facts``), and the files (``write_results``). What the points mean for a
method's verdict is ``helpers.compare.verdicts``'s.

Bytes everywhere; GB means 10^9 bytes (the article's unit).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from helpers.compare.units import format_bytes, memory_unit, timed_calls
from helpers.compare.methods import METHODS
from helpers.compare.sweep import ARTICLE_MICRO_BATCH_N, MethodPlan

# ---------------------------------------------------------------------------------------------
# Reading the results: table, verdicts, files
# ---------------------------------------------------------------------------------------------


def _records_unit(records: list[dict]) -> tuple[str, float]:
    keys = ("peak_bytes", "theory_bytes", "lower_bound_bytes")
    return memory_unit(max((r[k] or 0 for r in records for k in keys), default=0))


def _in(value: int | float | None, unit: tuple[str, float], digits: int = 3) -> str:
    return "—" if value is None else f"{value / unit[1]:.{digits}f}"


def _ms(ms: float) -> str:
    """Milliseconds to read: about three significant digits, never an exponent."""
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _first_oom_n(rows: list[dict]) -> int | None:
    return min((r["N"] for r in rows if r["status"] == "oom"), default=None)


def _largest_common_n(records: list[dict], methods: list[str]) -> int | None:
    """The largest N at which every one of ``methods`` measured a peak (the smallest N of ``records`` when
    there is none)."""
    ok = {(r["method"], r["N"]) for r in records if r["status"] == "ok"}
    Ns = sorted({r["N"] for r in records})
    common = [N for N in Ns if all((m, N) in ok for m in methods)]
    return common[-1] if common else Ns[0] if Ns else None


def _flat_methods(records: list[dict]) -> list[str]:
    """The methods that never ran out of memory and measured a peak somewhere."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    return [m for m in methods if _first_oom_n([r for r in records if r["method"] == m]) is None
            and any(r["method"] == m and r["status"] == "ok" for r in records)]


def memory_order_n(records: list[dict]) -> int | None:
    """The N ``memory_order`` compares the methods that never ran out of memory at: the largest N that all
    of them measured (every method's, when each met a wall), so that a method's place is not decided below
    where the others stopped."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    return _largest_common_n(records, _flat_methods(records) or methods)


def memory_order(records: list[dict]) -> list[str]:
    """The methods of ``records`` from the least memory to the most: those that never ran out of
    memory first, by their measured peak at ``memory_order_n``; those that did after them, the
    earliest wall last, methods with the same wall by their peak at the largest N all of them measured."""
    methods = list(dict.fromkeys(r["method"] for r in records))
    ok = {(r["method"], r["N"]): r["peak_bytes"] for r in records if r["status"] == "ok"}
    flat = set(_flat_methods(records))
    walls = {m: _first_oom_n([r for r in records if r["method"] == m]) for m in methods}
    at_flat = memory_order_n(records)
    at_wall = {wall: _largest_common_n(records, [m for m in methods if walls[m] == wall])
               for wall in set(walls.values()) if wall is not None}

    def key(method: str) -> tuple:
        wall = walls[method]
        at = at_flat if method in flat else at_wall.get(wall, at_flat)
        return (-(wall if wall is not None else math.inf), ok.get((method, at), math.inf))

    return sorted(methods, key=key)


def theory_agreement(records: list[dict], labels: dict[str, str] | None = None, *, within: float = 0.10) -> str:
    """How this run's measured peaks stood against each method's formula (``theory_bytes``; methods without
    one are left out): one sentence, naming every method whose ratio left 1 +- ``within`` at some N and its
    farthest ratio, so that a reader knows which theory-based figures (the fits table) to doubt here."""
    labels = labels or {}
    worst: dict[str, tuple[float, int]] = {}
    for r in records:
        if r["status"] == "ok" and r.get("theory_bytes"):
            ratio = r["peak_bytes"] / r["theory_bytes"]
            if r["method"] not in worst or abs(ratio - 1) > abs(worst[r["method"]][0] - 1):
                worst[r["method"]] = (ratio, r["N"])
    if not worst:
        return "No measured point had a formula to compare with."
    off = {m: w for m, w in worst.items() if abs(w[0] - 1) > within}
    if not off:
        return (f"Every formula agreed with this run's measured peaks within {within:.0%} "
                f"(farthest: {max(abs(w[0] - 1) for w in worst.values()):.1%}).")
    named = "; ".join(f"{labels.get(m, m)} {ratio:.2f}x its formula at N={N:,}" for m, (ratio, N) in off.items())
    return (f"Measured against the formulas, off by more than {within:.0%} here: {named}. Its rows below are the "
            "formula's, not what this run measured; the table of measured / theory is in the notebook.")


def results_pivot(records: list[dict], labels: dict[str, str] | None = None, *, cell: str = "memory_time",
                  failed_gate: dict[str, str] | None = None) -> str:
    """A markdown table like the article's: methods as rows (least memory first, ``memory_order``),
    tokens N as columns. ``cell``: "memory_time" (measured peak above the inputs / forward+backward
    median ms) or "theory_ratio" (measured / theory; for a method with no formula, measured / floor).
    A method in ``failed_gate`` is marked † and a note under the table says what that means."""
    if cell not in ("memory_time", "theory_ratio"):
        raise ValueError(f"cell must be 'memory_time' or 'theory_ratio', got {cell!r}")
    labels, failed_gate = labels or {}, failed_gate or {}
    unit = _records_unit(records)
    digits = 2 if unit[0] == "GB" else 3
    Ns = sorted({r["N"] for r in records})
    points = {(r["method"], r["N"]): r for r in records}
    timed = timed_calls([r.get("repeats") for r in records])
    caption = (f"Peak {unit[0]} above the inputs / forward+backward ms ({timed})" if cell == "memory_time"
               else "Measured peak / theory (no formula: measured / floor dE + dC)")
    order_n = memory_order_n(records)
    order = f" (at N={order_n:,})" if order_n is not None and len(Ns) > 1 else ""
    lines = [f"{caption}, least memory first{order}:", "", "| method | " + " | ".join(f"N={n:,}" for n in Ns) + " |",
             "|---|" + "---:|" * len(Ns)]
    for method in memory_order(records):
        cells = []
        for N in Ns:
            r = points.get((method, N))
            if r is None:
                cells.append("")
            elif r["status"] == "oom":
                cells.append("**OOM**")
            elif r["status"] != "ok":
                cells.append("error" if r["status"] == "error" else "—")
            elif cell == "memory_time":
                ms = "—" if r["median_ms"] is None else _ms(r["median_ms"])
                cells.append(f"{_in(r['peak_bytes'], unit, digits)} / {ms}")
            elif r["theory_bytes"]:
                cells.append(f"{r['peak_bytes'] / r['theory_bytes']:.3f}")
            else:
                cells.append(f"{r['peak_bytes'] / r['lower_bound_bytes']:.2f}× floor")
        mark = " †" if method in failed_gate else ""
        lines.append(f"| {labels.get(method, method)}{mark} | " + " | ".join(cells) + " |")
    if failed_gate and records:
        lines += ["", f"† fails the quick accuracy gate in {records[0]['dtype']}; swept all the same, since memory "
                  "and time do not depend on rounding."]
    return "\n".join(lines)


def describe_methods(records: list[dict], V: int, *, smoke: bool = False, baseline: str = "torch_compile") -> dict[str, str]:
    """One sentence per method: does its peak grow with N×V (the logits) or only with N·D (the
    gradients), where did it hit the wall, and how fast is it next to ``baseline``?

    Growth is the slope between the smallest and largest N measured, in bytes per token. Keeping
    the logits costs at least 2 bytes per logit (16-bit logits); 1.5 bytes per logit (1.5·V bytes
    per token) or more counts as growing with them. Below that the growth is dE and chunk buffers,
    which scale with N·D. Time: at the largest N both measured, per token and as a multiple of the
    baseline's.

    ``smoke``: a smoke run's shapes support no such verdict (at a tiny V one chunk holds every row,
    so a flat method is the N×V computation there); each sentence then says only what ran.
    """
    unit = _records_unit(records)
    base = {r["N"]: r for r in records if r["method"] == baseline and r["status"] == "ok"}
    base_label = METHODS[baseline].label if baseline in METHODS else baseline
    out = {}
    for method in dict.fromkeys(r["method"] for r in records):
        rows = sorted((r for r in records if r["method"] == method), key=lambda r: r["N"])
        ok = [r for r in rows if r["status"] == "ok"]
        oom = [r for r in rows if r["status"] == "oom"]
        errors = [r for r in rows if r["status"] == "error"]
        if smoke:
            sentence = (f"{len(ok)} points measured (N={ok[0]['N']:,} to {ok[-1]['N']:,})" if len(ok) > 1
                        else f"one point measured (N={ok[0]['N']:,})" if ok else "no point measured")
        elif len(ok) >= 2:
            first, last = ok[0], ok[-1]
            per_token = (last["peak_bytes"] - first["peak_bytes"]) / (last["N"] - first["N"])
            shape = (
                f"grows with the logits N·V: {per_token / V:.1f} bytes per logit ({per_token / 1e3:,.1f} kB per token)"
                if per_token >= 1.5 * V
                else f"grows with N·D (the gradients), not N·V (the logits): {per_token / 1e3:,.2f} kB per token"
            )
            span = f"{_in(first['peak_bytes'], unit, 2)} → {_in(last['peak_bytes'], unit, 2)} {unit[0]}"
            sentence = f"{shape}; {span} from N={first['N']:,} to {last['N']:,}"
        elif ok:
            sentence = f"one point measured: {_in(ok[0]['peak_bytes'], unit, 2)} {unit[0]} at N={ok[0]['N']:,}"
        else:
            sentence = "no point measured"
        if oom:
            skipped = any(r["status"] == "skipped after OOM" for r in rows)
            sentence += (f"; out of memory at N={oom[0]['N']:,} (the simulated cap)" if smoke
                         else f"; hit the wall at N={oom[0]['N']:,} (out of memory)")
            sentence += ", larger N skipped" if skipped else ""
        elif ok and not smoke:
            sentence += f"; no OOM up to N={ok[-1]['N']:,}"
        timed = [r for r in ok if r["N"] in base and r["median_ms"] is not None]
        if timed and not smoke:
            r = timed[-1]
            sentence += (f"; {_ms(r['median_ms'])} ms at N={r['N']:,} "
                         f"({r['median_ms'] * 1e3 / r['N']:.3g} µs per token")
            ratio = r["median_ms"] / base[r["N"]]["median_ms"]
            sentence += ")" if method == baseline else f", {ratio:.2f}× {base_label})"
        if errors:
            where = ", ".join(f"{r['N']:,}" for r in errors)
            sentence += f"; ERROR at N={where}: {errors[0]['error']}"
        out[method] = sentence + "."
    return out


def _point(records: list[dict] | None, method: str, N: int) -> dict | None:
    return next((r for r in records or [] if r["method"] == method and r["N"] == N), None)


def headline(records: list[dict], *, labels: dict[str, str] | None = None, N: int = ARTICLE_MICRO_BATCH_N,
             t4_records: list[dict] | None = None, smoke: bool = False) -> str:
    """The sweep in one line, for the report's table of notebooks: the lowest and highest peak at
    ``N`` (the largest N measured when the sweep has no ``N``), who ran out of memory, and where each
    method hits a T4's wall (``t4_records``: the pretend-T4 sweep, or this sweep on a T4). A smoke
    run's line says only what ran."""
    labels = labels or {}
    name = lambda m: labels.get(m, m)  # noqa: E731
    walls = {}
    for m in dict.fromkeys(r["method"] for r in records):
        wall = _first_oom_n([r for r in records if r["method"] == m])
        if wall is not None:
            walls[m] = wall
    ok = [r for r in records if r["status"] == "ok"]
    if smoke:
        line = (f"the pipeline ran: {len(ok)} points of {len({r['method'] for r in records})} methods measured, "
                f"{len(walls)} out of memory at the simulated cap")
        line += f" ({', '.join(f'{name(m)} at N={n:,}' for m, n in walls.items())})" if walls else ""
        return line + (f"; the T4 pass measured {sum(r['status'] == 'ok' for r in t4_records)} points"
                       if t4_records else "")
    if not ok:
        return "no point was measured"
    at = N if any(r["N"] == N for r in ok) else max(r["N"] for r in ok)
    here = sorted((r for r in ok if r["N"] == at), key=lambda r: r["peak_bytes"])
    low, high = here[0], here[-1]
    line = (f"At N={at:,} on {low['device']} ({low['dtype']}) the loss step's peak ranges from "
            f"{format_bytes(low['peak_bytes'])} ({name(low['method'])}) to {format_bytes(high['peak_bytes'])} "
            f"({name(high['method'])})")
    out = [m for m, n in walls.items() if n <= at]
    if out:
        line += f"; {', '.join(name(m) for m in out)} ran out of memory by then"
    if t4_records:
        t4_walls = {m: _first_oom_n([r for r in t4_records if r["method"] == m])
                    for m in dict.fromkeys(r["method"] for r in t4_records)}
        t4_walls = {m: n for m, n in sorted(t4_walls.items(), key=lambda item: item[1] or 0) if n is not None}
        as_t4 = f"; as a T4 ({t4_records[0]['dtype']}) "
        if t4_walls:
            line += as_t4 + " and ".join(f"{name(m)} runs out of memory from N={n:,}" for m, n in t4_walls.items())
        else:
            line += as_t4 + f"every method fits up to N={max(r['N'] for r in t4_records):,}"
    return line + "."


def report_facts(records: list[dict], *, N: int = ARTICLE_MICRO_BATCH_N, t4_records: list[dict] | None = None,
                 t4_plan: MethodPlan | None = None) -> dict[str, dict]:
    """Per method, what the report's opening table reads (``helpers.suite.report.FACT_KEYS``):
    ``sweep``, every point measured on this card (peak, time, status per N); from the T4's
    sweep (``t4_records``, ``t4_plan``: the pretend-T4 sweep, or this sweep on a T4)
    ``t4_peak_bytes_16k`` and ``runs_on_t4``: True when it ran at ``N`` and passed the gate there,
    else why not. A key with nothing measured behind it is left out. Not for a smoke run: its N
    and shapes say nothing about these."""
    facts: dict[str, dict] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        points = {}
        for r in (r for r in records if r["method"] == method):
            ok = r["status"] == "ok"
            points[str(r["N"])] = {"status": r["status"], "peak_bytes": int(r["peak_bytes"]) if ok else None,
                                   "seconds": round(r["median_ms"] / 1e3, 6) if ok and r.get("median_ms") else None}
        if points:
            dtype = next(r["dtype"] for r in records if r["method"] == method)
            facts.setdefault(method, {})["sweep"] = {"dtype": dtype, "points": points}
    if t4_plan is None:
        return facts
    for method, why in t4_plan.unavailable.items():
        facts.setdefault(method, {})["runs_on_t4"] = f"cannot run on a T4: {why}"
    for method in t4_plan.swept:
        r = _point(t4_records, method, N)
        if r is None:
            continue
        fact = facts.setdefault(method, {})
        if r["status"] == "ok":
            fact["t4_peak_bytes_16k"] = int(r["peak_bytes"])
            failed = t4_plan.failed_gate.get(method)
            fact["runs_on_t4"] = True if failed is None else f"runs, but fails the {r['dtype']} accuracy gate: {failed}"
        elif r["status"] in ("oom", "skipped after OOM"):
            wall = _first_oom_n([p for p in t4_records if p["method"] == method])
            fact["runs_on_t4"] = f"out of memory on a T4 from N={wall:,}" if wall else "out of memory on a T4"
        else:
            fact["runs_on_t4"] = f"error on a T4's path at N={N:,}: {r['error']}"
    return facts


def write_results(records: list[dict], output_dir: str | Path, stem: str, meta: dict) -> tuple[Path, Path]:
    """``<stem>.csv`` (one row per point) and ``<stem>.json`` (``meta`` and the points)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = output_dir / f"{stem}.csv", output_dir / f"{stem}.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else ["method"])
        writer.writeheader()
        writer.writerows(records)
    json_path.write_text(json.dumps({"meta": meta, "points": records}, indent=1, default=str))
    return csv_path, json_path


__all__ = [
    "describe_methods",
    "headline",
    "memory_order",
    "memory_order_n",
    "memory_unit",
    "report_facts",
    "results_pivot",
    "theory_agreement",
    "write_results",
]
