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
# # 05 · How much more fits on my GPU? A Hugging Face model trained with each loss
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/05_fits.ipynb) [![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)](https://kaggle.com/kernels/welcome?src=https://github.com/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/05_fits.ipynb)
#
# The seed article began with a trainer that ran a free T4 out of memory at 16k tokens. The other
# notebooks measure the loss alone; this one puts each loss into a real Hugging Face causal LM, a
# Qwen3 of the 0.6B shape (random weights: nothing is downloaded), and measures the whole training
# step: forward, backward and optimizer, with gradient checkpointing.
#
# - **What fits**: the largest micro-batch, in tokens, each loss can train on a 16 GB card, found by
#   trying (an out-of-memory error is a result, not a crash).
# - **What a step costs**: peak memory above the weights and tokens per second, at the article's
#   16k tokens and at the largest micro-batch that fits, and a memory timeline of one step.
# - **Whether the first steps agree**: a short training run per loss from the same weights and
#   batches, against the default repeated. Twenty steps from random weights cannot say whether a
#   loss *trains like exact*: that verdict is notebook 03's (hundreds of steps, several seeds, a
#   practical margin), and this notebook defers to it.
#
# The losses: transformers' own (logits, then `ForCausalLMLoss`), Liger's patch
# (`apply_liger_kernel_to_qwen3`), ours through `helpers.hf.patch(model)` (one call, any Qwen2/3,
# Llama, Mistral or Gemma 2/3 causal LM), and Apple's kernel through the same patch where it runs.
# On a bigger GPU the default (`card = "t4"`) caps memory at a T4's, so the wall is the one a free
# Kaggle or Colab user hits; `card = "this"` measures the card as it is. A T4 trains in fp16 with a
# loss scaler; Ampere and newer in bf16. Expected run time: about a minute on a CPU (a tiny model),
# 3-4 minutes on an H200; on a T4, not measured (expect 15-30 minutes).

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
quick = False  # True: a coarser search for the largest micro-batch, 8 training steps, one timed repeat
output_dir = "results/05_fits"
card = "t4"  # "t4": a 16 GB card's memory on any bigger GPU; "this": the card as it is

# %%
import time
import warnings
import weakref
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import transformers

import helpers
from helpers.cce.device import T4_MEMORY_BYTES
from helpers.compare import measure, verdicts
from helpers.compare.sweep_results import memory_unit
from helpers.compare.units import format_bytes
from helpers.lab import fits
from helpers.compare.corpus import load_or_build_corpus
from helpers.lab.plots import mark_smoke
from helpers.lab.profiles import SMOKE_NOTE, get_profile
from helpers.lab.training import write_json
from helpers.suite.report import write_report_fragment

started = time.perf_counter()
transformers.utils.logging.set_verbosity_error()  # its deprecation notices are about its own internals
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
P = get_profile(profile, quick=quick)
S = P.section("05_fits")
device = P.torch_device
precision = S["precision"]
info = helpers.device_info(device)
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
if card not in ("t4", "this"):
    raise ValueError(f"card must be 't4' or 'this', got {card!r}")
if device.type == "cuda":
    # The guardrail: past the cap an allocation raises a catchable OutOfMemoryError.
    cap = measure.apply_memory_cap(0.9, card_bytes=T4_MEMORY_BYTES if card == "t4" else None, device=device)
else:
    cap = measure.apply_memory_cap(None, cpu_budget_bytes=S["cpu_budget_bytes"], device=device)
print(f"profile {P.name}: {info.describe()}; Qwen3 {S['shape']}, {precision}; {cap.describe()}")

# %% [markdown]
# ## The model, the data, the losses
#
# The data is the Python standard library's own source, tokenised into words (notebook 03's
# corpus), in sequences of `seq_len` tokens; the model's vocabulary keeps its full size whatever
# the corpus uses, because the logits, and so the memory the default loss needs, grow with it.
#
# The arms: transformers' default loss, Liger's fused one, Apple's CCE and ours; on a GPU also ours
# trading memory for speed (`memory_budget`: a fixed 1 GiB, and "auto", a share of what is free when
# the loss runs). "auto" must never cost the step its largest micro-batch: at the edge of memory it
# falls back to the least memory, and the search below shows whether it did.

# %%
shape = fits.QWEN3_SHAPES[S["shape"]]
corpus = load_or_build_corpus(Path.home() / ".cache" / "helpers" / "corpus",
                              vocab_size=min(shape["vocab_size"], 32_768), max_files=None if device.type == "cuda" else 60)
ids = corpus.train_ids
model = fits.build_model(S["shape"], device, precision)
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"Qwen3 {S['shape']}: {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters, "
      f"{format_bytes(weight_bytes)} of weights; corpus {ids.numel():,} training tokens")
