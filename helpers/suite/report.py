"""One document for a whole batch run: ``results/REPORT.md`` and ``results/REPORT.html``.

By convention each notebook writes ``report.md`` into its ``output_dir``: a Markdown fragment with
its headline tables and images, linked relative to its own folder (``write_report_fragment`` does
it in one line). ``build_report(results_dir)`` puts them together in notebook order, with the
image and link paths rewritten to the results folder, and adds what a reader needs around them:

- the hardware and versions the run used (``summary.json``, written by ``helpers.suite.runner``);
- an opening table, "which loss to use": per method, what the notebooks measured (their
  ``facts.json``, written by ``write_report_fragment``), and the "use X when" sentences it supports;
- a table of every notebook: status, time, its one-line headline;
- what did not run and why: failed notebooks with their error, notebooks that ran but wrote no
  ``report.md`` (their files are listed instead), notebooks of the suite not in this run.

The HTML is the same document, rendered with markdown-it-py (a dependency of jupytext, so present
wherever the suite is) or, failing that, the ``markdown`` package or a small converter here; the
PNGs are embedded, so REPORT.html is one file that can be sent on its own.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import mimetypes
import re
from pathlib import Path

from helpers.compare.units import format_bytes
from helpers.suite.paths import find_notebooks

REPORT_FRAGMENT = "report.md"
FACTS = "facts.json"
SUMMARY = "summary.json"

# What a notebook may tell the report's opening table about a method (``facts``); every key is
# optional, and a method's row says nothing for what no notebook gave. Verdicts in them are the
# engine's (``helpers.compare.verdicts``), which also reads them to recommend.
FACT_KEYS = {
    "gradients": "{dtype name: 'pass' or 'fail'}: the accuracy gate's verdict against float64 (01)",
    "gradient_failures": "{dtype name: {'cases': how many ran, 'failed': [the failing cases], 'not_finite': whether "
                         "every failure is a gradient that is not finite}} where the gate fails (01)",
    "sweep": "{'dtype', 'points': {N: {'peak_bytes', 'seconds', 'status'}}}: one loss step (forward and backward) "
             "on this GPU at each token count swept (02)",
    "t4_peak_bytes_16k": "the same step's peak at 16,384 tokens under a T4's limits (a T4, or the pretend-T4 sweep) (02)",
    "runs_on_t4": "True, or why not (a string) (02, 05)",
    "largest_step_tokens_16gb": "the largest micro-batch of a whole Qwen3-0.6B training step that fits a 16 GB "
                                "card, in tokens (05; under naive: transformers' default loss)",
    "largest_step_at_search_limit": "True where that search stopped at its limit without running out of memory: "
                                    "the largest micro-batch is at least that (05)",
    "whole_step": "{'tokens', 'precision', 'peak_bytes', 'tokens_per_s'}: one whole training step at the seed "
                  "article's micro-batch (05)",
    "convergence": "{dtype name: {'verdict', 'parts'}}: the engine's training verdict against exact (03)",
    "caveats": "[str]: what a user must know (any notebook); the REPORT footnotes any over 150 characters",
    "budgets": "{registry key of a budget preset: {'dtype', 'gate': 'pass' or 'fail', 'points': {N: {'peak_bytes', "
               "'seconds', 'status'}}}}: ours under memory budgets, beside its own sweep (02's trade-off; ours only)",
}
CAVEAT_CELL_CHARACTERS = 150

def write_report_fragment(output_dir: str | Path, markdown: str, *, headline: str | None = None,
                          facts: dict[str, dict] | None = None, smoke: bool = False) -> Path:
    """Write a notebook's ``report.md`` (images linked relative to ``output_dir``) and, beside it,
    ``facts.json``: its one-line ``headline`` for the report's table of notebooks and ``facts``,
    {method: {key: value}} with keys from ``FACT_KEYS``, for the report's opening table.
    ``smoke``: a CPU smoke run; the fragment and the headline say it supports no conclusion."""
    from helpers.lab.profiles import SMOKE_NOTE

    unknown = {key for per_method in (facts or {}).values() for key in per_method} - set(FACT_KEYS)
    if unknown:
        raise ValueError(f"facts: unknown keys {sorted(unknown)}; the report reads {sorted(FACT_KEYS)}")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if smoke:
        markdown = f"> **{SMOKE_NOTE}**\n\n{markdown.strip()}"
        headline = f"smoke run: {headline}" if headline else None
    (out / FACTS).write_text(json.dumps({"headline": headline, "smoke": smoke, "methods": facts or {}}, indent=1))
    path = out / REPORT_FRAGMENT
    path.write_text(markdown.strip() + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# The opening table: which loss to use
# ---------------------------------------------------------------------------------------------


def load_facts(results: Path, runs: list[dict], stamp: dict | None = None,
               suite: list[str] = ()) -> tuple[dict[str, dict], dict[str, str], bool, list[str], list[str]]:
    """({method: merged facts}, {notebook: headline}, whether any notebook was a smoke run, the
    notebooks whose facts were read, and notes on facts taken from an earlier run) from the
    ``facts.json`` of the notebooks of ``runs``. A notebook of ``suite`` not in this run is read
    too where its facts carry this run's ``stamp`` (device, profile and versions): an earlier run
    into the same folder on the same setup. A later notebook's value of a key wins, except that no
    "runs on a T4" outweighs a reason it cannot."""
    methods: dict[str, dict] = {}
    headlines: dict[str, str] = {}
    smoke = False
    read, earlier = [], []
    in_run = {r["notebook"] for r in runs}
    candidates = [r["notebook"] for r in runs] + [n for n in suite if n not in in_run]
    for notebook in sorted(candidates):
        path = results / notebook / FACTS
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if notebook not in in_run:
            theirs = {k: v for k, v in (data.get("stamp") or {}).items() if k != "finished"}
            if not stamp or theirs != {k: v for k, v in stamp.items() if k != "finished"}:
                continue
            earlier.append(f"`{notebook}`'s results are from an earlier run into this folder "
                           f"({data['stamp'].get('finished', 'time unknown')}) on the same device, profile and versions.")
        read.append(notebook)
        smoke |= bool(data.get("smoke"))
        if data.get("headline"):
            headlines[notebook] = data["headline"]
        for method, facts in data.get("methods", {}).items():
            merged = methods.setdefault(method, {})
            for key, value in facts.items():
                if key == "caveats":
                    merged.setdefault("caveats", [])
                    merged["caveats"] += [c for c in value if c not in merged["caveats"]]
                elif key == "runs_on_t4" and isinstance(merged.get(key), str) and value is True:
                    pass  # one notebook's reason it cannot (out of memory at 16k, say) outweighs another's "ran"
                elif key == "convergence":
                    merged.setdefault(key, {}).update(value)
                else:
                    merged[key] = value
    return methods, headlines, smoke, read, earlier


def _fmt_gb(n) -> str:
    if isinstance(n, str):
        return "out of memory" if n == "oom" else n
    return "not measured" if n is None else format_bytes(n)


def _at_16k(f: dict, key: str):
    """A method's sweep point at 16,384 tokens: the number, "oom" for its peak where it ran out of
    memory (or was skipped after doing so at a smaller N), the status where it failed otherwise."""
    point = ((f.get("sweep") or {}).get("points") or {}).get(str(16_384)) or {}
    status = point.get("status")
    if status in (None, "ok"):
        return point.get(key)
    if key != "peak_bytes":
        return None
    return "oom" if "oom" in status.lower() else status


def caveat_cell(caveats: list[str], footnotes: list[str]) -> str:
    """The caveats of one row, at most ``CAVEAT_CELL_CHARACTERS`` long: those that fit inline, the
    rest as numbered footnotes (appended to ``footnotes``)."""
    inline, refs = [], []
    for c in caveats:
        if len("; ".join(inline + [c])) + 6 * (len(refs) + 1) <= CAVEAT_CELL_CHARACTERS and len(c) <= 80:
            inline.append(c)
        else:
            footnotes.append(c)
            refs.append(f"[{len(footnotes)}]")
    return "; ".join(inline + ([" ".join(refs)] if refs else []))


def recommendation(methods: dict[str, dict], smoke: bool = False, ran: list[str] = (), t4: bool = False,
                   figure: str | None = None, pretend: str | bool | None = None) -> list[str]:
    """The report's opening: one row per method with what the notebooks measured and the engine's
    verdicts, then the "use X when" sentences (``helpers.compare.verdicts.recommend``) that the
    notebooks that ran (``ran``) support. ``pretend``: the key of the card the run pretended to be
    (``helpers.cce.device.CARDS``; True: a T4, as the runs before the other cards said)."""
    from helpers.compare import verdicts
    from helpers.compare.methods import method_label

    lines = ["## Which loss to use", ""]
    if smoke:
        lines += [f"> **{_smoke_note()}** The table and sentences below show the pipeline works; they "
                  "are not a recommendation.", ""]
    methods = {m: f for m, f in methods.items() if f}
    if not methods:
        return lines + ["This run measured nothing this table reads: run notebooks 01, 02, 03 and 05 (on a GPU) "
                        "to fill it.", ""]
    def by_peak(m):  # measured peaks first, least first; then an out-of-memory or no point at all
        peak = _at_16k(methods[m], "peak_bytes")
        return (not isinstance(peak, int), peak if isinstance(peak, int) else 0, m)

    order = sorted((m for m in methods if any(c[4](methods[m]) is not None for c in _COLUMNS)), key=by_peak)  # no empty rows
    # In a T4's run the loss step's own peak is a T4's: the "as a T4" column would repeat it.
    columns = [c for c in _COLUMNS if any(c[4](methods[m]) is not None for m in order) and not (t4 and c[2] == "t4")]
    if pretend:
        columns = [(f"{c[0]}, this GPU's speed" if c[2] == "time" else c[0], *c[1:]) for c in columns]
    footnotes: list[str] = []
    lines += ["| method | " + " | ".join(c[0] for c in columns) + " |",
              "|---|" + "".join(f"{c[1]}|" for c in columns)]
    for m in order:
        f = methods[m]
        cells = [method_label(m)]
        for _, _, key, cell, get in columns:
            value = get(f)
            if value is None:
                cells.append("")
            elif key == "caveats":
                cells.append(caveat_cell(value, footnotes))
            elif key == "runs_on_t4" and isinstance(value, str) and len(value) > 60:
                footnotes.append(f"{method_label(m)} on a T4: {value}")
                cells.append(f"no [{len(footnotes)}]")
            else:
                cells.append(cell(value))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [""] + [f"[{i}] {note}" + "  " for i, note in enumerate(footnotes, 1)]
    if footnotes:
        lines.append("")
    if pretend:
        lines += [f"- {_pretend_speed_note('t4' if pretend is True else pretend)}"]
    lines += [f"- {s}" for s in verdicts.recommend(methods, list(ran), t4=t4)] + [""]
    if figure:
        lines += [f"![Time against peak memory, each point marked with its verdicts]({figure})", ""]
    return lines


def _pretend_speed_note(key: str) -> str:
    """What a pretend card's times are: the GPU's that ran them, not the card's."""
    from helpers.cce.device import card_spec

    card = card_spec(key)
    if key == "t4":
        speed = ("a T4 multiplies fp16 about twelve times slower than an H200; and in Triton kernels a T4 multiplies "
                 "on its CUDA cores, not its tensor cores, which ours reproduce here (this GPU's fp32 rate against "
                 "its tensor cores' overstates that cost about twice), so ours has cuBLAS make its logits there")
    else:
        speed = f"{card.a_label}'s datasheet gives {card.dense_16bit_tflops:.0f} TFLOP/s of dense 16-bit matmul"
    return (f"Times are this GPU's: a pretend {card.label} has {card.a_label}'s memory, shared memory and code "
            f"paths, not its speed ({speed}).")


