"""How the loss scales with tokens: a bench results file read as a table and a figure.

``python -m helpers bench --shapes qwen3-0.6b --N 1024 ... 131072`` times each method's forward and
backward at each N (``helpers.compare.bench``); ``python -m helpers scale-report BENCH.jsonl
--output-dir DIR`` reads that file back and writes, for one head, regime and dtype:

- ``scale.md``: per N (rows), every method's forward+backward time (median), the four-product floor,
  and ours' rate against it;
- ``scale.png``: time against N, log-log, one line per method and the floor; beside it, ours'
  fraction of the floor against N (``helpers.lab.plots.plot_scale``).

The four-product floor. Cut cross-entropy multiplies N×D by D×V four times: the forward's logits
E Cᵀ, their recomputation in the backward, dE = G C and dC = Gᵀ E, 2·N·V·D FLOP each. At the matmul
rate the bench measured in the same process (``matmul_tflops`` in the meta record; a file written
before it was stored gives it back through its points' ``fraction_of_matmul_peak``) those products
alone take

    floor_ms = 4 · 2·N·V·D / (rate · 10^12) · 10^3

and ours' fraction of the floor is floor_ms / its measured time: 100% would be four cuBLAS-speed
products and nothing else (no softmax, no G, no launches); over 100%, fewer products were done
(the sparse backward skips the tiles the forward marked empty). Ours' TFLOP/s counts the same four
products (8·N·V·D / time), so the fraction is also that rate over the matmul rate. The bench's own
``tflops`` counts three (6·N·V·D, the least any exact method needs), which is why the two differ.
On a pretend card (``helpers.cce.device``) the times and the rate are the GPU's that ran them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from helpers.cce.device import CARDS
from helpers.compare.heads import HEADS, QWEN3
from helpers.compare.methods import METHODS, method_label
from helpers.compare.results_file import read_results

PRODUCTS = 4  # E Cᵀ, its recomputation, G C, Gᵀ E: the N×V×D products of a cut cross-entropy
STATUS_WORDS = {"oom": "out of memory", "error": "error", "failed gate": "failed gate", "unavailable": "unavailable"}


def four_product_floor_ms(N: int, V: int, D: int, matmul_tflops: float) -> float:
    """Milliseconds the four N×V×D products (2·N·V·D FLOP each) take at ``matmul_tflops``."""
    return PRODUCTS * 2 * N * V * D / (matmul_tflops * 1e12) * 1e3


def is_ours(method: str) -> bool:
    """Our loss and its presets (the registry's kind "ours"): the methods held to the floor."""
    return method in METHODS and METHODS[method].kind == "ours"


@dataclass
class ScaleSlice:
    """One head, regime and dtype of a bench results file: its points by (method, N), and what the
    floor needs (the matmul rate, and where it came from)."""

    shape: str
    V: int
    D: int
    regime: str
    dtype: str
    device: dict
    matmul_tflops: float | None
    rate_source: str  # how the rate was found, said in words
    methods: list[str]  # in the file's order
    Ns: list[int]
    points: dict[tuple[str, int], dict] = field(default_factory=dict)
    source: str = ""

    @property
    def label(self) -> str:
        return HEADS[self.shape].label if self.shape in HEADS else self.shape

    @property
    def smoke(self) -> bool:
        """Measured on a CPU: the interpreter's times say nothing about a GPU."""
        return self.device.get("kind") != "cuda"

    @property
    def ours(self) -> list[str]:
        return [m for m in self.methods if is_ours(m)]

    def ok(self, method: str, N: int) -> dict | None:
        """The point if it was timed, else None."""
        point = self.points.get((method, N))
        return point if point and point.get("status") == "ok" and point.get("fwd_bwd_ms") else None

    def failed_gate(self, method: str, N: int) -> bool:
        """Timed although the method failed the accuracy gate (``--time-failed``)."""
        point = self.ok(method, N)
        return bool(point) and point.get("gate", "pass") not in ("pass", "")

    def floor_ms(self, N: int) -> float | None:
        return four_product_floor_ms(N, self.V, self.D, self.matmul_tflops) if self.matmul_tflops else None

    def rate_tflops(self, method: str, N: int) -> float | None:
        """The four products' FLOP over the method's measured time, in TFLOP/s."""
        point = self.ok(method, N)
        return PRODUCTS * 2 * N * self.V * self.D / (point["fwd_bwd_ms"] * 1e-3) / 1e12 if point else None

    def fraction_of_floor(self, method: str, N: int) -> float | None:
        point, floor = self.ok(method, N), self.floor_ms(N)
        return floor / point["fwd_bwd_ms"] if point and floor else None


def read_scale(path: str | Path, shape: str = QWEN3.name, regime: str | None = None, dtype: str | None = None,
               matmul_tflops: float | None = None) -> ScaleSlice:
    """The ``ScaleSlice`` of the bench results file ``path`` for ``shape``; ``regime`` and ``dtype``
    default to those of the shape's first point. ``matmul_tflops`` replaces the rate on record (a
    file from before the rate was stored, whose points carry no fraction either). A slice the file
    does not hold raises, naming what it holds."""
    meta, results = read_results(path)
    rows = [r for r in results if r.get("shape") == shape and "fwd_bwd_ms" in r]
    if not rows:
        shapes = sorted({r.get("shape") for r in results if r.get("shape")})
        raise ValueError(f"{path} holds no bench point of shape {shape!r}; it holds {shapes or 'none'}")
    regime = regime or rows[0]["regime"]
    dtype = dtype or rows[0]["dtype"]
    picked = [r for r in rows if r["regime"] == regime and r["dtype"] == dtype]
    if not picked:
        held = sorted({(r["regime"], r["dtype"]) for r in rows})
        raise ValueError(f"{path} holds no {shape} point in regime {regime!r} and dtype {dtype!r}; it holds {held}")
    rate, source = _matmul_rate(meta, picked, dtype, matmul_tflops)
    return ScaleSlice(
        shape=shape, V=picked[0]["V"], D=picked[0]["D"], regime=regime, dtype=dtype, device=meta.get("device", {}),
        matmul_tflops=rate, rate_source=source, methods=list(dict.fromkeys(r["method"] for r in picked)),
        Ns=sorted({int(r["N"]) for r in picked}), points={(r["method"], int(r["N"])): r for r in picked},
        source=str(path),
    )


def _matmul_rate(meta: dict, points: list[dict], dtype: str, given: float | None) -> tuple[float | None, str]:
    if given:
        return given, "given on the command line"
    on_record = (meta.get("matmul_tflops") or {}).get(dtype)
    if on_record:
        return on_record, "measured by the bench in the same process"
    derived = [p["tflops"] / p["fraction_of_matmul_peak"] for p in points
               if p.get("tflops") and p.get("fraction_of_matmul_peak")]
    if derived:
        return derived[0], "measured by the bench in the same process, read back from its points"
    return None, "not measured (a CPU run, or a file without it): no floor"


def _ms(ms: float) -> str:
    return f"{ms:,.2f}" if ms < 10 else f"{ms:,.1f}" if ms < 1000 else f"{ms:,.0f}"


def scale_table(s: ScaleSlice) -> str:
    """The markdown of ``scale.md``: a heading, what was measured where, the table, notes, and a
    reading of the largest N."""
    gpu = s.device.get("description") or s.device.get("name") or "an unknown device"
    rate = f"{s.matmul_tflops:,.0f} TFLOP/s, {s.rate_source}" if s.matmul_tflops else s.rate_source
    lines = [
        f"# Scale: the {s.label} head (V = {s.V:,}, D = {s.D:,}), {s.dtype}, {s.regime} inputs",
        "",
        f"Forward and backward of the loss, median time in ms, on {gpu}; from `{Path(s.source).name}`. "
        f"The four-product floor: the 4 N×V×D products of a cut cross-entropy (2·N·V·D FLOP each) at this "
        f"GPU's {s.dtype} matmul rate ({rate}); ours' TFLOP/s counts the same products.",
        "",
    ]
    if s.smoke:
        lines += ["> Measured on a CPU (the Triton interpreter): these times say nothing about a GPU.", ""]
    card = CARDS.get(s.device.get("pretend") or "")
    if card:
        lines += [f"> Run as a pretend {card.label}: {card.a_label}'s memory, shared memory and kernel "
                  f"configurations; the times and the matmul rate are the GPU's that ran them.", ""]
    heads = [f"{method_label(m)} ms" for m in s.methods]
    if s.matmul_tflops:
        heads.append("floor ms")
        for m in s.ours:
            heads += [f"{method_label(m)} TFLOP/s", f"{method_label(m)}: floor / time"]
    lines += ["| N | " + " | ".join(heads) + " |", "|---:|" + "---:|" * len(heads)]
    notes: dict[str, str] = {}
    timed_failing = False
    for N in s.Ns:
        cells = [f"{N:,}"]
        for m in s.methods:
            point = s.points.get((m, N))
            if point is None:
                cells.append("")
            elif s.ok(m, N):
                failed = s.failed_gate(m, N)
                timed_failing |= failed
                cells.append(_ms(point["fwd_bwd_ms"]) + (" †" if failed else ""))
            else:
                cells.append(STATUS_WORDS.get(point.get("status"), point.get("status") or "?"))
                if point.get("note"):
                    notes.setdefault(f"{method_label(m)}, {cells[-1]}", point["note"].splitlines()[0][:160])
        if s.matmul_tflops:
            cells.append(_ms(s.floor_ms(N)))
            for m in s.ours:
                rate_m, fraction = s.rate_tflops(m, N), s.fraction_of_floor(m, N)
                cells += [f"{rate_m:,.0f}" if rate_m else "", f"{fraction:.0%}" if fraction else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if s.matmul_tflops and s.ours:
        lines.append("floor / time: the share of the floor's speed reached; over 100% a method did less than four "
                     "full products (a filter or a sparse backward skips tiles).  ")
    if timed_failing:
        lines.append("† failed the accuracy gate (`helpers.compare.gate`), timed anyway (`--time-failed`).  ")
    lines += [f"- {what}: {note}" for what, note in notes.items()]
    lines += [""] + _reading(s)
    return "\n".join(lines).rstrip() + "\n"


def _reading(s: ScaleSlice) -> list[str]:
    """At the largest N ours ran: its time, its share of the floor, and each peer against it."""
    ours = s.ours[0] if s.ours else None
    timed = [N for N in s.Ns if ours and s.ok(ours, N)]
    if not timed:
        return ["Ours has no timed point in this slice: nothing to read against it."]
    N = timed[-1]
    t = s.ok(ours, N)["fwd_bwd_ms"]
    fraction = s.fraction_of_floor(ours, N)
    line = f"At N = {N:,}, {method_label(ours)} takes {_ms(t)} ms" + (
        f", {fraction:.0%} of the four-product floor's speed ({_ms(s.floor_ms(N))} ms)." if fraction else ".")
    peers = []
    for m in s.methods:
        if m == ours or is_ours(m):
            continue
        point = s.ok(m, N)
        peers.append(f"{method_label(m)} {point['fwd_bwd_ms'] / t:.2f}× ours' time" if point else
                     f"{method_label(m)} {STATUS_WORDS.get(s.points.get((m, N), {}).get('status'), 'not measured')}")
    return [line + (" There: " + "; ".join(peers) + "." if peers else "")]


def write_scale_report(path: str | Path, output_dir: str | Path, shape: str = QWEN3.name, regime: str | None = None,
                       dtype: str | None = None, matmul_tflops: float | None = None) -> tuple[Path, Path]:
    """Write ``scale.md`` and ``scale.png`` into ``output_dir`` from the bench file ``path``
    (``read_scale`` picks the slice); returns their paths."""
    from helpers.lab.plots import plot_scale  # matplotlib only where a figure is drawn

    s = read_scale(path, shape, regime, dtype, matmul_tflops)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "scale.md"
    table.write_text(scale_table(s))
    figure = out / "scale.png"
    plot_scale(s, path=figure)
    return table, figure


__all__ = [
    "PRODUCTS",
    "ScaleSlice",
    "four_product_floor_ms",
    "is_ours",
    "read_scale",
    "scale_table",
    "write_scale_report",
]