arms = {}
for name, arm in fits.ARMS.items():
    if name not in S.get("arms", fits.ARMS):
        continue
    reason = arm.why_unavailable(device, fits.compute_dtype(precision))
    print(f"{arm.label:<26} {'runs here' if reason is None else 'not run: ' + reason}")
    if reason is None:
        arms[name] = arm

# %% [markdown]
# ## The same loss and gradients, without the logits
#
# Before anything is measured: on one batch, each loss's gradients against a yardstick that
# differs from them only in the loss arithmetic: the same patched forward with a loss computed from
# fp32 logits (autocast off). The model's body runs as in training, so whatever its precision
# costs is common to both sides. The error is over every gradient of the model together (the norm
# of the difference over the norm of the yardstick's); the bound is the dtype's. The default's own
# logits path is one of the arms, not the yardstick: in fp16 its gradient of the mean loss, about
# 1/(N·V) per logit, underflows (notebook 01).

# %%
check_batch = fits.batch(ids, S["check_tokens"], S["seq_len"], torch.Generator().manual_seed(0), device)
ref_loss, ref_grads = fits.loss_and_grads(model, fits.EXACT, *check_batch, precision)
bound = verdicts.WHOLE_MODEL_GRADIENT_BOUND[precision]
agreement = {}
for name, arm in arms.items():
    loss, grads = fits.loss_and_grads(model, arm, *check_batch, precision)
    names = list(ref_grads)
    grad_error = helpers.relative_error([grads[n] for n in names], [ref_grads[n] for n in names])
    agreement[name] = {"loss_error": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                       "grad_error": grad_error, "ok": grad_error < bound}
    print(f"{arm.label:<26} loss {float(loss):.5f} (exact {float(ref_loss):.5f}), gradient error "
          f"{grad_error:.1e} over {len(names)} tensors: {'ok' if grad_error < bound else 'OFF'}")
    del grads
del ref_grads
measure.release_memory(device)

# %% [markdown]
# ## How many tokens fit
#
# For each loss, micro-batches double from one sequence until a step runs out of memory, then the
# size is bisected between the last that fit and the first that did not (to `fit_step` tokens).

# %%
trainer = fits.Trainer(model, precision)
largest, tried = {}, {}
for name, arm in arms.items():
    largest[name], tried[name] = fits.largest_micro_batch(trainer, arm, ids, S["seq_len"], S["fit_start"],
                                                          S["fit_limit"], S["fit_step"], budget_bytes=cap.budget_bytes)
    shown = "not even one sequence" if largest[name] is None else f"{largest[name]:,} tokens"
    if largest[name] is not None and largest[name] == max(tried[name]):
        shown += " or more (nothing larger was tried: the search's limit)"
    print(f"{arm.label:<26} largest micro-batch: {shown}  (tried {', '.join(f'{n:,}' for n in tried[name])})")

# %%
# A loss that fit the largest size tried never met the wall: its count is a lower bound.
at_limit = {n: v is not None and v == max(tried[n]) for n, v in largest.items()}