def _whole_step(w: dict) -> str:
    if not w.get("peak_bytes"):
        return "out of memory"
    return f"{format_bytes(w['peak_bytes'])}, {w['tokens_per_s']:,.0f} tok/s"


def _largest_step(f: dict) -> str | None:
    from helpers.compare.verdicts import largest_step_text

    return largest_step_text(f) if "largest_step_tokens_16gb" in f else None


# (heading, alignment, key, cell, how to read the value from a method's facts)
_COLUMNS = [
    ("peak at 16k tokens", "---:", "peak", _fmt_gb, lambda f: _at_16k(f, "peak_bytes")),
    ("time at 16k", "---:", "time", lambda s: s if isinstance(s, str) else f"{s * 1e3:,.0f} ms",
     lambda f: _at_16k(f, "seconds")),
    ("peak at 16k as a T4", "---:", "t4", _fmt_gb, lambda f: f.get("t4_peak_bytes_16k")),
    ("runs on a T4", "---", "runs_on_t4", lambda t: "yes" if t is True else f"no: {t}", lambda f: f.get("runs_on_t4")),
    ("whole step at 16k", "---:", "whole_step", _whole_step, lambda f: f.get("whole_step")),
    ("whole step on 16 GB", "---:", "largest", str, _largest_step),
    ("gradients vs float64", "---", "gradients", lambda g: ", ".join(f"{d} {v}" for d, v in g.items()),
     lambda f: f.get("gradients")),
    ("trains like exact", "---", "convergence", lambda c: _convergence_cell(c), lambda f: f.get("convergence")),
    ("caveats", "---", "caveats", None, lambda f: f.get("caveats") or None),
]


