# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Past one GPU: a vocabulary-parallel loss
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/07_vocab_parallel.ipynb) [![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)](https://kaggle.com/kernels/welcome?src=https://github.com/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/07_vocab_parallel.ipynb)
#
# Tensor parallelism (Megatron, TransformerEngine, torchtitan) splits the language-model head by
# vocabulary rows: each of R GPUs holds a contiguous slice C<sub>r</sub> of the classifier C and the
# same hidden states E. The usual vocabulary-parallel cross-entropy then builds each rank's slice of
# the logits, N × V<sub>r</sub>, and reduces across ranks over it. Our loss never builds logits, so
# the ranks need to exchange only a few numbers per row: each rank's log-sum-exp and, from the one
# rank that holds it, the target's logit.
# `helpers.cce.parallel.vocab_parallel_cross_entropy` does that. This notebook:
#
# - writes out what the ranks exchange, and the memory arithmetic per rank at the Qwen3-0.6B head
#   (V = 151,936, D = 1,024) at 131,072 tokens;
# - checks the loss, dE and dC<sub>r</sub> on every rank against our single-device loss and against
#   float64: with the soft cap, label smoothing and ignored targets, a vocabulary that the number of
#   ranks does not divide, a rank whose slice holds no target, and dE left for the caller to reduce;
#   then shows the check failing on a split whose rows are off by one;
# - times forward and backward on each rank and measures its peak memory, against the single-device
#   loss on the same GPU, across N, with a figure.
#
# Where it runs. On a machine with two GPUs (Kaggle's "GPU T4 x2", two H200s) it starts two
# processes, one a GPU, over NCCL, at the Qwen3 head with 16k to 131k tokens per rank; the T4
# profile runs fp16 and holds each process to a T4's memory. On a machine with one GPU it says that
# it needs two and runs only the correctness check, its two processes sharing the GPU over gloo
# (NCCL takes one GPU a rank); it times nothing. On a CPU it runs two gloo processes at a tiny head:
# the checks mean what they say, the times mean nothing (the Triton kernels run under the
# interpreter).
#
# **Not yet run on two GPUs** (none were available): on one GPU its check has run, the two ranks
# sharing an H200 as a T4 (fp16), an A100 and an L4 (every rank check ok each time); the timing
# across two GPUs has not. The two-GPU path is the
# one `scripts/gpu/vocab_parallel.py` takes (the same functions, `helpers.lab.parallel`), which has
# not run on two GPUs either.
#
# Expected run time: about 20 seconds on a CPU (two processes, tiny shapes). On two GPUs it has not
# been timed: expect a few minutes on two H200s and more on two T4s, where sizes that would start
# after 8 minutes of timing are skipped (the profile's `budget_s`).

# %% jupyter={"source_hidden": true} tags=["cold-start"]
# Cold start: make `helpers` importable here, then report what this machine can run.
# Where the suite is installed (a checkout, CI, papermill) it only reports. On Kaggle and Colab
# it pip-installs the suite without touching the preinstalled torch: from an attached dataset's
# wheel (Kaggle offline) or from GitHub. HELPERS_BOOTSTRAP_DRY_RUN=1 prints pip commands instead.
# Generated from helpers/suite/bootstrap.py (COLD_START_CELL): edit it there, not here.
import glob, importlib, importlib.metadata, importlib.util, os, platform, re, shlex, subprocess, sys

HELPERS_SOURCE = "https://github.com/mecs-workbench/memory-efficient-cross-entropy/archive/refs/heads/main.zip"
REQUIREMENTS = {
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
    "ipywidgets": "ipywidgets>=8",
    "triton": "triton>=3.0",
    "liger_kernel": "liger-kernel>=0.5",
    "cut_cross_entropy": "cut-cross-entropy>=24.12",
    "transformers": "transformers>=5.0",
}
WHEEL_DIRS = ["/kaggle/input"]

def detect_platform(environ, modules):
    """'kaggle', 'colab' or 'local', from the environment variables and the imported modules."""
    if "KAGGLE_KERNEL_RUN_TYPE" in environ:  # "Interactive" in the editor, "Batch" in Save & Run All
        return "kaggle"
    if "google.colab" in modules:
        return "colab"
    return "local"

def importable(module):
    """Whether ``module`` can be imported; for ``helpers``, whether it is this suite's package."""
    spec = importlib.util.find_spec(module)
    if spec is None or module != "helpers":
        return spec is not None
    return any(os.path.exists(os.path.join(p, "suite", "bootstrap.py")) for p in spec.submodule_search_locations or [])

def find_wheels(dirs):
    """Every .whl in the first folder (searched two levels down) that holds a helpers wheel."""
    for top in dirs:
        found = sorted(w for depth in ("", "*", "*/*") for w in glob.glob(os.path.join(top, depth, "helpers-*.whl")))
        if found:
            return sorted(glob.glob(os.path.join(os.path.dirname(found[-1]), "*.whl")))
    return []

def find_checkout(start):
    """The source checkout of this repository that ``start`` (the notebook's folder) sits in, if any."""
    for folder in [start, os.path.dirname(start)]:
        pyproject = os.path.join(folder, "pyproject.toml")
        if os.path.isfile(pyproject):
            with open(pyproject) as f:
                if 'name = "helpers"' in f.read():
                    return folder
    return None

def cold_start_plan(where, have, versions, wheels=(), checkout=None, system="Linux"):
    """[(why, pip arguments)]: what makes the suite importable here; [] when it already is.

    where: "kaggle", "colab" or "local"; have: the importable modules among "helpers", "torch" and
    REQUIREMENTS; versions: {"torch": ..., "triton": ...} as installed; wheels: .whl files found
    offline (find_wheels); checkout: the checkout the notebook sits in (find_checkout).
    """
    if "torch" not in have:
        raise RuntimeError("PyTorch is not installed. This cell never chooses a torch build: install the one "
                           "for this machine (https://pytorch.org/get-started/locally/), then run it again.")
    steps = []
    helpers_wheels = [w for w in wheels if os.path.basename(w).startswith("helpers-")]
    if "helpers" not in have:
        if helpers_wheels:
            steps.append(("install helpers from the attached wheel", ["install", "--no-deps", helpers_wheels[-1]]))
        elif checkout and where == "local":
            steps.append(("install this checkout, editable", ["install", "--no-deps", "-e", checkout]))
        else:
            steps.append((f"install helpers from {HELPERS_SOURCE}", ["install", "--no-deps", HELPERS_SOURCE]))
    missing = [req for module, req in REQUIREMENTS.items()
               if module not in have and (module != "triton" or system == "Linux")]
    # Pinned in the same command, the present torch (and triton) stay: pip fails rather than swap them.
    pins = [f"{name}=={versions[name]}" for name in ("torch", "triton") if name in versions]
    wheel_names = {os.path.basename(w).split("-")[0].lower() for w in wheels}
    offline = [r for r in missing if re.split("[<>=]", r)[0].replace("-", "_").lower() in wheel_names]
    online = [r for r in missing if r not in offline]
    if offline:  # pure-Python wheels needing only torch and triton (checked when the dataset is built)
        folder = os.path.dirname(wheels[0])
        steps.append((f"install {', '.join(offline)} from the attached wheels",
                      ["install", "--no-deps", "--no-index", "--find-links", folder, *offline]))
    if online:
        steps.append((f"install {', '.join(online)} (torch kept as it is)", ["install", *online, *pins]))
    return steps

def cold_start(environ=os.environ, modules=sys.modules, run=subprocess.run):
    """Plan for this machine, run the plan (or print it under HELPERS_BOOTSTRAP_DRY_RUN=1), report."""
    where = detect_platform(environ, modules)
    have = {m for m in ["helpers", "torch", *REQUIREMENTS] if importable(m)}
    versions = {}
    for name in ["torch", "triton"]:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    extra = [environ["HELPERS_WHEELHOUSE"]] if environ.get("HELPERS_WHEELHOUSE") else []
    wheels = find_wheels(extra + WHEEL_DIRS)
    steps = cold_start_plan(where, have, versions, wheels, find_checkout(os.getcwd()), platform.system())
    dry_run = environ.get("HELPERS_BOOTSTRAP_DRY_RUN") == "1"
    for why, args in steps:
        print(f"cold start ({where}): {why}\n  {'[dry run] ' if dry_run else ''}pip {shlex.join(args)}")
        if not dry_run:
            done = run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{why} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}\nOn Kaggle, turn "
                                   "Internet on or attach the dataset that `python -m helpers stage-kaggle` builds.")
    importlib.invalidate_caches()
    if not importable("triton") and not dry_run:
        raise RuntimeError(f"Triton is not installed here ({platform.system()}), and every kernel in this suite is "
                           "Triton, whose wheels are Linux-only. On macOS or Windows, open the notebook in Colab or "
                           "Kaggle (the badges at the top) or run it on Linux (WSL 2 works).")
    if importable("helpers"):
        import helpers.suite.bootstrap

        print(helpers.suite.bootstrap.environment_report(where))
    else:
        print("helpers is not installed yet (dry run): the report follows a real install.")


