"""The batch report: one REPORT.md (+ REPORT.html) from every notebook's report.md, the hardware
and versions of the run, and what did not run and why."""

import copy
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

GATE = {"naive": {"gradients": {"float16": "pass", "bfloat16": "pass"}},
        "ours": {"gradients": {"float16": "pass", "bfloat16": "pass"}},
        "liger": {"gradients": {"float16": "pass", "bfloat16": "pass"}},
        "apple_cce": {"gradients": {"float16": "pass", "bfloat16": "fail"}}}
SWEEP = {"naive": {"peak_bytes_16k": 29.9e9, "seconds_16k": 0.050, "t4_peak_bytes_16k": "oom", "runs_on_t4": True},
         "ours": {"peak_bytes_16k": 0.45e9, "seconds_16k": 0.040, "t4_peak_bytes_16k": 0.45e9, "runs_on_t4": True},
         "liger": {"peak_bytes_16k": 0.70e9, "seconds_16k": 0.030, "t4_peak_bytes_16k": 0.70e9, "runs_on_t4": True,
                   "caveats": ["computes no dC when E needs no gradient"]},
         "apple_cce": {"peak_bytes_16k": 0.40e9, "seconds_16k": 0.020,
                       "runs_on_t4": "needs ~96 KB of shared memory, a T4 offers 64 KB"}}
TRAIN = {"ours": {"convergence": "ok"}, "liger": {"convergence": "off"}, "apple_cce": {"convergence": "ok"}}


def _write_run(tmp_path, notebooks: dict, smoke=False):
    runs = []
    for name, (headline, facts) in notebooks.items():
        write_report_fragment(tmp_path / name, f"# {name}", headline=headline, facts=facts, smoke=smoke)
        runs.append({"notebook": name, "status": "ok", "seconds": 1.0, "output_dir": "", "error": "", "files": []})
    (tmp_path / "summary.json").write_text(json.dumps({"profile": "gpu", "device": DEVICE, "runs": runs}))
    return tmp_path


def test_the_report_opens_with_which_loss_to_use(tmp_path):
    _write_run(tmp_path, {"01_gate": ("3 of 4 pass", GATE), "02_sweep": ("ours 0.45 GB at 16k", SWEEP),
                          "03_train": ("liger drifts", TRAIN)})
    md = render_report(tmp_path, suite=[])
    opening = md[md.index("## Which loss to use"):md.index("## The notebooks")]
    rows = [line for line in opening.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # sorted by memory; a caveat from one notebook beside the numbers from another
    assert [r.split(" | ")[0] for r in rows] == ["| Apple CCE", "| ours (Triton CCE)", "| Liger", "| naive"]
    assert "computes no dC" in rows[2] and "**no**" in rows[2] and "out of memory" in rows[3]
    assert "no: needs ~96 KB" in rows[0] and "bfloat16 fail" in rows[0]
    # Apple CCE is lightest and fastest but fails bf16; Liger is fast but trains differently: ours
    assert "Use **ours (Triton CCE)** when memory is the limit: 0.45 GB" in opening
    assert "66× less than naive's 29.90 GB" in opening and "It is also the fastest measured." in opening
    assert "On a T4 (16 GB, fp16), use **ours (Triton CCE)**" in opening and "cannot run there: Apple CCE" in opening
    assert "Avoid **Apple CCE** in bfloat16" in opening and "**Liger** trains differently" in opening
    # the notebooks table carries each one's headline
    assert "| ours 0.45 GB at 16k ([more](#02_sweep)) |" in md


def test_fastest_and_lightest_are_named_apart_when_they_differ(tmp_path):
    sweep = copy.deepcopy(SWEEP)
    _write_run(tmp_path, {"02_sweep": ("", sweep)})
    opening = render_report(tmp_path, suite=[])
    assert "Use **Apple CCE** when memory is the limit" in opening  # nothing measured it wrong here
    assert "Use **Liger** when step time matters most" not in opening  # Apple CCE is faster still
    sweep["apple_cce"]["seconds_16k"] = 0.5
    _write_run(tmp_path, {"02_sweep": ("", sweep)})
    assert "Use **Liger** when step time matters most: 30 ms" in render_report(tmp_path, suite=[])


def test_a_run_with_no_facts_says_what_to_run(tmp_path):
    _write_run(tmp_path, {"04_workshop": ("24 of 24 checks pass", None)})
    md = render_report(tmp_path, suite=[])
    assert "measured nothing this table reads" in md and "| 24 of 24 checks pass ([more](#04_workshop)) |" in md


def test_a_smoke_run_says_so_everywhere(tmp_path):
    _write_run(tmp_path, {"02_sweep": ("ours flat", SWEEP)}, smoke=True)
    md = render_report(tmp_path, suite=[])
    assert "are not a recommendation" in md[:md.index("## The notebooks")]
    assert "smoke run: ours flat" in md
    assert "supports no conclusion" in (tmp_path / "02_sweep" / "report.md").read_text()


def test_facts_with_an_unknown_key_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['peak_16k'\\]"):
        write_report_fragment(tmp_path, "x", facts={"ours": {"peak_16k": 1}})


def test_methods_that_fit_as_many_tokens_are_all_named(tmp_path):
    fits = {"naive": {"largest_step_tokens_16gb": 4096}, "ours": {"largest_step_tokens_16gb": 65536},
            "liger": {"largest_step_tokens_16gb": 65536}, "apple_cce": {"largest_step_tokens_16gb": 32768}}
    _write_run(tmp_path, {"05_fits": ("", fits)})
    opening = render_report(tmp_path, suite=[])
    assert "use **ours (Triton CCE)** or **Liger**: 65,536 tokens each, against 4,096" in opening
    _write_run(tmp_path, {"03_train": ("", TRAIN), "05_fits": ("", fits)})  # Liger now trains differently
    opening = render_report(tmp_path, suite=[])
    assert "use **ours (Triton CCE)**: 65,536 tokens, against 4,096" in opening
    assert "Liger fits as many but is not recommended here" in opening


def test_a_reason_a_method_cannot_run_on_a_t4_outweighs_a_later_notebooks_yes(tmp_path):
    fits = {"naive": {"largest_step_tokens_16gb": 4096, "runs_on_t4": True}}
    _write_run(tmp_path, {"02_sweep": ("", SWEEP), "05_fits": ("", fits)})
    naive_row = next(line for line in render_report(tmp_path, suite=[]).splitlines() if line.startswith("| naive |"))
    assert "out of memory" in naive_row
    sweep = copy.deepcopy(SWEEP)
    sweep["naive"]["runs_on_t4"] = "out of memory on a T4 from N=8,192"
    _write_run(tmp_path, {"02_sweep": ("", sweep), "05_fits": ("", fits)})
    naive_row = next(line for line in render_report(tmp_path, suite=[]).splitlines() if line.startswith("| naive |"))
    assert "no: out of memory on a T4 from N=8,192" in naive_row and "| yes |" not in naive_row