def _convergence_cell(c: dict) -> str:
    from helpers.compare.verdicts import convergence_cell

    return convergence_cell(c)


def _smoke_note() -> str:
    from helpers.lab.profiles import SMOKE_NOTE

    return SMOKE_NOTE


GLOSSARY = [
    ("the seed article", "\"Killing the 10 GB Tensor\", the write-up this workbench grew from: a Qwen3-0.6B trainer "
     "on a free Kaggle T4 whose 16k-token loss built a 9.96 GB fp32 logit tensor"),
    ("exact", "the loss from fp32 logits of the same low-precision inputs: the yardstick of training"),
    ("naive", "the loss a trainer writes: logits in the input dtype, then upcast"),
    ("gate", "notebook 01's check of loss, dE and dC against float64, bound max(floor, 2x naive's error)"),
    ("LB (lower bound)", "the bytes of the two gradients any method must return, dE (N x D) and dC (V x D)"),
    ("tile", "a block of the N x V logit matrix that a kernel computes at once; the filter skips whole tiles"),
    ("G", "the gradient of the loss with respect to a block of logits, softmax minus the one-hot target, over N"),
    ("G chunk", "the block of G a backward holds at once (some columns of the vocabulary for every row)"),
    ("the filter", "skipping tiles of G whose entries are too small to change the gradients (the CCE paper's)"),
    ("margin", "the practical difference a verdict is judged against: its rule is fixed before the run; the "
     "pretraining margin's value comes from the run (half of exact's own seed-to-seed spread, at least a floor: 03)"),
]