cold_start()

# %% tags=["parameters"]
profile = "auto"
quick = False  # True: two token counts instead of four, fewer timed calls
output_dir = "results/07_vocab_parallel"

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display
from matplotlib.ticker import FormatStrFormatter, NullFormatter

import helpers
from helpers.compare import theory
from helpers.compare.heads import QWEN3
from helpers.compare.units import format_bytes, timed_calls
from helpers.lab import parallel
from helpers.lab.plots import mark_smoke
from helpers.lab.profiles import SMOKE_NOTE, get_profile
from helpers.lab.training import write_json
from helpers.suite.report import write_report_fragment

started = time.perf_counter()
P = get_profile(profile, quick=quick)
S = P.section("07_vocab_parallel")
world = S["world"]
gpus = torch.cuda.device_count() if P.device == "cuda" else 0
on_gpus = P.device == "cuda" and gpus >= world  # NCCL, one GPU a rank
checks_only = P.device == "cuda" and not on_gpus  # a GPU profile on too few GPUs: the check only, ranks sharing
backend = "nccl" if on_gpus else "gloo"
info = helpers.device_info(P.torch_device)
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
problems, findings = [], []  # our faults (the notebook raises at the end) and what a run found


def save(fig, name):
    """Save a figure into the results, stamped as a smoke run where it is one."""
    if P.smoke:
        mark_smoke(fig)
    fig.savefig(out / name, dpi=120)


