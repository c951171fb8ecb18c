"""The batch report: one REPORT.md (+ REPORT.html) from every notebook's report.md, the hardware
and versions of the run, and what did not run and why."""

import json
import re
import struct
import zlib
from pathlib import Path

import pytest

from helpers.suite.report import (
    build_report,
    markdown_to_html,
    rebase_fragment,
    render_report,
    simple_markdown_to_html,
    write_report_fragment,
)

ROOT = Path(__file__).resolve().parents[2]


def tiny_png() -> bytes:
    """A valid 1×1 PNG, so the HTML's embedded image is a real one."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


DEVICE = {"kind": "cuda", "name": "Tesla T4", "capability": [7, 5], "total_memory_bytes": 15 * 1024**3,
          "shared_memory_per_block_bytes": 65536, "multiprocessors": 40,
          "description": "Tesla T4 (sm_75, 15 GiB, 64 KiB shared memory per block, 40 SMs)"}


@pytest.fixture
def results(tmp_path):
    """A run of four notebooks: one reported, one failed, one silent, one failed after reporting."""
    runs = [
        {"notebook": "01_alpha", "status": "ok", "seconds": 12.3, "output_dir": "", "error": "",
         "files": ["01_alpha/01_alpha.ipynb", "01_alpha/plot.png", "01_alpha/report.md"]},
        {"notebook": "02_beta", "status": "failed", "seconds": 3.0, "output_dir": "",
         "error": "OutOfMemoryError: CUDA out of memory | tried 9.96 GiB\nsecond line", "files": []},
        {"notebook": "03_gamma", "status": "ok", "seconds": 1.5, "output_dir": "", "error": "",
         "files": ["03_gamma/03_gamma.ipynb", "03_gamma/sweep.csv"]},
        {"notebook": "04_delta", "status": "failed", "seconds": 2.0, "output_dir": "", "error": "AssertionError: late",
         "files": ["04_delta/report.md"]},
    ]
    summary = {"profile": "t4", "device": DEVICE, "python": "3.11.9", "torch": "2.6.0+cu124",
               "versions": {"triton": "3.2.0"}, "runs": runs}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    for run in runs:
        (tmp_path / run["notebook"]).mkdir()
    (tmp_path / "01_alpha" / "01_alpha.ipynb").write_text("{}")
    (tmp_path / "01_alpha" / "plot.png").write_bytes(tiny_png())
    write_report_fragment(tmp_path / "01_alpha", """
## Headline

| method | peak MB |
|---|---:|
| naive | 9960 |

![the plot](plot.png)