def glossary_section() -> list[str]:
    return ["## Terms", ""] + [f"- **{term}**: {meaning}." for term, meaning in GLOSSARY] + [""]


# ---------------------------------------------------------------------------------------------
# Putting the fragments together
# ---------------------------------------------------------------------------------------------


def _load_summary(results: Path) -> dict | None:
    path = results / SUMMARY
    return json.loads(path.read_text()) if path.is_file() else None


def _runs(results: Path, summary: dict | None) -> list[dict]:
    """The notebooks of this run, in order: from summary.json, else from the NN_* folders found."""
    if summary is not None:
        return summary["runs"]
    return [{"notebook": d.name, "status": "unknown", "seconds": None, "error": "",
             "files": sorted(str(p.relative_to(results)) for p in d.rglob("*") if p.is_file())}
            for d in sorted(results.glob("[0-9][0-9]_*")) if d.is_dir()]


def _suite_notebooks() -> list[str]:
    try:
        return [p.stem for p in find_notebooks()]
    except SystemExit:  # a package installed without the repository's notebooks/
        return []


_FENCE = re.compile(r"^\s*(```|~~~)")
_MD_TARGET = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_HTML_TARGET = re.compile(r"""((?:src|href)=["'])([^"']+)(["'])""")


def _is_relative(target: str) -> bool:
    return not re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|/|#)", target)


def rebase_fragment(markdown: str, folder: str, top_level: int = 3) -> str:
    """A notebook's fragment, made to sit in the report: relative image and link targets get
    ``folder/`` in front, and headings shift so that the fragment's highest becomes ``top_level``.
    Code blocks are left as they are."""
    levels = [len(m.group(1)) for m in re.finditer(r"^(#{1,6})\s", _outside_code(markdown), re.MULTILINE)]
    shift = top_level - min(levels) if levels else 0
    out, in_code = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            heading = re.match(r"^(#{1,6})(\s.*)$", line)
            if heading:
                line = "#" * max(1, min(6, len(heading.group(1)) + shift)) + heading.group(2)
            line = _MD_TARGET.sub(lambda m: m.group(1) + _rebase(m.group(2), folder) + m.group(3), line)
            line = _HTML_TARGET.sub(lambda m: m.group(1) + _rebase(m.group(2), folder) + m.group(3), line)
        out.append(line)
    return "\n".join(out)


