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
# optional, and a method's row says "not measured" for what no notebook gave.
FACT_KEYS = {
    "gradients": "{dtype name: 'pass' or 'fail'}: the accuracy gate's verdict against float64 (01)",
    "peak_bytes_16k": "peak memory of one loss step (forward and backward) at 16,384 tokens, this GPU (02)",
    "seconds_16k": "time of that step on this GPU (02)",
    "t4_peak_bytes_16k": "the same step's peak under a T4's limits (a T4, or the pretend-T4 sweep) (02)",
    "runs_on_t4": "True, or why not (a string) (02, 05)",
    "largest_step_tokens_16gb": "the largest micro-batch of a whole Qwen3-0.6B training step that fits a 16 GB "
                                "card, in tokens (05; under naive: transformers' default loss)",
    "convergence": "'ok' or 'off': trains like the exact loss (03)",
    "caveats": "[str]: what a user must know (any notebook)",
}


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


def load_facts(results: Path, runs: list[dict]) -> tuple[dict[str, dict], dict[str, str], bool]:
    """({method: merged facts}, {notebook: headline}, whether any notebook was a smoke run), from
    the ``facts.json`` the notebooks of ``runs`` wrote: a later notebook's value of a key wins, except
    that no "runs on a T4" outweighs a reason it cannot."""
    methods: dict[str, dict] = {}
    headlines: dict[str, str] = {}
    smoke = False
    for run in runs:
        path = results / run["notebook"] / FACTS
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        smoke |= bool(data.get("smoke"))
        if data.get("headline"):
            headlines[run["notebook"]] = data["headline"]
        for method, facts in data.get("methods", {}).items():
            merged = methods.setdefault(method, {})
            for key, value in facts.items():
                if key == "caveats":
                    merged.setdefault("caveats", [])
                    merged["caveats"] += [c for c in value if c not in merged["caveats"]]
                elif key == "runs_on_t4" and isinstance(merged.get(key), str) and value is True:
                    pass  # one notebook's reason it cannot (out of memory at 16k, say) outweighs another's "ran"
                else:
                    merged[key] = value
    return methods, headlines, smoke


def _label(method: str) -> str:
    from helpers.compare.methods import METHODS

    return METHODS[method].label if method in METHODS else method


def _gradients_ok(f: dict) -> bool | None:
    return None if "gradients" not in f else all(v == "pass" for v in f["gradients"].values())


def _usable(f: dict) -> bool:
    """Measured right: no failing gradient dtype, no training difference (unmeasured is not wrong)."""
    return _gradients_ok(f) is not False and f.get("convergence") != "off"


def _fmt_gb(n) -> str:
    return "not measured" if n is None else "out of memory" if n == "oom" else format_bytes(n)


def recommendation(methods: dict[str, dict], smoke: bool = False) -> list[str]:
    """The report's opening: one row per method with what the notebooks measured, then the "use X
    when ..." sentences those numbers support (none where the run measured too little)."""
    lines = ["## Which loss to use", ""]
    if smoke:
        lines += [f"> **{_smoke_note()}** The table and sentences below show the pipeline works; they "
                  "are not a recommendation.", ""]
    methods = {m: f for m, f in methods.items() if f}
    if not methods:
        return lines + ["This run measured nothing this table reads: run notebooks 01, 02, 03 and 05 (on a GPU) "
                        "to fill it.", ""]
    order = sorted(methods, key=lambda m: (not isinstance(methods[m].get("peak_bytes_16k"), (int, float)),
                                           methods[m].get("peak_bytes_16k") or 0, m))
    # Only the columns some notebook of this run gave: (heading, alignment, key, cell).
    columns = [(heading, align, key, cell) for heading, align, key, cell in _COLUMNS
               if any(key in methods[m] for m in order)]
    lines += ["| method | " + " | ".join(c[0] for c in columns) + " |",
              "|---|" + "".join(f"{c[1]}|" for c in columns)]
    for m in order:
        f = methods[m]
        cells = [_label(m)] + ["" if key not in f else cell(f[key]) for _, _, key, cell in columns]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""] + [f"- {s}" for s in use_when(methods)] + [""]


_COLUMNS = [
    ("peak at 16k tokens", "---:", "peak_bytes_16k", _fmt_gb),
    ("time at 16k", "---:", "seconds_16k", lambda s: f"{s * 1e3:,.0f} ms"),
    ("peak at 16k on a T4", "---:", "t4_peak_bytes_16k", _fmt_gb),
    ("runs on a T4", "---", "runs_on_t4", lambda t: "yes" if t is True else f"no: {t}"),
    ("whole step on 16 GB", "---:", "largest_step_tokens_16gb", lambda n: f"{n:,} tokens"),
    ("gradients vs float64", "---", "gradients", lambda g: ", ".join(f"{d} {v}" for d, v in g.items())),
    ("trains like exact", "---", "convergence", lambda c: {"ok": "yes", "off": "**no**"}.get(c, c)),
    ("caveats", "---", "caveats", "; ".join),
]


def _smoke_note() -> str:
    from helpers.lab.profiles import SMOKE_NOTE

    return SMOKE_NOTE


