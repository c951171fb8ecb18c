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
# # 03 · Does the fast loss train the same model? A convergence A/B
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/03_convergence.ipynb) [![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)](https://kaggle.com/kernels/welcome?src=https://github.com/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/03_convergence.ipynb)
#
# A faster loss that is subtly wrong corrupts every optimizer step. The correctness gate
# (notebook 01) compares one batch's loss and gradients with a float64 reference; it cannot see
# an error that only matters summed over thousands of steps, such as a gradient that is dropped
# whenever it is small. So here we train, and compare training curves.
#
# **Part 1, fine-tuning A/B (the article's).** The same model, data and seed, trained once with
# the exact loss (fp32 logits) and once with each fused method. The article ran this with one
# fused kernel and found indistinguishable curves. Here every method that runs on this machine
# takes part. The bound is calibrated, as the correctness gate calibrates its own, on the plain
# low-precision loss (the naive arm). A peer that drifts beyond it is a finding, reported and
# explained; **the notebook fails** (at its last cell, after every result is saved) only when our
# own code does: our kernel, the chunked loss or the exact arm itself.
#
# **Part 2, pretraining A/B (the missing one).** Cut Cross-Entropy skips the gradient of every
# logit tile whose softmax entries all fall below eps = 2<sup>-12</sup> (in bf16). Its published
# evidence that this costs nothing comes from fine-tuning only. The CCE paper itself reports that
# in pretraining the filter starves rare tokens of gradient, and recommends "CCE-Kahan-FullC" there:
# Kahan summation in the gradient accumulators, and no filter on dC. We train a small language
# model from scratch on real text, over several seeds, and measure the mechanism directly: loss on
# rare tokens, and how far their classifier rows moved.
#
# The pretraining arms, each against the exact loss on the same seeds:
# - **ours**, filter on (the default) and off. Our filter skips a tile only when every row's
#   *summed* |G| over it is below eps, where the paper's rule bounds each entry: on a flat softmax
#   (an untrained model's, ~1/V per entry) each entry is tiny while the tile together carries real
#   gradient (notebook 04 shows both rules on one). We count, at every step, the share of logit
#   tiles it skipped.
# - **Liger**, the most used fused loss, which has no filter: the control.
# - **Apple CCE** as it ships (filter on), and with its filter off. The paper's Kahan-FullC is
#   Apple's own code (`impl="cce_kahan_full_c"`, GitHub 25.6 and later). The `cut-cross-entropy`
#   on PyPI (25.1.1) is a fork of 24.12.1 without it: no Kahan summation, no fp32 accumulation, no
#   filter for one gradient only. Where that version is installed, the Kahan-FullC arm is listed
#   as not run, with why, and "filter off" (dC *and* dE unfiltered, still accumulated in bf16) is
#   the nearest arm it offers.
#
# **Run time:** about a minute on a CPU (the smoke profile: tiny shapes, Triton under its
# interpreter; it checks the pipeline and supports no conclusion). On an H200 about 5 minutes
# (estimated: 3.5 measured there before Liger and Apple's filter-off arm joined pretraining). On a
# T4 not measured: expect several times that. `quick = True` runs a third of the steps of both
# parts: on an H200 about 2 minutes (estimated).

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

# %%
import copy
import math
import os
import time
import warnings

notebook_start = time.perf_counter()

# cuBLAS picks its reduction order by workspace; fixing the workspace (before the first cuBLAS
# call) is what makes a GPU run repeat exactly, as a CPU run does.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from pathlib import Path

import matplotlib.pyplot as plt
import torch

import helpers
from helpers.cce.device import pretended_card
from helpers.compare import verdicts
from helpers.compare.methods import METHODS, get_method
from helpers.lab import convergence, step_time, training
from helpers.compare.corpus import load_or_build_corpus, summary_lines
from helpers.lab.plots import (
    mark_smoke,
    plot_filter_skipped,
    plot_finetune_ab,
    plot_pretrain_curves,
    plot_rank_frequency,
    plot_rare_token_diagnostic,
)
from helpers.lab.profiles import SMOKE_NOTE, get_profile
from helpers.suite.report import write_report_fragment

# %% tags=["parameters"]
profile = "auto"
quick = False  # True: a short run (a third of the steps), minutes instead of the full picture
output_dir = "results/03_convergence"
# Overrides of the profile's sizes; None keeps the profile's value.
finetune_steps = None
pretrain_steps = None
seeds = None  # a list, e.g. [0, 1, 2]
vocab_size = None
tolerance = None  # the fine-tuning verdict's bound on |loss - exact| / exact; None: calibrated on naive

# %%
P = get_profile(profile, quick=quick)
S = copy.deepcopy(P.section("03_convergence"))  # the overrides below must not edit the profile table
FT, PT = S["finetune"], S["pretrain"]
FT["train"]["steps"] = finetune_steps or FT["train"]["steps"]
PT["train"]["steps"] = pretrain_steps or PT["train"]["steps"]
PT["seeds"] = seeds or PT["seeds"]
PT["corpus"]["vocab_size"] = vocab_size or PT["corpus"]["vocab_size"]
device = P.torch_device
dtype = getattr(torch, S["compute_dtype"])
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
# Deterministic kernels wherever torch has them (the embedding backward on a GPU, for one); a
# Triton kernel that adds with atomics (Apple CCE's bf16 dE) stays outside this switch. The switch
# would also fill every torch.empty with NaN, which a kernel that reads masked-off scratch could
# turn into a NaN loss: that part stays off. Its warnings name ops without a deterministic kernel;
# the "exact (repeat)" control below measures whether a run repeats, so they are silenced.
torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = False
warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation")
crashed = []  # (method, what happened) for a method that raised: our fault or a peer's finding
smoke = f"{SMOKE_NOTE} " if P.smoke else ""  # leads every verdict of a smoke run


def save(fig, name):
    """Save a figure into the results, stamped as a smoke run where it is one."""
    if P.smoke:
        mark_smoke(fig)
    fig.savefig(out / name, dpi=120)


print(f"profile {P.name}: {helpers.device_info(device).describe()}, training in {S['compute_dtype']}")
if P.smoke:
    print(SMOKE_NOTE)

# %% [markdown]
# ## Precision: where a filter can act
#
# Every arm runs the model body under autocast in the profile's dtype. The parameters stay fp32:
# they are the optimizer's master weights. We chose autocast over bf16 parameters because a bf16
# weight cannot take an Adam step smaller than its own rounding. That alone would starve rare rows
# and hide the filter's effect. E (N×D) and C (V×D) are cast to the compute dtype right before the
# loss, so every arm receives *the same* low-precision E and C, and the loss is the one line that
# differs. The exact arm upcasts them and builds fp32 logits.
#
# The filter's threshold follows the dtype and the vocabulary: 2<sup>-12</sup> per 256 columns in
# bf16 (Ampere and newer GPUs), 2<sup>-15</sup> in fp16 (a T4), lowered past 8,192 classes so that
# a row loses at most 2<sup>-7</sup> (bf16) or 2<sup>-10</sup> (fp16) of its gradient's mass over the
# whole vocabulary (the cell below prints it). In fp32 (this suite's CPU run) "auto" turns it off, so there
# "ours" and "ours (filter off)" are the same computation and the pretraining A/B can show no filter
# effect. The CPU profile checks that the pipeline runs, not what the filter does.

# %%
labels = {name: method.label for name, method in METHODS.items()}
reasons = {name: get_method(name).why_unavailable(device, dtype) for name in dict.fromkeys(FT["methods"] + PT["methods"])}
for name, reason in reasons.items():
    print(f"{labels[name]:<26} {'runs here' if reason is None else 'not here: ' + reason}")
# The dense backwards' threshold per 256 columns falls with the vocabulary (a row drops at most a
# fixed share of its gradient's mass); the fine-tuning task's vocabulary is the one shown.
filter_eps = training.filter_threshold(dtype, FT["task"]["V"]) if reasons["ours"] is None else None
print(f"\nour filter threshold in {S['compute_dtype']} at {FT['task']['V']:,} classes: "
      + (f"2^{math.log2(filter_eps):.0f} = {filter_eps:.3g}" if filter_eps else "off"))
print("\nthe margins every verdict below is judged by, their rules fixed before training:")
print("\n".join(f"- {m}" for m in verdicts.margins_text()[1:3]))

# %% [markdown]
# ## Part 1 · Fine-tuning A/B
#
# The task is the top of a frozen model: fixed synthetic features feed a trainable last layer, then
# the classifier. Targets come from a Zipf-skewed teacher, so the softmax is as peaked as a trained
# LM's and most of its entries fall below the filter's threshold. Every arm starts from the same
# weights and sees the same batches.
#
# Why a last layer and not the classifier alone, as in the article? With E a constant (no gradient
# needed), Liger computes no dC at all, and the classifier never trains. The check below shows it
# wherever Liger runs: a user fine-tuning only `lm_head` on a frozen body must not use Liger 0.8.5.

# %%
ft_task = training.FineTuneTask(**FT["task"])
liger_skips_dC = None  # whether Liger left dC empty with E a constant (None: Liger did not run)
if reasons["liger"] is None:
    E = torch.randn(8, FT["task"]["D"], device=device, dtype=dtype)  # no requires_grad: a constant
    C = torch.zeros(FT["task"]["V"], FT["task"]["D"], device=device, dtype=dtype, requires_grad=True)
    get_method("liger")(E, C, torch.zeros(8, dtype=torch.long, device=device)).backward()
    liger_skips_dC = C.grad is None
    print("Liger, E without gradient: dC is", "None (the classifier would not train)" if liger_skips_dC else "computed")

# %% [markdown]
# ### fp16: gradients a loss scale cannot reach
#
# A T4 trains in fp16, and every fp16 trainer scales the loss (`GradScaler` starts at
# 2<sup>16</sup>) so that small gradients survive fp16's range, dividing the scale out before the
# optimizer step. That works only if the scale reaches every fp16 number of the backward pass. The
# gradient of a mean loss with respect to a logit is (softmax − onehot) / N: with V = 32,768 and
# N = 4,096 a typical entry is far below fp16's smallest subnormal, 2<sup>-24</sup> ≈ 6·10<sup>-8</sup>.
# A loss that forms its gradients during the *forward* pass, as Liger does, rounds them to fp16
# before the scale exists; the scale multiplies zeros later. One batch, one backward, at the
# scaler's initial 2<sup>16</sup>, in fp16 whatever this run trains in:

# %%
scale_check_names = [n for n in ("exact", "ours", "liger", "chunked") if get_method(n).why_unavailable(device, torch.float16) is None]
scale_check = convergence.loss_scale_check(ft_task, scale_check_names, device=device)
print(f"entries of softmax / N that are 0 in fp16: {next(iter(scale_check.values()))['underflow']:.1%}")
print(f"{'loss':<26} {'classifier rows with no gradient':>34} {'dC error':>10} {'dE error':>10}")
for name, c in scale_check.items():
    print(f"{labels[name]:<26} {c['zero_rows']:>34.1%} {c['dC_error']:>10.2e} {c['dE_error']:>10.2e}")

# %% [markdown]
# How to read it: the exact, chunked and our arms hand back gradients about as accurate as fp16
# storage allows; a loss that rounded G/N to fp16 before the scale lost every entry below
# 2<sup>-24</sup>, a systematic loss of the softmax's small mass (and where a row's entries are all
# that small, the whole row: the first column). The error is not noise that averages out: each
# step pushes the same way, and over a run the loss drifts from exact (on an H200 in fp16 at the
# T4 profile's sizes: Liger's dC and dE 100× less accurate here, and its loss 14% off exact after
# 300 steps). Ours keeps G = softmax − onehot unscaled through the fp16 products and applies 1/N
# and the loss scale to their fp32 results; the exact and chunked arms form their gradients in
# fp32. In bf16, whose range is fp32's, the same underflow does not happen.

# %%
ft_runs = {}
for name in [n for n in FT["methods"] if reasons[n] is None]:
    try:
        ft_runs[name] = training.train(ft_task, name, compute_dtype=dtype, device=device, **FT["train"])
    except Exception as error:  # recorded, judged at the end; the other arms still run
        crashed.append((name, f"fine-tuning: {labels[name]} crashed: {type(error).__name__}: {error}"))
        print(crashed[-1][1])
        continue
    print(f"{labels[name]:<26} {ft_runs[name].wall_s:7.1f} s   final loss {ft_runs[name].train_loss[-1]:.5f}")
# The same arm twice: the A/B means something only if a run repeats itself.
ft_repeat = training.train(ft_task, "exact", compute_dtype=dtype, device=device, **FT["train"])

# %% [markdown]
# The verdict (the verdict engine's, `helpers.compare.verdicts`): the largest relative difference
# from the exact arm's loss over all steps must stay within the bound. The bound is calibrated as
# the correctness gate calibrates its own: twice the drift of the naive arm (logits multiplied in the compute dtype, then upcast: the loss a trainer
# writes without thinking about precision), so that it measures what the dtype's rounding does to
# a whole run. A floor per dtype (10<sup>-4</sup> in fp32, 10<sup>-3</sup> in fp16,
# 4·10<sup>-3</sup> in bf16) keeps it from collapsing where naive is exact, as in fp32.

# %%
exact_losses = ft_runs["exact"].train_loss
yardstick = convergence.max_relative_drift(ft_runs["naive"].train_loss, exact_losses) if "naive" in ft_runs else math.nan
tolerance = tolerance or verdicts.finetune_bound(yardstick, S["tolerance_floor"])
finetune = {"exact (repeat)": verdicts.finetune_outcome(ft_repeat.train_loss, exact_losses, tolerance)}
finetune |= {name: verdicts.finetune_outcome(run.train_loss, exact_losses, tolerance)
             for name, run in ft_runs.items() if name not in ("exact", "naive")}  # naive: the bound's yardstick
finetune_drift = {name: o.drift for name, o in finetune.items()}
print(f"{smoke}bound: {tolerance:.2g} = max(floor {S['tolerance_floor']:g}, {verdicts.SLACK:g} x naive's drift "
      f"{yardstick:.2g}) in {S['compute_dtype']}")
for name, o in finetune.items():
    print(f"{labels.get(name, name):<26} max drift {o.drift:9.2e}   {verdicts.part_phrase(o)}")
for name in FT["methods"]:
    if reasons[name]:
        print(f"{labels[name]:<26} not run: {reasons[name]}")
finetune_failures = [name for name, o in finetune.items() if o.verdict != verdicts.EQUIVALENT]

# %%
fig = plot_finetune_ab(ft_runs, labels, tolerance)
save(fig, "finetune_ab.png")

# %% [markdown]
# ## Part 2 · Pretraining A/B on real text
#
# The corpus is the Python standard library's own source, on every machine without a download:
# code, comments and docstrings, split into words and punctuation. The vocabulary keeps the most
# frequent training types. Its tail holds identifiers seen a handful of times: the rare tokens
# whose classifier rows a filter might starve. Ids follow frequency, so rare tokens share
# vocabulary tiles: the layout where a tile filter skips the most, which the paper's vocabulary
# sorting arranges on purpose. The corpus is built once, deterministically (sorted files, a fixed
# split by file), and cached outside the results (`~/.cache/helpers/corpus`).

# %%
corpus = load_or_build_corpus(None, **PT["corpus"])
corpus_summary = corpus.describe()
print("\n".join(summary_lines(corpus_summary)))

# %%
fig = plot_rank_frequency(corpus.type_counts, len(corpus.vocab))
save(fig, "corpus_long_tail.png")

# %% [markdown]
# The model predicts each token from the few before it: embeddings of the context, an MLP and a
# LayerNorm give E, and the classifier C (not tied to the embeddings) gives the logits. Adam without
# weight decay: a classifier row that receives no gradient does not move at all. Validation always
# uses the exact fp32 loss, whatever loss the arm trained with.

# %%
lm_task = training.CorpusLMTask(corpus, **PT["task"])
pt_methods = [name for name in PT["methods"] if reasons[name] is None]
pt_runs = {name: [] for name in pt_methods}
for seed in PT["seeds"]:
    for name in pt_methods:
        try:
            run = training.train(lm_task, name, seed=seed, compute_dtype=dtype, device=device, **PT["train"])
        except Exception as error:
            crashed.append((name, f"pretraining, seed {seed}: {labels[name]} crashed: {type(error).__name__}: {error}"))
            print(crashed[-1][1])
            continue
        pt_runs[name].append(run)
        print(f"seed {seed}  {labels[name]:<26} {run.wall_s:7.1f} s   val loss {run.val_loss[-1]:.4f}")
# An arm compares with exact seed by seed, so it keeps only complete sets of seeds.
pt_runs = {name: runs for name, runs in pt_runs.items() if len(runs) == len(PT["seeds"])}
for name in PT["methods"]:
    if reasons[name]:
        print(f"{labels[name]:<26} not run: {reasons[name]}")

# %% [markdown]
# ### Is our filter filtering anything?
#
# "Filter on, no difference from exact" means something only if the filter skips work. At every
# step our backward counts the logit tiles whose gradient the filter dropped. Two things to know
# when reading it. The filter can act only where the softmax is peaked: an untrained model's is
# flat, so early steps skip nothing, whatever the rule. And in the backward these runs use ("gemm", which
# the default "auto" runs at these sizes) the filter zeroes the skipped tiles of G, but the two products
# that follow still multiply them: **that filter buys no speed**, whatever share it skips. It is there to match the paper's
# arithmetic (and for the "atomic" backward, which does skip the products). The sparse
# backward (`backward_impl="sparse"`, the registry's `ours_sparse`) is the one that turns skipping
# into time, deciding per row from bits the forward keeps (on an H200 it took 34.7 ms against the
# "gemm"'s 59.1 at the Gemma-2-2B head on realistic inputs, `docs/PERFORMANCE.md`; "auto" picks it where it pays); it is not an arm of these runs: a
# step here (at most 4,096 tokens over a 32,768-word vocabulary, about a million (row, tile) pairs)
# is below the ~8 million where its index starts to pay, so it would run "gemm".

# %%
filter_skips = {}  # "part/arm": what our filter skipped, per step (convergence.filter_skip_summary)
skip_series = {}  # the figure's lines: label -> fraction skipped per step
skip_lines = []  # the same, in words
for part, runs_of_part in (("fine-tuning", {n: [r] for n, r in ft_runs.items()}), ("pretraining", pt_runs)):
    for name, runs in runs_of_part.items():
        summary = convergence.filter_skip_summary(runs)
        if summary is None:
            continue
        filter_skips[f"{part}/{name}"] = summary
        skip_series[f"{part}, {labels[name]}" + (f", seed {runs[0].seed}" if len(runs) > 1 else "")] = runs[0].filter_skipped
        skip_lines.append(f"{labels[name]} in {part}: on average {summary['mean']:.1%} of logit tiles skipped per "
                          f"step (first step {summary['first']:.1%}, last {summary['last']:.1%}, "
                          f"at most {summary['max']:.1%} in one step)")
        print(smoke + skip_lines[-1])
if skip_series:
    fig = plot_filter_skipped(skip_series)
    save(fig, "filter_skipped.png")

# %%
fig = plot_pretrain_curves(pt_runs, labels)
save(fig, "pretrain_curves.png")

# %% [markdown]
# ## The mechanism: rare tokens
#
# Vocabulary entries are binned by how often they occur in the training split. For each bin we
# measure the final validation loss on tokens of that bin, and how far the bin's classifier rows
# moved from their initialisation. Under a filter, a rare row gets a gradient only when its tile
# holds a large enough entry (a target landing there, say). The exact loss gives it a small
# push-down on every step.
#
# Each arm is compared with the exact arm seed by seed: the arms of one seed share their initial
# weights and batches, so the per-seed difference isolates the loss. The verdict engine
# (`helpers.compare.verdicts`) judges each difference against a practical margin declared before
# the run, δ = max(0.005 nats, half the exact arm's seed-to-seed spread): *equivalent* when the
# 90% interval of the mean difference lies inside ±δ, *better* or *worse* only when the whole 95%
# interval lies beyond δ, *undecided* otherwise (too few seeds to tell). A difference inside the
# margin disqualifies nothing. The sentences below are the engine's.

# %%
type_bins, bin_labels = convergence.frequency_bins(corpus.train_counts)
_, val_targets = lm_task.validation_set()
diagnostic = convergence.rare_token_diagnostic(pt_runs, type_bins, val_targets, len(bin_labels))
fig = plot_rare_token_diagnostic(diagnostic, bin_labels, labels, uniform_loss=math.log(len(corpus.vocab)))
save(fig, "rare_tokens.png")

# %%
comparisons, findings = convergence.pretraining_findings(pt_runs, diagnostic, bin_labels, labels)
pretrain = {name: verdicts.Outcome.from_dict(o) for name, o in comparisons["final_val_loss"].items()}
rare_reading = convergence.describe_rare_tokens(diagnostic, comparisons["bins"], bin_labels, len(corpus.vocab), labels)
bins_md = convergence.bin_table(comparisons["bins"]["val_loss"], bin_labels, labels)
print(smoke + "\n".join(findings + ["", "validation loss against exact, per frequency bin (nats):", bins_md, ""]
                         + rare_reading))

# %% [markdown]
# How to read the rare-token result. The exact loss pushes a rare token's logit down at every step
# in which it is not the target, which is nearly every step; it is seldom pulled back up. So exact
# training can end *worse than uniform guessing* on the rarest tokens. A filter that drops those
# small push-downs leaves the rows nearer where they started, so it can score *better* than exact
# there, and pay instead on tokens of middling frequency, whose gradients it also thins. "The
# filter starves rare tokens" is then true of the gradient, not of the rarest tokens' loss: read
# the final validation loss, over all tokens, for the verdict.
#
# "Better" here is a direction, not a recommendation on its own: a loss whose gradients are less
# accurate can land lower by chance of its errors' direction. The verdict engine recommends a method
# that trains "better" only where its gradients also pass 01's float64 gate, as it does one that
# trains "like exact" (Apple CCE's bf16 dE fails that gate, so a lower loss does not make it
# recommended; its filter-off arm, which sends more small terms through the same bf16 accumulation,
# can end higher: the table above says where it ended in this run).

# %% [markdown]
# ## Speed
#
# What each arm costs per training step, timed apart from the runs above and the same way for
# every arm (`helpers.lab.step_time`): the model, optimizer and batches of the runs; the same
# untimed warm-up steps first, where Triton compiles and autotunes; no arm counting skipped tiles;
# the median of several steps. The runs' own times could not say it: a fine-tuning arm ran once,
# with its compilation inside its time, and only our arm read its skip counts back at every step.
#
# These are training-step times at this notebook's sizes, where the exact arm's logits fit in
# memory: the price of the memory saving at small shapes, not a benchmark at scale (notebook 02
# has that). A fused loss launches several kernels per call, and at small shapes the host can take
# longer to launch them than the GPU to run them. So each arm's loss (forward and backward) is
# also called back to back: the host's time per call against the GPU's busy time. Where the host's
# is at least the GPU's, the arm is host-bound: its ratio measures launch latency more than its
# kernels. On a CPU the Triton arms run under an interpreter and host and device are one: the
# times say nothing about a GPU.

# %%
timing = S["timing"]  # warm-up steps, timed steps and loss calls: the same for every arm
speed = {}  # part -> arm -> step_time.time_training_steps's numbers, with "vs_baseline"
for part, task, arms, lr in (("fine-tuning", ft_task, ft_runs, FT["train"]["lr"]),
                             ("pretraining", lm_task, pt_runs, PT["train"]["lr"])):
    timed = {}
    for name in arms:
        try:
            timed[name] = step_time.time_training_steps(task, name, compute_dtype=dtype, device=device, lr=lr, **timing)
        except Exception as error:  # recorded, judged with the rest below
            crashed.append((name, f"{part} step timing: {labels[name]} crashed: {type(error).__name__}: {error}"))
            print(crashed[-1][1])
    speed[part] = step_time.against_baseline(timed)
card = pretended_card() if device.type == "cuda" else None  # a CPU's pretence is the tier only
speed_reading = {part: step_time.describe_step_times(part, times, labels, pretend=card.label if card else None)
                 for part, times in speed.items()}
for part, times in speed.items():
    print(f"{smoke}{part}: step time against exact's")
    print(f"  {'loss':<26} {'median ms':>10} {'vs exact':>9} {'host ms/call':>13} {'GPU ms/call':>12}")
    for name, t in times.items():
        gpu_ms = "—" if math.isnan(t["device_ms"]) else f"{t['device_ms']:.2f}"
        print(f"  {labels[name]:<26} {1e3 * t['median_s']:10.2f} {t['vs_baseline']:8.2f}x {t['host_ms']:13.2f} "
              f"{gpu_ms:>12}  {'host-bound' if t['host_bound'] else ''}")
    print(*speed_reading[part], sep="\n")
# The trade-off an engineer weighs: time saved (or spent) against the loss it costs.
trade_offs = [f"{labels[name]}: {speed['pretraining'][name]['vs_baseline']:.2f}x exact's pretraining step time; "
              f"{o.describe()}"
              for name, o in pretrain.items() if o.verdict != verdicts.EQUIVALENT and name in speed["pretraining"]]
print("\n".join([smoke + "where the loss is not equivalent to exact's:", *trade_offs]) if trade_offs
      else smoke + "every arm's final validation loss is equivalent to exact's")

# %% [markdown]
# Our faults and peers' findings: a drift past the bound or a crash of our own code stops the
# notebook below; a peer's is reported here and in the REPORT, with what explains it where this
# notebook measured the cause.

# %%
drifted = [(name if name != "exact (repeat)" else "exact",
            f"fine-tuning: {labels.get(name, name)} drifted {finetune_drift[name]:.3g} from exact (bound {tolerance:.2g})")
           for name in finetune_failures]
# Our own arms must not train worse than exact in pretraining either.
drifted += [(name, f"pretraining: {labels[name]} {verdicts.trains_phrase(o.verdict)}: {o.describe()}")
            for name, o in pretrain.items() if o.verdict == verdicts.WORSE and get_method(name).kind != "peer"]
our_faults, peer_findings = convergence.split_faults(drifted + crashed)
liger_fp16_underflow = False
for name, c in scale_check.items():
    worse = max(c["dC_error"] / scale_check["exact"]["dC_error"], c["dE_error"] / scale_check["exact"]["dE_error"])
    if worse > 10 and get_method(name).kind == "peer":
        liger_fp16_underflow |= name == "liger"
        peer_findings.append(
            f"{labels[name]} under fp16 loss scaling: dC error {c['dC_error']:.1e}, dE error {c['dE_error']:.1e}, "
            f"{worse:.0f}x the exact arm's on the same batch; {c['underflow']:.0%} of the entries of softmax / N are 0 "
            "in fp16, and it rounds its gradients to fp16 in the forward pass, before the loss scale can reach "
            "them (see the loss-scale check)")
if liger_skips_dC:
    peer_findings.append(f"{labels.get('liger', 'Liger')} with E that needs no gradient (a frozen body): dC is None, so "
                         "an lm_head trained on it does not train (the check above)")
print(smoke + ("peers' findings:" + "".join(f"\n- {f}" for f in peer_findings) if peer_findings else "peers: nothing to report"))
print(smoke + ("our faults:" + "".join(f"\n- {f}" for f in our_faults) if our_faults else "ours: no fault"))

# %%
headline = convergence.convergence_headline({n: o for n, o in finetune.items() if n != "exact (repeat)"}, pretrain, labels)
caveats = {"liger": [], "ours": []}
if liger_skips_dC:
    caveats["liger"].append("computes no dC when E needs no gradient: an lm_head trained on a frozen body does not train")
if liger_fp16_underflow:
    caveats["liger"].append("in fp16 it rounds its gradients before the loss scale applies: entries below 2^-24 are lost")
if filter_skips:
    mean, most = max(s["mean"] for s in filter_skips.values()), max(s["max"] for s in filter_skips.values())
    caveats["ours"].append(f"filter skipped {mean:.1%} of tiles per step on average ({most:.1%} at most); "
                           "saves no time in the gemm backward" if most > 0 else
                           "its gradient filter skipped no tile in these runs")
facts = convergence.convergence_facts({n: o for n, o in finetune.items() if n != "exact (repeat)"}, pretrain,
                                   S["compute_dtype"], labels, not_run={n: r for n, r in reasons.items() if r},
                                   caveats=caveats)
results = {
    "profile": P.name,
    "smoke": P.smoke,
    "device": helpers.device_info(device).as_dict(),
    "compute_dtype": S["compute_dtype"],
    "filter_eps": filter_eps,
    "headline": headline,
    "unavailable": {name: reason for name, reason in reasons.items() if reason},
    "crashed": [problem for _, problem in crashed],
    "our_faults": our_faults,
    "peer_findings": peer_findings,
    "loss_scale_check": scale_check,
    "liger_skips_dC_without_E_grad": liger_skips_dC,
    "filter_skipped": filter_skips,
    "facts": facts,
    "finetune": {
        "settings": FT,
        "tolerance": tolerance,
        "tolerance_floor": S["tolerance_floor"],
        "naive_drift": yardstick,
        "runs": {name: run.summary() for name, run in ft_runs.items()},
        "max_relative_drift": finetune_drift,
        "outcomes": {name: o.as_dict() for name, o in finetune.items()},
        "failures": finetune_failures,
    },
    "pretrain": {
        "settings": PT,
        "corpus": corpus_summary,
        "runs": {name: [run.summary() for run in runs] for name, runs in pt_runs.items()},
        "bins": bin_labels,
        "types_per_bin": torch.bincount(type_bins[type_bins >= 0], minlength=len(bin_labels)).tolist(),
        "diagnostic": diagnostic,
        "comparisons": comparisons,
        "findings": findings,
        "rare_token_reading": rare_reading,
    },
    "step_time": speed,
    "step_time_reading": speed_reading,
    "wall_s": {
        "notebook": time.perf_counter() - notebook_start,
        "finetune": {name: run.wall_s for name, run in ft_runs.items()},
        "pretrain": {name: [run.wall_s for run in runs] for name, runs in pt_runs.items()},
    },
}
training.write_json(out / "results.json", results)
note = f"*{SMOKE_NOTE}*\n\n" if P.smoke else ""
drift_rows = "\n".join(f"| {labels.get(name, name)} | {o.drift:.2e} | {verdicts.part_phrase(o)} |"
                       for name, o in finetune.items())
speed_rows = "\n".join(
    f"| {labels[name]} | " + " | ".join(
        f"{part[name]['vs_baseline']:.2f}x ({1e3 * part[name]['median_s']:.3g} ms) | {part[name]['host_ms']:.3g} / "
        f"{'—' if math.isnan(part[name]['device_ms']) else format(part[name]['device_ms'], '.3g')}"
        f"{' host-bound' if part[name]['host_bound'] else ''}" if name in part
        else "not run | " for part in speed.values()) + " |"
    for name in dict.fromkeys([*speed["fine-tuning"], *speed["pretraining"]]))
not_run = "".join(f"\n- {labels[name]}: {reason}" for name, reason in results["unavailable"].items())
write_report_fragment(out, f"""
### Fine-tuning A/B ({S["compute_dtype"]})

{note}Largest per-step |loss - exact| / exact; the bound {tolerance:.2g} is max(floor {S["tolerance_floor"]:g}, {verdicts.SLACK:g} x the naive arm's drift {yardstick:.2g}).

| method | max drift | verdict |
|---|---:|---|
{drift_rows}

![Fine-tuning: the last steps, and the drift from exact](finetune_ab.png)

Peers' findings:{"".join(chr(10) + "- " + f for f in peer_findings) or " none"}

### Pretraining A/B on the standard-library corpus

{note}Final validation loss, each arm against exact, paired by seed; judged against the margin δ = max(0.005 nats, half of exact's seed-to-seed spread in this run), a rule fixed before the run:
{"".join(chr(10) + "- " + f for f in findings)}

Validation loss against exact per frequency bin (nats; mean paired difference ± 95% interval; the verdict where not equivalent):

{bins_md}

{chr(10).join("- " + r for r in rare_reading)}

What our filter skipped (it saves no time in the gemm backward):{"".join(chr(10) + "- " + s for s in skip_lines) or " no arm of ours ran"}

![Validation loss across seeds](pretrain_curves.png)
![Rare-token diagnostic](rare_tokens.png)

### Speed

{note}Training-step time as a multiple of the exact arm's, each arm timed apart after the same untimed warm-up ({timing["warmup"]} step{"s" if timing["warmup"] != 1 else ""}), without skip counting, the median of {timing["repeats"]} steps; and per loss call (forward and backward), the host's time against the GPU's busy time, in ms:

| method | fine-tuning step | host / GPU ms | pretraining step | host / GPU ms |
|---|---:|---:|---:|---:|
{speed_rows}

{"".join(chr(10) + "- " + line for lines in speed_reading.values() for line in lines)}
{"".join(chr(10) + "- " + t for t in trade_offs)}

Not run here:{not_run or " none"}
""", headline=headline, facts=facts, smoke=P.smoke)
plt.close("all")
print(f"results and figures in {out}")

# %% [markdown]
# ## Verdict
#
# Both parts in one place. The notebook fails here if our kernel, the chunked loss or the exact arm
# drifted beyond the bound in the fine-tuning A/B, or crashed in either part. A peer's drift or
# crash is a finding, reported above. Everything above is already saved.

# %%
print(smoke + headline)
for name, fact in facts.items():
    verdict = fact.get("convergence", {}).get(S["compute_dtype"], {}).get("verdict")
    print(f"- {labels[name]}: {verdicts.trains_phrase(verdict)} in {S['compute_dtype']}"
          + "".join(f"\n    {c}" for c in fact["caveats"]))
if peer_findings:
    print(f"{len(peer_findings)} finding(s) about peers, reported above and in the REPORT")
if our_faults:
    raise AssertionError("\n".join(our_faults))