def fit_text(name: str, unit: str = "") -> str:
    v = largest[name]
    return "none" if v is None else f"{v:,}{unit}" + (" or more (the search stopped at its limit)" if at_limit[name] else "")


fig, ax = plt.subplots(figsize=(9, 3.8))
names = list(largest)
values = [largest[n] or 0 for n in names]
bars = ax.barh([fits.ARMS[n].label for n in names], values, color=[f"C{i}" for i in range(len(names))])
for bar, n in zip(bars, names):  # "≥": the search stopped at its limit without meeting the wall
    shown = "none" if largest[n] is None else ("≥" if at_limit[n] else "") + f"{largest[n]:,}"
    ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {shown}", va="center")
if any(at_limit.values()):
    ax.plot([], [], " ", label="≥: the search stopped at its limit")
article = "the article's" if S["article_tokens"] == 16_384 else "this profile's"
ax.axvline(S["article_tokens"], color="gray", linestyle=":", label=f"{article} {S['article_tokens']:,} tokens")
ax.set(xlabel="largest micro-batch that trains (tokens)",
       title=f"Qwen3 {S['shape']}, {precision}\n{cap.describe().split(';')[0]}")
ax.set_xlim(0, 1.12 * max(values + [S["article_tokens"]]))
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
ax.invert_yaxis()
fig.tight_layout()
if P.smoke:
    mark_smoke(fig)
fig.savefig(out / "largest_micro_batch.png", dpi=120)

# %% [markdown]
# ## What a step costs
#
# Peak memory above the weights and throughput of one training step, at the article's 16k tokens
# and at each loss's largest micro-batch. A loss that does not fit at 16k says so.

# %%
steps = []
for name, arm in arms.items():
    for tokens in dict.fromkeys([S["article_tokens"], largest[name]]):
        if tokens is None:
            continue
        r = fits.measure_step(trainer, arm, ids, tokens, S["seq_len"], repeats=S["repeats"],
                              budget_bytes=cap.budget_bytes)
        steps.append(r)
        shown = (f"{format_bytes(r['peak_bytes']):>10} above the weights, {r['ms']:8.1f} ms, "
                 f"{r['tokens_per_s']:9,.0f} tokens/s" if r["status"] == "ok" else "out of memory")
        print(f"{arm.label:<26} {tokens:>8,} tokens: {shown}")

# %% [markdown]
# A memory timeline of one step at the largest size both fit, the default against ours: bytes
# held above the weights after every allocation and free. At a real vocabulary the default's peak
# is the logits (and their fp32 copy and gradient) at the end of the forward, which ours never holds;
# at the CPU profile's tiny one (512 ids) the logits are smaller than the activations, and the two
# lines show only the step's own shape.

# %%
both = [largest[n] for n in ("hf", "ours") if n in largest and largest[n]]
timelines = {}
if len(both) == 2:
    tokens = min(both)
    for name in ("hf", "ours"):
        line = fits.step_timeline(trainer, fits.ARMS[name], ids, tokens, S["seq_len"])
        if line is None:
            print(f"{fits.ARMS[name].label}: out of memory this time at {tokens:,} tokens (a fragmented cache)")
        else:
            timelines[name] = line
if timelines:
    fig, ax = plt.subplots(figsize=(9, 3.8))
    unit, per = memory_unit(max(max(line) for line in timelines.values()))
    for name, line in timelines.items():
        ax.plot([i / max(1, len(line) - 1) for i in range(len(line))], [v / per for v in line],
                label=f"{fits.ARMS[name].label}: peak {format_bytes(max(line))}")
    ax.set(xlabel="progress through one step (allocation events)", ylabel=f"{unit} above the weights",
           title=f"One training step at {tokens:,} tokens")
    ax.legend()
    fig.tight_layout()
    if P.smoke:
        mark_smoke(fig)
    fig.savefig(out / "step_timeline.png", dpi=120)
else:
    print("the default or ours did not fit even one sequence here: no timeline")