where = ("one GPU each" if on_gpus else f"sharing {gpus} GPU" if checks_only else "CPU processes") + f", {S['dtype']}"
print(f"profile {P.name}: {info.describe()}; {world} ranks over {backend} ({where})")
if checks_only:
    display(Markdown(f"**This notebook needs {world} GPUs; this machine has {gpus}.** It runs the correctness "
                     f"check with its {world} processes sharing the GPU (gloo, {S['dtype']}) and times "
                     "nothing. On Kaggle choose *GPU T4 x2*."))
elif P.smoke:
    print(SMOKE_NOTE)

# %% [markdown]
# ## What the ranks exchange
#
# Rank r holds C<sub>r</sub> = C[s<sub>r</sub> : s<sub>r</sub> + V<sub>r</sub>] (and its slice of
# a bias), every rank the same E (N × D) and targets x. For each row i it runs our forward on its
# slice, tile by tile, keeping what the single-device loss keeps:
# lse<sub>r,i</sub> = log Σ<sub>v ∈ r</sub> exp z<sub>i,v</sub>, and the target logit
# z<sub>i,x<sub>i</sub></sub> where x<sub>i</sub> falls in its slice. One `all_gather` of these two
# fp32 numbers a row (three with label smoothing: the slice's logit sum) gives every rank
#
# $$\mathrm{lse}_i = \log \sum_r e^{\mathrm{lse}_{r,i}}, \qquad
#   \ell_i = \mathrm{lse}_i - (1 - \epsilon_{ls})\, z_{i,x_i} - \frac{\epsilon_{ls}}{V} \sum_r \sum_{v \in r} z_{i,v}$$
#
# the same loss, to the bit, on every rank. The backward is our backward on the slice given the
# global lse: G<sub>r</sub> = S<sub>r</sub> − (1 − ε)[v = x<sub>i</sub>] − ε / V with
# S<sub>r</sub> = exp(z − lse), the indicator only where the rank owns the target. Then
# dC<sub>r</sub> = G<sub>r</sub><sup>T</sup> E is whole on rank r, and dE = Σ<sub>r</sub>
# G<sub>r</sub> C<sub>r</sub> is a sum over ranks: one `all_reduce` of N × D, or left partial
# (`dE_reduction="none"`) for a tensor-parallel layer that reduces it with its own.
# Logits never leave a rank, nor exist on one.