See [the raw numbers](./numbers.json) or [the paper](https://arxiv.org/abs/2411.09009).

```python
# a comment, not a heading: ![x](kept.png)
```
""")
    (tmp_path / "03_gamma" / "03_gamma.ipynb").write_text("{}")
    (tmp_path / "03_gamma" / "sweep.csv").write_text("n,mb\n")
    write_report_fragment(tmp_path / "04_delta", "# Delta\n\nHalf a result.")
    return tmp_path


def test_report_collects_everything_in_order(results):
    path = build_report(results, suite=["01_alpha", "02_beta", "03_gamma", "04_delta", "05_epsilon"])
    assert path == results / "REPORT.md"
    md = path.read_text()
    # the overview table, in notebook order, each with its status
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == ["01_alpha", "02_beta", "03_gamma", "04_delta"]
    assert "**failed**" in rows[1] and "OutOfMemoryError: CUDA out of memory \\| tried 9.96 GiB" in rows[1]
    # hardware and versions
    assert "Tesla T4" in md and "sm_75" in md and "64 KiB" in md and "bf16 tensor cores: no" in md
    assert "torch 2.6.0+cu124" in md and "triton 3.2.0" in md and "`t4`" in md
    # the fragment, its heading demoted under the notebook's, its paths rebased, code untouched
    assert md.index("## 01_alpha") < md.index("### Headline") < md.index("## 04_delta")
    assert "![the plot](01_alpha/plot.png)" in md and "(01_alpha/numbers.json)" in md
    assert "(https://arxiv.org/abs/2411.09009)" in md and "![x](kept.png)" in md
    assert "| naive | 9960 |" in md
    assert "[01_alpha.ipynb](01_alpha/01_alpha.ipynb)" in md
    # what did not run, and why
    tail = md[md.index("## What did not run"):]
    assert "`02_beta` failed" in tail and "second line" in tail
    assert "`03_gamma`** ran but wrote no `report.md`" in tail and "(03_gamma/sweep.csv)" in tail
    assert "`05_epsilon`" in tail and "Not part of this run" in tail
    assert "failed after writing what follows" in md[md.index("## 04_delta"):md.index("## What did not run")]


def test_every_image_link_in_the_report_resolves(results):
    md = build_report(results, suite=[]).read_text()
    outside_code = re.sub(r"```.*?```", "", md, flags=re.DOTALL)
    for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", outside_code):
        assert (results / target).is_file(), target


def test_html_embeds_the_images_and_renders_tables(results):
    build_report(results, suite=[])
    page = (results / "REPORT.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<table>" in page and "<pre" not in page.split("<body>")[0]
    assert 'src="data:image/png;base64,' in page and 'id="01_alpha"' in page and 'href="#01_alpha"' in page


def test_all_good_run_says_so(results):
    summary = json.loads((results / "summary.json").read_text())
    summary["runs"] = summary["runs"][:1]
    (results / "summary.json").write_text(json.dumps(summary))
    md = render_report(results, suite=["01_alpha"])
    assert "Every notebook of the suite ran and reported." in md


def test_without_summary_the_folders_are_used(results):
    (results / "summary.json").unlink()
    md = render_report(results, suite=[])
    assert "hardware and versions are unknown" in md and "## 01_alpha" in md


def test_rebase_fragment():
    fragment = '# Top\n## Sub\n<img src="a.png"> [x](/abs) [y](#anchor) ![z](data:image/png;base64,AAA)'
    out = rebase_fragment(fragment, "07_x")
    assert out.splitlines()[:2] == ["### Top", "#### Sub"]
    assert '<img src="07_x/a.png">' in out and "(/abs)" in out and "(#anchor)" in out and "(data:image" in out


def test_the_fallback_converter():
    html = simple_markdown_to_html(
        "# T\n\nSome **bold** and `code`.\n\n| a | b |\n|---|--:|\n| 1 | x\\|y |\n\n- one\n- two\n\n"
        "```text\n<raw> & stuff\n```\n![p](p.png)"
    )
    assert "<h1>T</h1>" in html and "<strong>bold</strong>" in html and "<code>code</code>" in html
    assert "<th>a</th>" in html and "<td>x|y</td>" in html and "<li>two</li>" in html
    assert "&lt;raw&gt; &amp; stuff" in html and '<img alt="p" src="p.png">' in html


def test_the_markdown_renderer_handles_tables():
    assert "<table>" in markdown_to_html("| a |\n|---|\n| 1 |\n")


# ---------------------------------------------------------------------------------------------
# The opening table: which loss to use, from the facts the notebooks hand over
# ---------------------------------------------------------------------------------------------

from helpers.compare import verdicts  # noqa: E402
from helpers.compare.methods import METHODS  # noqa: E402


def _split(facts: dict) -> dict:
    """The H200 fixture as the notebooks hand it over: 01 gradients, 02 sweeps, 03 training."""
    pick = lambda key: {m: {key: f[key]} for m, f in facts.items() if key in f}  # noqa: E731
    return {"01_correctness": ("gate", pick("gradients")), "02_memory_sweep": ("sweep", pick("sweep")),
            "03_convergence": ("training", pick("convergence"))}


def _write_run(tmp_path, notebooks: dict, smoke=False, device=DEVICE, profile="gpu"):
    runs = []
    for name, (headline, facts) in notebooks.items():
        write_report_fragment(tmp_path / name, f"# {name}", headline=headline, facts=facts, smoke=smoke)
        runs.append({"notebook": name, "status": "ok", "seconds": 1.0, "output_dir": "", "error": "", "files": []})
    (tmp_path / "summary.json").write_text(json.dumps({"profile": profile, "device": device, "runs": runs}))
    return tmp_path


H200 = {"kind": "cuda", "name": "NVIDIA H200", "capability": [9, 0], "description": "NVIDIA H200 (sm_90)"}


def test_the_report_opens_with_which_loss_to_use(tmp_path, facts_kit):
    _write_run(tmp_path, _split(facts_kit.h200()), device=H200)
    md = render_report(tmp_path, suite=[])
    opening = md[md.index("## Which loss to use"):md.index("## The notebooks")]
    rows = [line for line in opening.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # sorted by memory at 16k; the peer lighter than ours first
    assert [r.split(" | ")[0] for r in rows] == ["| Apple CCE", "| Liger", "| ours (Triton CCE)", "| torch.compile",
                                                 "| naive"]
    assert "bfloat16: yes (pretraining +0.00127 nats, margin ±0.0055)" in rows[1]
    assert "bfloat16: undecided" in rows[0] and "bfloat16 fail" in rows[0]
    assert "- At 16,384 tokens (bfloat16, loss forward and backward): least memory: Liger, 0.38 GB" in opening
    assert "Liger is faster than ours (Triton CCE) from 65,536 tokens" in opening
    assert "Not measured in this run: 05 (whole training steps)" in opening
    assert "| gate ([more](#01_correctness)) |" in md


PRETEND_A100 = {"kind": "cuda", "name": "NVIDIA H200 as an A100-40GB", "capability": [8, 0], "real_capability": [9, 0],
                "total_memory_bytes": 40 * 1024**3, "shared_memory_per_block_bytes": 166_912, "multiprocessors": 108,
                "pretend": "a100-40gb", "description": "NVIDIA H200 as an A100-40GB (sm_80, 40 GiB, 163 KiB shared "
                "memory per block, 108 SMs; a pretend A100-40GB: an A100-40GB's limits, this GPU's speed)"}


def test_a_pretend_a100s_report_names_the_card_and_is_not_a_t4s(tmp_path, facts_kit):
    from helpers.suite.report import is_t4_run, pretended

    _write_run(tmp_path, _split(facts_kit.h200()), device=PRETEND_A100)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert pretended(summary) == "a100-40gb" and not is_t4_run(summary)
    md = render_report(tmp_path, suite=[])
    opening = md[md.index("## Which loss to use"):md.index("## The notebooks")]
    assert "time at 16k, this GPU's speed" in opening
    assert ("Times are this GPU's: a pretend A100-40GB has an A100-40GB's memory, shared memory and code paths, "
            "not its speed (an A100-40GB's datasheet gives 312 TFLOP/s of dense 16-bit matmul)") in opening
    assert "T4" not in opening  # no T4 column, sentence or note in an A100's run
    assert "- **pretended card**: A100-40GB on a sm_90 GPU" in md and "`ampere-163k`" in md
    assert "bf16 tensor cores: yes" in md
    # a summary from before the other cards, which said only "pretend_t4": its runs were a T4's
    old = {"device": {"pretend_t4": True, "capability": [7, 5]}, "profile": "t4"}
    assert pretended(old) == "t4" and is_t4_run(old)


def test_a_partial_run_does_not_flip_the_recommendation(tmp_path, facts_kit):
    """A T4 run of 01, 02 and 05 alone once said "use Liger" because 03, which finds Liger drifting
    in fp16, had not run: without 03 nothing is recommended for training."""
    t4 = {"kind": "cuda", "name": "Tesla T4", "capability": [7, 5], "description": "Tesla T4 (sm_75)"}
    facts = {"liger": {"gradients": {"float16": "pass"}, "runs_on_t4": True, "t4_peak_bytes_16k": 380_000_000},
             "ours": {"gradients": {"float16": "pass"}, "runs_on_t4": True, "t4_peak_bytes_16k": 410_000_000}}
    _write_run(tmp_path, {"01_correctness": ("", {m: {"gradients": f["gradients"]} for m, f in facts.items()}),
                          "02_memory_sweep": ("", {m: {k: f[k] for k in ("runs_on_t4", "t4_peak_bytes_16k")}
                                                   for m, f in facts.items()})}, device=t4, profile="t4")
    opening = render_report(tmp_path, suite=[])
    opening = opening[:opening.index("## The notebooks")]
    assert "use **Liger**" not in opening and "Use Liger" not in opening
    assert "On a T4 (fp16): no recommendation, because notebook 03" in opening
    # with 03's fp16 verdicts the recommendation is made, and Liger is named to avoid
    facts["liger"]["convergence"] = facts_kit.trained("float16", verdicts.WORSE, 0.136)
    facts["ours"]["convergence"] = facts_kit.trained("float16", verdicts.EQUIVALENT)
    _write_run(tmp_path, {"01_correctness": ("", {m: {"gradients": f["gradients"]} for m, f in facts.items()}),
                          "02_memory_sweep": ("", {m: {k: f[k] for k in ("runs_on_t4", "t4_peak_bytes_16k")}
                                                   for m, f in facts.items()}),
                          "03_convergence": ("", {m: {"convergence": f["convergence"]} for m, f in facts.items()})},
               device=t4, profile="t4")
    opening = render_report(tmp_path, suite=[])
    assert "On a T4 (fp16), at 16,384 tokens: ours (Triton CCE), 0.41 GB" in opening
    assert "Avoid Liger for training in float16" in opening


def test_every_report_sentence_naming_a_method_agrees_with_the_engine(tmp_path, facts_kit):
    """Each line of the REPORT that names one method and says how it trains says what the engine
    decided for it (and no notebook's fragment restates a training verdict of its own)."""
    facts = facts_kit.h200()
    facts["liger"]["convergence"] = facts_kit.trained("bfloat16", verdicts.WORSE, 0.2)
    notebooks = _split(facts)
    notebooks["05_fits"] = ("", {m: {"largest_step_tokens_16gb": 65536} for m in ("ours", "liger")})
    _write_run(tmp_path, notebooks, device=H200)
    md = render_report(tmp_path, suite=[])
    labels = {METHODS[m].label: m for m in facts}
    phrases = {p: v for v, p in verdicts.TRAINS.items()}
    checked = 0
    for line in md.splitlines():
        named = [m for label, m in labels.items() if label in line]
        said = [v for p, v in phrases.items() if p in line]
        if len(named) == 1 and said:
            assert said == [verdicts.training_verdict(facts[named[0]], "bfloat16")], line
            checked += 1
    assert checked >= 1  # "Avoid Liger ... trains worse than exact"
    assert not any(p in (tmp_path / "05_fits" / "report.md").read_text() for p in phrases)


def test_caveats_longer_than_a_cell_go_to_footnotes(tmp_path):
    long = "not run here: cut-cross-entropy 25.1.1 has no Kahan-FullC (impl='cce_kahan_full_c'): " + "x" * 120
    _write_run(tmp_path, {"03_convergence": ("", {"apple_cce": {"caveats": ["short one", long]}})}, device=H200)
    md = render_report(tmp_path, suite=[])
    row = next(line for line in md.splitlines() if line.startswith("| Apple CCE"))
    cell = row.rstrip(" |").split(" | ")[-1]
    assert len(cell) <= 150 and "short one" in cell and "[1]" in cell
    assert f"[1] {long}" in md


def test_a_run_with_no_facts_says_what_to_run(tmp_path):
    _write_run(tmp_path, {"04_workshop": ("24 of 24 checks pass", None)})
    md = render_report(tmp_path, suite=[])
    assert "measured nothing this table reads" in md and "| 24 of 24 checks pass ([more](#04_workshop)) |" in md


def test_a_smoke_run_says_so_everywhere(tmp_path, facts_kit):
    _write_run(tmp_path, {"02_sweep": ("ours flat", {"ours": {"sweep": facts_kit.sweep("float32", n16384=(0.4, 40))}})},
               smoke=True)
    md = render_report(tmp_path, suite=[])
    assert "are not a recommendation" in md[:md.index("## The notebooks")]
    assert "smoke run: ours flat" in md
    assert "supports no conclusion" in (tmp_path / "02_sweep" / "report.md").read_text()


def test_facts_with_an_unknown_key_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['peak_16k'\\]"):
        write_report_fragment(tmp_path, "x", facts={"ours": {"peak_16k": 1}})


def test_earlier_results_are_used_only_from_the_same_setup(tmp_path, facts_kit):
    stamp = {"profile": "gpu", "device": "NVIDIA H200 (sm_90)", "versions": {"helpers": "0.1.0"}}
    _write_run(tmp_path, {"02_memory_sweep": ("", {m: {"sweep": f["sweep"]} for m, f in facts_kit.h200().items()})},
               device=H200)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["stamp"] = stamp
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    write_report_fragment(tmp_path / "03_convergence", "# 03", facts={"ours": {"convergence": facts_kit.trained("bfloat16", "equivalent")}})
    data = json.loads((tmp_path / "03_convergence" / "facts.json").read_text())
    for theirs, used in ((dict(stamp, profile="t4"), False), (dict(stamp, finished="2026-12-01 10:00"), True)):
        data["stamp"] = theirs
        (tmp_path / "03_convergence" / "facts.json").write_text(json.dumps(data))
        md = render_report(tmp_path, suite=["02_memory_sweep", "03_convergence"])
        assert ("from an earlier run into this folder (2026-12-01 10:00) on the same device" in md) is used
        assert ("Not measured in this run: 01 (gradients against float64); 03" in md) is not used


def test_a_reason_a_method_cannot_run_on_a_t4_outweighs_a_later_notebooks_yes(tmp_path):
    fits = {"naive": {"largest_step_tokens_16gb": 4096, "runs_on_t4": True}}
    sweep02 = {"naive": {"runs_on_t4": "out of memory on a T4 from N=8,192"}}
    _write_run(tmp_path, {"02_sweep": ("", sweep02), "05_fits": ("", fits)})
    naive_row = next(line for line in render_report(tmp_path, suite=[]).splitlines() if line.startswith("| naive |"))
    assert "no: out of memory on a T4 from N=8,192" in naive_row and "| yes |" not in naive_row

MEASURED = ROOT / "docs" / "measurements" / "h200-2026-12-02"


@pytest.mark.parametrize("run", ["suite-gpu-quick", "suite-pretend-t4-quick"])
def test_the_committed_reports_agree_with_the_engine(run):
    """The REPORTs of the committed H200 runs, rebuilt from their facts by this code: every line that
    names one method and says how it trains says the engine's verdict for it, in that run's dtype."""
    from helpers.suite.report import _load_summary, _runs, load_facts

    results = MEASURED / run
    suite = ["01_correctness", "02_memory_sweep", "03_convergence", "04_kernel_walkthrough", "05_fits"]
    summary = _load_summary(results)
    methods, *_ = load_facts(results, _runs(results, summary), summary.get("stamp"), suite)
    md = render_report(results, suite=suite)
    assert "Not measured in this run" not in md  # the gpu run's 01 and 02 come from its first call
    dtype = "float16" if "t4" in run else "bfloat16"
    labels = {METHODS[m].label: m for m in methods if m in METHODS}
    phrases = {p: v for v, p in verdicts.TRAINS.items()}
    checked = 0
    for line in md.splitlines():
        named = {m for label, m in labels.items() if label in line and f"{label} (" not in line.replace(label + " (Triton", "")}
        said = [v for p, v in phrases.items() if p in line]
        if len(named) == 1 and said and "filter off" not in line:
            assert verdicts.training_verdict(methods[named.pop()], dtype) in said, line
            checked += 1
    assert checked >= 1
    # the training claims of the opening sentences are the engine's
    assert ("Avoid Liger for training in float16" in md) is (dtype == "float16")
    assert "Avoid Apple CCE in" in md if dtype == "bfloat16" else "Cannot run on a T4: " in md