# %% [markdown]
# ## Do the first steps agree?
#
# A short run per loss from the same weights and the same batches (seed), at a micro-batch every
# loss fits (the profile's, or the default's largest if that is smaller), and the default run a
# second time: the difference between the two default runs is the noise floor (GPU kernels do not
# add in a fixed order). The first steps agree when a loss's largest step-by-step gap to the default
# stays within twice that floor, or within the dtype's rounding (the bound above) where the floor
# is smaller (the verdict engine's `first_steps_agree`). This catches a loss wired in wrong; it
# cannot see a drift that builds over hundreds of steps (fp16 Liger's, say): notebook 03 can.

# %%
held = weakref.ref(model)
del trainer, model
measure.release_memory(device)
if held() is not None:  # the curves' models need the card this one holds
    raise RuntimeError("the search's model is still referenced after `del`: its weights would stay on the card "
                       "and the training curves below would run out of memory")
C = S["curve"]
curve_tokens = min([C["tokens"], *[v for v in largest.values() if v]])
curves = {}
for name in ["hf", *[n for n in arms if n != "hf" and largest[n]]]:
    curves[name] = fits.train_curve(S["shape"], arms[name], ids, tokens=curve_tokens, seq_len=S["seq_len"],
                                    steps=C["steps"], precision=precision, device=device, seed=C["seed"])
repeat = fits.train_curve(S["shape"], arms["hf"], ids, tokens=curve_tokens, seq_len=S["seq_len"],
                          steps=C["steps"], precision=precision, device=device, seed=C["seed"])
if curves["hf"] is None or repeat is None:
    raise RuntimeError(f"the default loss ran out of memory training at {curve_tokens:,} tokens, which fitted "
                       "in the search: nothing to compare against")
missing = [n for n, c in curves.items() if c is None]
for name in missing:
    print(f"{fits.ARMS[name].label}: out of memory training at {curve_tokens:,} tokens")
curves = {n: c for n, c in curves.items() if c is not None}
floor = fits.max_relative_gap(repeat, curves["hf"])
gaps = {name: fits.max_relative_gap(curve, curves["hf"]) for name, curve in curves.items() if name != "hf"}
agree = {name: verdicts.first_steps_agree(gap, floor, bound)[0] for name, gap in gaps.items()}
allowed = verdicts.first_steps_agree(0.0, floor, bound)[1]
print(f"noise floor (the default repeated): {floor:.2e}; allowed gap {allowed:.2e}")
for name, gap in gaps.items():
    print(f"{fits.ARMS[name].label:<26} largest gap to the default {gap:.2e}: "
          f"{'the first steps agree' if agree[name] else 'the first steps DIFFER'}")

fig, ax = plt.subplots(figsize=(9, 3.8))
for name, curve in curves.items():
    ax.plot(range(1, len(curve) + 1), curve, label=fits.ARMS[name].label)
ax.set(xlabel="step", ylabel="training loss", title=f"{C['steps']} steps of {curve_tokens:,} tokens, seed {C['seed']}")
ax.legend()
fig.tight_layout()
if P.smoke:
    mark_smoke(fig)
fig.savefig(out / "training_curves.png", dpi=120)

# %% [markdown]
# ## The verdict

# %%
at_article = {r["arm"]: r for r in steps if r["tokens"] == S["article_tokens"]}
step_lines = []
for name, arm in arms.items():
    r = at_article.get(name)
    cost = ("out of memory at the article's micro-batch" if not r or r["status"] != "ok" else
            f"{format_bytes(r['peak_bytes'])} above the weights and {r['tokens_per_s']:,.0f} tokens/s at "
            f"{S['article_tokens']:,} tokens")
    trains = ("" if name == "hf" else ", not trained here" if name not in gaps else
              f", the first {C['steps']} steps agree with the default's" if agree[name]
              else f", but its first {C['steps']} steps differ from the default's")
    fit = "not even one sequence" if largest[name] is None else fit_text(name, " tokens")
    step_lines.append(f"{arm.label}: {fit} per micro-batch; {cost}{trains}.")