# %% [markdown]
# ## The memory arithmetic per rank
#
# At the Qwen3-0.6B head with N = 131,072 tokens on two ranks in bf16 (a T4's fp16 takes the same
# bytes): each rank's slice of the logits would be N × V<sub>r</sub> = 10<sup>10</sup> numbers,
# 19.9 GB in bf16, before its softmax in fp32. A vocabulary-parallel loss that builds them needs
# that on each GPU. Ours holds its inputs, their gradients and a few numbers a row; what a rank
# sends is 2 × N × 4 bytes (1 MiB) in the forward and dE (256 MiB) in the backward.

# %%
N_head, element_bytes = 131_072, 2  # bf16 (fp16 alike)
memory = parallel.memory_per_rank(N_head, QWEN3.V, QWEN3.D, world, element_bytes)
V_r = parallel.shard(QWEN3.V, world, 0)[1]
# Ours' working memory above the inputs (the formula notebook 02 checks), for an H200 in bf16:
# the single-device loss on the whole head against one rank's slice.
predicted = {"single device, whole C": theory.predicted_peak_bytes("ours", N_head, QWEN3.V, QWEN3.D, torch.bfloat16,
                                                                    (9, 0)),
             f"one rank of {world}, V_r = {V_r:,}": theory.predicted_peak_bytes("ours", N_head, V_r, QWEN3.D,
                                                                                 torch.bfloat16, (9, 0))}
display(Markdown(
    f"N = {N_head:,}, V = {QWEN3.V:,}, D = {QWEN3.D:,}, {world} ranks, {element_bytes} bytes an element\n\n"
    "| what | bytes |\n|---|---:|\n"
    + "\n".join(f"| {what} | {format_bytes(n)} |" for what, n in memory.items())
    + "\n\nPeak above the inputs of forward + backward, by ours' formula (dE and dC included) for an H200 in "
    "bf16, whatever this run's card\n\n"
    "| where | peak |\n|---|---:|\n"
    + "\n".join(f"| {where} | {format_bytes(n)} |" for where, n in predicted.items())))

# %% [markdown]
# A rank saves the (V − V<sub>r</sub>) × D of dC it does not hold and the slice of C: 0.16 GB each
# at this head. The point of the split is not the loss's own memory, which is small either way; it
# is that a model whose head is split across GPUs gets the loss without the 20 GB of logits a rank.

# %% [markdown]
# ## The same loss on every rank
#
# Each rank builds the same E, C and x from one seed, keeps its slice, and compares its loss, dE
# and dC<sub>r</sub> with our single-device loss on the whole C (on the same rank) and with float64
# (`helpers.spec.reference_loss_and_grads`). The cases: label smoothing and the soft cap with a
# tenth of the targets ignored; every target in rank 0's slice, so rank 1 owns none; dE left
# partial and summed by the caller. The first shape's V is odd, so the slices differ by a row. A
# rank passes where it is within the dtype's tolerance of the single-device loss and within
# max(that, 2 × the single-device loss's error) of float64.

# %%
check_records = parallel.launch(parallel.check_worker, world, S["check_shapes"], S["dtype"], folder=out / "check",
                                backend=backend)


