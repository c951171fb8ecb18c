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