if P.smoke:
    print(SMOKE_NOTE)
print("\n".join(step_lines))
problems = [f"{fits.ARMS[n].label}: gradients off the exact loss's ({a['grad_error']:.1e} > {bound:g})"
            for n, a in agreement.items() if not a["ok"] and fits.ARMS[n].is_ours]
problems += [f"{fits.ARMS[n].label}: the first steps differ from the default's ({gaps[n]:.2e} > {allowed:.2e})"
             for n in gaps if fits.ARMS[n].is_ours and not agree[n]]

results = {
    "profile": P.name, "device": info.as_dict(), "precision": precision, "card": card,
    "memory_cap_bytes": cap.usable_bytes, "model": {"shape": S["shape"], **shape}, "weight_bytes": weight_bytes,
    "agreement": agreement, "largest_micro_batch": largest, "tried": tried, "steps": steps,
    "timeline_peaks": {n: max(t) for n, t in timelines.items()},
    "curves": curves, "default_repeat": repeat, "noise_floor": floor, "gaps": gaps, "first_steps_agree": agree, "allowed_gap": allowed, "summary_lines": step_lines,
    "problems": problems, "seconds": time.perf_counter() - started,
}
write_json(out / "results.json", results)
rows = "\n".join(
    f"| {fits.ARMS[n].label} | {fit_text(n)} | "
    + " | ".join((f"{format_bytes(r['peak_bytes'])}, {r['tokens_per_s']:,.0f} tok/s" if r["status"] == "ok" else "OOM")
                 for r in [at_article.get(n, {"status": "oom"})]) + " |"
    for n in arms)
# The report's opening table: per registry method (the default's logits path under "naive").
on_a_t4 = P.name.startswith(("t4", "cpu-t4"))  # a T4, or a pretend one: availability is a T4's
facts = {}
for name, arm in fits.ARMS.items():
    f = {}
    if name in arms and card == "t4" and device.type == "cuda":  # a 16 GB wall (a CPU's cap is simulated)
        f["largest_step_tokens_16gb"] = largest[name] or 0
        if at_limit[name]:
            f["largest_step_at_search_limit"] = True
    r = at_article.get(name)
    if name in arms and not P.smoke:
        f["whole_step"] = {"tokens": S["article_tokens"], "precision": precision,
                           "peak_bytes": r["peak_bytes"] if r and r["status"] == "ok" else None,
                           "tokens_per_s": r["tokens_per_s"] if r and r["status"] == "ok" else None}
    if on_a_t4 and device.type == "cuda":  # a CPU pretending to be a T4 cannot say what runs on one
        why = None if name in arms else arm.why_unavailable(device, fits.compute_dtype(precision))
        f["runs_on_t4"] = True if why is None else why
    if f:
        facts[arm.method or "naive"] = f
fitted = {n: v for n, v in largest.items() if v}
where = ("a 16 GB card" if card == "t4" else "this card") if device.type == "cuda" else f"this CPU ({cap.describe()})"
headline = (f"largest micro-batch (tokens) of a whole Qwen3 {S['shape']} training step, {precision}, on {where}: "
            + ", ".join(f"{fits.ARMS[n].label} {fit_text(n)}" for n in fitted))
write_report_fragment(out, f"""
| loss | largest micro-batch (tokens) | at {S['article_tokens']:,} tokens |
|---|---:|---|
{rows}

{chr(10).join('- ' + v for v in step_lines)}

Whether a loss trains like exact is notebook 03's verdict (this run's short curves only check the first steps).

![Largest micro-batch](largest_micro_batch.png)
{'![One step, memory over time](step_timeline.png)' if timelines else ''}
![Training curves](training_curves.png)
""", headline=headline, facts=facts, smoke=P.smoke)
plt.close("all")
print(f"results in {out} ({results['seconds']:.0f} s)")
if problems:
    raise AssertionError("\n".join(problems))