def use_when(methods: dict[str, dict]) -> list[str]:
    """The sentences that follow from the facts: least memory, fastest, on a T4, most tokens in a
    whole step, among the methods measured right; then what to avoid and why."""
    usable = {m: f for m, f in methods.items() if _usable(f)}

    def best(key, among=usable, largest=False):
        known = {m: f[key] for m, f in among.items() if isinstance(f.get(key), (int, float)) and f[key] is not True}
        return (max if largest else min)(known, key=known.get) if known else None

    out = []
    naive = methods.get("naive", {})
    lightest, fastest = best("peak_bytes_16k"), best("seconds_16k")
    if lightest:
        peak = usable[lightest]["peak_bytes_16k"]
        than = (f", {naive['peak_bytes_16k'] / peak:,.0f}× less than naive's {format_bytes(naive['peak_bytes_16k'])}"
                if isinstance(naive.get("peak_bytes_16k"), (int, float)) and lightest != "naive" else "")
        both = " It is also the fastest measured." if fastest == lightest else ""
        out.append(f"Use **{_label(lightest)}** when memory is the limit: {format_bytes(peak)} for a loss step at "
                   f"16,384 tokens{than}.{both}")
    if fastest and fastest != lightest:
        f = usable[fastest]
        out.append(f"Use **{_label(fastest)}** when step time matters most: {f['seconds_16k'] * 1e3:,.0f} ms at 16,384 "
                   f"tokens ({_fmt_gb(f.get('peak_bytes_16k'))}).")
    on_t4 = {m: f for m, f in usable.items() if f.get("runs_on_t4") is True
             and f.get("gradients", {}).get("float16", "pass") == "pass"}
    t4_best = best("t4_peak_bytes_16k", on_t4)
    if t4_best:
        cannot = [f"{_label(m)} ({f['runs_on_t4']})" for m, f in methods.items() if isinstance(f.get("runs_on_t4"), str)]
        out.append(f"On a T4 (16 GB, fp16), use **{_label(t4_best)}**: {format_bytes(on_t4[t4_best]['t4_peak_bytes_16k'])} "
                   "at 16,384 tokens" + (f"; cannot run there: {', '.join(cannot)}" if cannot else "") + ".")
    most = best("largest_step_tokens_16gb", largest=True)
    if most and usable[most]["largest_step_tokens_16gb"] > naive.get("largest_step_tokens_16gb", 0):
        tokens, default = usable[most]["largest_step_tokens_16gb"], naive.get("largest_step_tokens_16gb")
        # The fit search steps coarsely, so equal counts are common: name every method that reached it.
        tied = [m for m in usable if m != most and usable[m].get("largest_step_tokens_16gb") == tokens]
        passed_over = [m for m in methods if m not in usable and methods[m].get("largest_step_tokens_16gb") == tokens]
        out.append("To fit the most tokens in a whole training step on a 16 GB card, use "
                   + " or ".join(f"**{_label(m)}**" for m in [most, *tied])
                   + f": {tokens:,} tokens" + (" each" if tied else "")
                   + (f", against {default:,} with transformers' default loss" if default is not None else "")
                   + (f"; {' and '.join(_label(m) for m in passed_over)} "
                      + ("fit as many but are" if len(passed_over) > 1 else "fits as many but is")
                      + " not recommended here (below)" if passed_over else "") + ".")
    for m, f in methods.items():
        failing = [d for d, v in f.get("gradients", {}).items() if v != "pass"]
        if failing:
            out.append(f"Avoid **{_label(m)}** in {', '.join(failing)}: its gradients fail the float64 gate "
                       "(notebook 01).")
        if f.get("convergence") == "off":
            out.append(f"**{_label(m)}** trains differently from the exact loss (notebook 03).")
    return out or ["Too little was measured in this run to recommend a method."]


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
    lines.append(f"- **profile**: `{summary.get('profile', '?')}`")
    versions = {"python": summary.get("python"), "torch": summary.get("torch"), **summary.get("versions", {})}
    lines.append("- **versions**: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    return lines + [""]


def render_report(results_dir: str | Path, suite: list[str] | None = None) -> str:
    """The report's Markdown (``build_report`` writes it). ``suite``: the notebooks the suite has,
    to list those not in this run (default: the ones in ``notebooks/``)."""
    results = Path(results_dir)
    summary = _load_summary(results)
    runs = _runs(results, summary)
    suite = _suite_notebooks() if suite is None else suite
    failed = [r for r in runs if r["status"] == "failed"]
    when = (summary or {}).get("finished") or (
        datetime.datetime.fromtimestamp((results / SUMMARY).stat().st_mtime).strftime("%Y-%m-%d %H:%M")
        if summary else "unknown time")
    device = (summary or {}).get("device", {}).get("description", "unknown hardware")
    methods, headlines, smoke = load_facts(results, runs)
    lines = [
        "# Memory-efficient cross-entropy: results",
        "",
        f"Run of {when}, profile `{(summary or {}).get('profile', '?')}`, on {device}. "
        f"{len(runs)} notebooks: {len(runs) - len(failed)} ran, {len(failed)} failed.",
        "",
        *recommendation(methods, smoke),
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
        lines.append(f"- **`{name}`** ran but wrote no `{REPORT_FRAGMENT}`, so it has no headline here. "
                     f"Its results: {shown or 'no files besides the executed notebook'}; "
                     f"the executed notebook: [{name}.ipynb]({name}/{name}.ipynb).")
    if missing:
        lines.append(f"- **Not part of this run** (`--only`, or added since): {', '.join(f'`{m}`' for m in missing)}.")
    return lines + [""]


def build_report(results_dir: str | Path, *, suite: list[str] | None = None, embed_images: bool = True) -> Path:
    """Write ``REPORT.md`` and ``REPORT.html`` into ``results_dir``; returns the Markdown's path."""
    results = Path(results_dir)
    markdown = render_report(results, suite)
    path = results / "REPORT.md"
    path.write_text(markdown)
    (results / "REPORT.html").write_text(html_document(markdown, results, embed_images))
    return path


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