def _rebase(target: str, folder: str) -> str:
    if not _is_relative(target):
        return target
    return f"{folder}/{target[2:] if target.startswith('./') else target}"


def _outside_code(markdown: str) -> str:
    kept, in_code = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            kept.append(line)
    return "\n".join(kept)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _seconds(run: dict) -> str:
    return "" if run.get("seconds") is None else f"{run['seconds']:.1f} s"


def _hardware_section(summary: dict | None) -> list[str]:
    lines = ["## Hardware and versions", ""]
    if summary is None:
        return lines + [f"No `{SUMMARY}` in this folder: the hardware and versions are unknown.", ""]
    device = summary.get("device", {})
    lines.append(f"- **device**: {device.get('description', device.get('name', 'unknown'))}")
    if device.get("kind") == "cuda":
        cap = device.get("capability") or [0, 0]
        bf16 = "yes" if tuple(cap) >= (8, 0) else "no (before Ampere: bf16 is not measured here)"
        lines.append(f"- **compute capability**: sm_{cap[0]}{cap[1]}; bf16 tensor cores: {bf16}")
        if device.get("shared_memory_per_block_bytes"):
            lines.append(f"- **shared memory per block**: {device['shared_memory_per_block_bytes'] // 1024} KiB")
    card = pretended(summary)
    if card:
        from helpers.cce.device import card_spec
        from helpers.cce.kernels.configs import tier_for_card

        spec = card_spec(card)
        real = device.get("real_capability")
        on = f" on a sm_{real[0]}{real[1]} GPU" if real else ""
        lines.append(f"- **pretended card**: {spec.label}{on}: its memory, shared memory per block, compute capability "
                     f"and configuration tier (`{tier_for_card(spec).name}`), not its speed")
    lines.append(f"- **profile**: `{summary.get('profile', '?')}`")
    versions = {"python": summary.get("python"), "torch": summary.get("torch"), **summary.get("versions", {})}
    lines.append("- **versions**: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    return lines + [""]


def pretended(summary: dict | None) -> str | None:
    """The key of the card the run pretended to be (``helpers.cce.device.CARDS``), or None; a summary
    written before the other cards says only ``"pretend_t4": true``."""
    device = (summary or {}).get("device", {})
    return device.get("pretend") or ("t4" if device.get("pretend_t4") else None)


def is_t4_run(summary: dict | None) -> bool:
    """Whether the run is a T4's: a real T4 (sm_75), a pretend one, or the T4 profiles. A pretend
    A100 or L4 is not: it runs the gpu profile, in bf16."""
    device = (summary or {}).get("device", {})
    return bool(pretended(summary) == "t4" or tuple(device.get("capability") or ()) == (7, 5)
                or str((summary or {}).get("profile", "")).startswith(("t4", "cpu-t4")))


def render_report(results_dir: str | Path, suite: list[str] | None = None, figure: str | None = None) -> str:
    """The report's Markdown (``build_report`` writes it). ``suite``: the notebooks the suite has,
    to list those not in this run (default: the ones in ``notebooks/``); ``figure``: the decision
    figure's file in the results folder, if drawn."""
    results = Path(results_dir)
    summary = _load_summary(results)
    runs = _runs(results, summary)
    suite = _suite_notebooks() if suite is None else suite
    failed = [r for r in runs if r["status"] == "failed"]
    when = (summary or {}).get("finished") or (
        datetime.datetime.fromtimestamp((results / SUMMARY).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        if summary else "unknown time")
    device = (summary or {}).get("device", {}).get("description", "unknown hardware")
    methods, headlines, smoke, read, earlier = load_facts(results, runs, (summary or {}).get("stamp"), suite)
    lines = [
        "# Memory-efficient cross-entropy: results",
        "",
        f"Run of {when}, profile `{(summary or {}).get('profile', '?')}`, on {device}. "
        f"{len(runs)} notebooks: {len(runs) - len(failed)} ran, {len(failed)} failed.",
        "",
        *recommendation(methods, smoke, read, is_t4_run(summary), figure, pretended(summary)),
        *([f"- {e}" for e in earlier] + [""] if earlier else []),
        "## The notebooks",
        "",
        "| notebook | status | time | headline |",
        "|---|---|---:|---|",
    ]
    has_fragment = {r["notebook"]: (results / r["notebook"] / REPORT_FRAGMENT).is_file() for r in runs}
    for run in runs:
        name = run["notebook"]
        if run["status"] == "failed":
            where = _cell(run.get("error", "").splitlines()[0] if run.get("error") else "failed")
        elif has_fragment[name]:
            where = _cell(headlines.get(name, "no headline given")) + f" ([more](#{name}))"
        else:
            where = "no report.md: see below"
        status = "**failed**" if run["status"] == "failed" else run["status"]
        lines.append(f"| `{name}` | {status} | {_seconds(run)} | {where} |")
    lines.append("")
    lines += _hardware_section(summary)
    lines += glossary_section()

    for run in runs:
        name = run["notebook"]
        if not has_fragment[name]:
            continue
        lines += [f"## {name}", ""]
        if run["status"] == "failed":
            lines += ["> **This notebook failed after writing what follows**; see the error at the end.", ""]
        lines += [rebase_fragment((results / name / REPORT_FRAGMENT).read_text(), name).strip(), ""]
        executed = results / name / f"{name}.ipynb"
        if executed.is_file():
            lines += [f"*From the executed notebook [{name}.ipynb]({name}/{name}.ipynb)"
                      + (f", {_seconds(run)}.*" if _seconds(run) else ".*"), ""]

    lines += _not_run_section(results, runs, has_fragment, suite)
    return "\n".join(lines).rstrip() + "\n"


def _not_run_section(results: Path, runs: list[dict], has_fragment: dict, suite: list[str]) -> list[str]:
    lines = ["## What did not run, and why", ""]
    failed = [r for r in runs if r["status"] == "failed"]
    silent = [r for r in runs if r["status"] != "failed" and not has_fragment[r["notebook"]]]
    missing = [s for s in suite if s not in {r["notebook"] for r in runs}]
    if not (failed or silent or missing):
        return lines + ["Every notebook of the suite ran and reported.", ""]
    for run in failed:
        error = (run.get("error") or "no error recorded").replace("```", "'''")
        lines += [f"- **`{run['notebook']}` failed** after {_seconds(run) or 'an unknown time'}:", "",
                  "  ```text", *("  " + e for e in error.splitlines()), "  ```", ""]
    for run in silent:
        name = run["notebook"]
        files = [f for f in run.get("files", []) if not f.endswith(".ipynb")]
        shown = ", ".join(f"[`{Path(f).name}`]({f})" for f in files[:12]) + (" …" if len(files) > 12 else "")
        executed = (f"; the executed notebook: [{name}.ipynb]({name}/{name}.ipynb)"
                    if (results / name / f"{name}.ipynb").is_file() else "")
        lines.append(f"- **`{name}`** ran but wrote no `{REPORT_FRAGMENT}`, so it has no headline here. "
                     f"Its results: {shown or 'no files besides the executed notebook'}{executed}.")
    if missing:
        lines.append(f"- **Not part of this run** (`--only`, or added since): {', '.join(f'`{m}`' for m in missing)}.")
    return lines + [""]


def build_report(results_dir: str | Path, *, suite: list[str] | None = None, embed_images: bool = True) -> Path:
    """Write ``REPORT.md`` and ``REPORT.html`` into ``results_dir``; returns the Markdown's path."""
    results = Path(results_dir)
    figure = draw_decision_figure(results, suite)
    markdown = render_report(results, suite, figure)
    path = results / "REPORT.md"
    path.write_text(markdown)
    (results / "REPORT.html").write_text(html_document(markdown, results, embed_images))
    return path


DECISION_FIGURE = "decision.png"


def draw_decision_figure(results: Path, suite: list[str] | None = None) -> str | None:
    """Time against peak memory per method at each token count 02 swept, each point marked with
    the engine's gate and training verdicts (``helpers.lab.plots.plot_decision``); the file's name,
    or None where no sweep facts were read."""
    summary = _load_summary(results)
    runs = _runs(results, summary)
    suite = _suite_notebooks() if suite is None else suite
    methods, _, smoke, read, _ = load_facts(results, runs, (summary or {}).get("stamp"), suite)
    if not any(f.get("sweep") for f in methods.values()):
        return None
    from helpers.lab.plots import mark_smoke, plot_decision

    fig = plot_decision(methods, trained="03_convergence" in read,
                        title=(summary or {}).get("device", {}).get("description", ""))
    if smoke:
        mark_smoke(fig)
    fig.savefig(results / DECISION_FIGURE, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return DECISION_FIGURE


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

_CSS = """
body { font: 16px/1.5 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
img { max-width: 100%; }
pre { background: #f6f6f6; padding: 0.8rem; overflow-x: auto; }
code { font-size: 0.9em; }
blockquote { border-left: 4px solid #d33; margin: 1rem 0; padding: 0.2rem 1rem; background: #fff5f5; }
"""


def markdown_to_html(markdown: str) -> str:
    """Markdown (with pipe tables) to an HTML fragment: markdown-it-py, else markdown, else ours."""
    try:
        from markdown_it import MarkdownIt

        return MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown)
    except ImportError:
        pass
    try:
        import markdown as markdown_package

        return markdown_package.markdown(markdown, extensions=["tables", "fenced_code"])
    except ImportError:
        return simple_markdown_to_html(markdown)


def html_document(markdown: str, results: Path, embed_images: bool = True) -> str:
    body = markdown_to_html(markdown)
    # GitHub-style ids on h2, so the table's "below" links work in the HTML too.
    body = re.sub(r"<h2>(.*?)</h2>", lambda m: f'<h2 id="{_anchor(m.group(1))}">{m.group(1)}</h2>', body)
    if embed_images:
        body = re.sub(r'(<img [^>]*src=")([^"]+)(")', lambda m: m.group(1) + _data_uri(results, m.group(2)) + m.group(3), body)
    title = next((line[2:] for line in markdown.splitlines() if line.startswith("# ")), "Report")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def _anchor(heading_html: str) -> str:
    text = re.sub(r"<[^>]+>", "", html.unescape(heading_html)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _data_uri(results: Path, src: str) -> str:
    path = results / html.unescape(src)
    if not _is_relative(src) or not path.is_file() or path.stat().st_size > 8 * 1024**2:
        return src
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _inline(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    text = re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", r'<img alt="\1" src="\2">', text)
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r'<a href="\2">\1</a>', text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"(?<![\w*])\*([^*]+)\*(?![\w*])", r"<em>\1</em>", text)


def _row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def simple_markdown_to_html(markdown: str) -> str:
    """The fallback: headings, paragraphs, lists, pipe tables, fenced code, quotes, images, links,
    bold, italics and inline code; raw HTML lines pass through. Enough for our reports, no more."""
    out, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            fence = line.strip()[:3]
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i])
                i += 1
            out.append(f"<pre><code>{html.escape(chr(10).join(body))}</code></pre>")
        elif m := re.match(r"^(#{1,6})\s+(.*)$", line):
            out.append(f"<h{len(m.group(1))}>{_inline(m.group(2))}</h{len(m.group(1))}>")
        elif line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|?\s*:?-+", lines[i + 1]):
            header = _row(line)
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_row(lines[i]))
                i += 1
            i -= 1
            out.append("<table><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in header) + "</tr></thead><tbody>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
                       + "</tbody></table>")
        elif re.match(r"^\s*[-*]\s", line):
            items = []
            while i < len(lines) and (re.match(r"^\s*[-*]\s", lines[i]) or (lines[i].startswith("  ") and items)):
                if re.match(r"^\s*[-*]\s", lines[i]):
                    items.append(re.sub(r"^\s*[-*]\s", "", lines[i]))
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            i -= 1
            out.append("<ul>" + "".join(f"<li>{_inline(t)}</li>" for t in items) + "</ul>")
        elif line.startswith(">"):
            out.append(f"<blockquote><p>{_inline(line.lstrip('> '))}</p></blockquote>")
        elif line.lstrip().startswith("<"):
            out.append(line)
        elif line.strip():
            para = [line]
            while i + 1 < len(lines) and lines[i + 1].strip() and not re.match(r"^(#|\||```|~~~|\s*[-*]\s|>)", lines[i + 1]):
                i += 1
                para.append(lines[i])
            out.append(f"<p>{_inline(' '.join(para))}</p>")
        i += 1
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.suite.report", description="build REPORT.md/.html of a run")
    parser.add_argument("results", nargs="?", default="results")
    args = parser.parse_args(argv)
    print(f"wrote {build_report(args.results)} and REPORT.html")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