def check_table(records):
    rows = ["| N, V, D | case | rank | V_r | targets owned | loss | dE | dC_r | |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        cells = " | ".join(f"{r[f'{q}_vs_single']:.1e} / {r[f'{q}_vs_float64']:.1e} (≤ {r['tolerance']:.0e} / "
                           f"{r[f'{q}_bound']:.1e})" for q in ("loss", "dE", "dC_r"))
        rows.append(f"| {r['N']:,}, {r['V']:,}, {r['D']:,} | {r['case']} | {r['rank']} | {r['V_r']:,} | {r['owned']:,} "
                    f"| {cells} | {r['status']} |")
    return "\n".join(rows)


display(Markdown(f"{S['dtype']}: relative error against the single-device loss / against float64 (bounds: the "
                 "dtype's tolerance / max(tolerance, 2x the single-device loss's own error))\n\n"
                 + check_table(check_records)))
failed = [r for r in check_records if r["status"] != "ok"]
for r in failed:
    problems.append(f"rank {r['rank']}, {r['case']} at N, V, D = {r['N']}, {r['V']}, {r['D']}: off the single-device "
                    f"loss or float64 (dE {r['dE_vs_single']:.1e} / {r['dE_vs_float64']:.1e})")
print(f"{len(check_records) - len(failed)} of {len(check_records)} rank checks pass")

# %% [markdown]
# The check can fail. Below, each rank holds the rows one further down the vocabulary than it says
# (C shifted by one row before slicing): the slices still tile the vocabulary, so the loss cannot
# refuse them, and its numbers are wrong. Each rank must fail.

# %%
shifted = parallel.launch(parallel.check_worker, world, S["check_shapes"][:1], S["dtype"],
                          ["smoothed, capped, ignored"], 1, backend=backend)
for r in shifted:
    print(f"rank {r['rank']}: dE off the single-device loss by {r['dE_vs_single']:.1e}, dC_r by "
          f"{r['dC_r_vs_single']:.1e}: {r['status']}")
if any(r["status"] != "FAIL" for r in shifted):
    problems.append("the check passed a split whose rows are shifted by one: it cannot tell right from wrong")

# %% [markdown]
# ## Time and peak per rank, against one device
#
# Each rank times forward + backward (dE all-reduced, dC<sub>r</sub>) at N tokens, then our
# single-device loss on the whole C at the same N on the same GPU: the median of the timed calls
# after warm-up, and the peak memory above the inputs (`helpers.compare.measure.measure`; every
# rank makes the same calls, so the collectives line up). Expect the vocabulary-parallel time near
# half the single-device time plus the exchange, and its peak lower by the part of dC the rank does
# not hold. A size that runs out of memory is a finding; sizes past the time budget are skipped
# (rank 0 decides, for every rank).

# %%
def arm_cell(r, arm):
    if r[f"{arm}_status"] != "ok":
        return r[f"{arm}_status"]
    return f"{r[f'{arm}_ms']:,.1f} ms, {format_bytes(r[f'{arm}_peak_mb'] * 2**20)}"


timing = []
if checks_only:
    print(f"not timed: {world} ranks need {world} GPUs, and this machine has {gpus}")
else:
    timing = parallel.launch(parallel.timing_worker, world, S["sizes"], S["V"], S["D"], S["dtype"], S["calls"],
                             S["budget_s"], folder=out / "timing", backend=backend)
    measured = sorted((r for r in timing if r["status"] == "ok"), key=lambda r: (r["N"], r["rank"]))
    for r in timing:
        if r["status"] != "ok":
            findings.append(f"rank {r['rank']}, N = {r['N']:,}: {r['status']}")
        for arm in ("vp", "single"):
            if r["status"] == "ok" and r[f"{arm}_status"] != "ok":
                findings.append(f"rank {r['rank']}, N = {r['N']:,}, {arm}: {r[f'{arm}_status']} ({r[f'{arm}_error']})")
    timing_table = (
        f"V = {S['V']:,}, D = {S['D']:,}, {S['dtype']}, {world} ranks: time ({timed_calls([S['calls']['repeats']])}), "
        "peak above the inputs\n\n"
        "| N per rank | rank | vocabulary-parallel | single device | single / vp |\n|---:|---:|---:|---:|---:|\n"
        + "\n".join(f"| {r['N']:,} | {r['rank']} | {arm_cell(r, 'vp')} | {arm_cell(r, 'single')} "
                     f"| {r.get('speedup', '')} |" for r in measured))
    display(Markdown(timing_table))
print("\n".join(f"finding: {f}" for f in findings))

# %%
if timing:
    fig, (ax_time, ax_peak) = plt.subplots(1, 2, figsize=(11, 4))
    for rank in range(world):
        for arm, label, style in (("vp", "vocabulary-parallel", "-"), ("single", "single device", "--")):
            points = [(r["N"], r[f"{arm}_ms"], r[f"{arm}_peak_mb"]) for r in timing
                      if r["rank"] == rank and r["status"] == "ok" and r[f"{arm}_status"] == "ok"]
            if points:
                Ns, ms, mb = zip(*points)
                ax_time.plot(Ns, ms, style, marker="o", color=f"C{rank}", label=f"{label}, rank {rank}")
                ax_peak.plot(Ns, mb, style, marker="o", color=f"C{rank}", label=f"{label}, rank {rank}")
    ax_time.set(xscale="log", yscale="log", xlabel="tokens N per rank", ylabel=f"forward + backward, ms ({timed_calls([S['calls']['repeats']])})",
                title=f"Time: V = {S['V']:,}, D = {S['D']:,}, {S['dtype']}")
    ax_peak.set(xscale="log", yscale="log", xlabel="tokens N per rank", ylabel="peak above the inputs, MB",
                title=f"Peak memory per rank ({world} ranks, {backend})")
    for ax in (ax_time, ax_peak):
        ax.set_xticks(S["sizes"], [f"{n:,}" for n in S["sizes"]], minor=False)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax_time.legend(fontsize=8)
    ax_peak.legend(fontsize=8)
    fig.tight_layout()
    save(fig, "vocab_parallel.png")

# %% [markdown]
# ## Results

# %%
# The headline's rank: the slowest at the largest N timed (a step waits for it), not a chosen one.
largest = max((r for r in timing if r["status"] == "ok" and r.get("speedup")), key=lambda r: (r["N"], r["vp_ms"]),
              default=None)
checked = "every rank passes" if not failed else f"{len(failed)} rank checks FAIL"
if largest and P.smoke:  # a smoke run's times measure the interpreter or a toy shape: not a headline
    headline = (f"{world} ranks over {backend}, {S['dtype']}: {checked} against one device and float64; timed as "
                "a smoke run only (its table, not a measurement)")
elif largest:
    headline = (f"{world} ranks over {backend}, {S['dtype']}: {checked} against one device and float64; at "
                f"{largest['N']:,} tokens the slowest rank {arm_cell(largest, 'vp')} against one device's "
                f"{arm_cell(largest, 'single')} (every rank: the timing table)")
else:
    headline = (f"{world} ranks over {backend} ({where}): {checked} against one device and float64; not timed "
                f"(needs {world} GPUs, found {gpus})")
results = {
    "profile": P.name, "device": info.as_dict(), "world": world, "backend": backend, "checks_only": checks_only,
    "memory_per_rank": {"N": N_head, "V": QWEN3.V, "D": QWEN3.D, "bytes": memory, "predicted_peak_bytes": predicted},
    "check": check_records, "shifted_rows_check": shifted, "timing": timing,
    "findings": findings, "problems": problems, "seconds": time.perf_counter() - started,
}
write_json(out / "results.json", results)
write_report_fragment(out, f"""
{"**Not timed: this machine has fewer GPUs than ranks; the check ran with the ranks sharing its GPU.**" if checks_only else ""}

### Against one device and float64 ({S['dtype']}): relative errors, single-device / float64

{check_table(check_records)}

- A split whose rows are shifted by one: {", ".join(f"rank {r['rank']} {r['status']}" for r in shifted)} (must fail).
- Per rank at the Qwen3-0.6B head, {N_head:,} tokens, {world} ranks (arithmetic): the logit slice never built
  {format_bytes(memory["the rank's logit slice, never built (N x V_r)"])}; sent
  {format_bytes(memory["all_gather of lse_r and the owned target logit (fp32, sent)"])} in the forward and
  {format_bytes(memory["all_reduce of dE"])} in the backward.
{chr(10).join('- Finding: ' + f for f in findings)}

{timing_table if timing else ""}

{"![Time and peak per rank](vocab_parallel.png)" if timing else ""}
""", headline=headline, smoke=P.smoke)
plt.close("all")
print(headline)
print(f"results in {out} ({results['seconds']:.0f} s)")
if problems:
    raise AssertionError("\n".join(problems))
