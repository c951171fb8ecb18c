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
# # 02 · The memory sweep: where the loss stops fitting
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/02_memory_sweep.ipynb) [![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)](https://kaggle.com/kernels/welcome?src=https://github.com/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/02_memory_sweep.ipynb)
#
# The seed article's central figure, measured on a free Kaggle T4 in fp16 at the Qwen3-0.6B head
# (V = 151,936, D = 1,024): the peak memory of the loss, forward and backward, as the number of
# tokens N in a micro-batch grows.
#
# | N | 1,024 | 2,048 | 4,096 | 8,192 | 16,384 | 32,768 |
# |---|---:|---:|---:|---:|---:|---:|
# | naive | 3.77 GB | 5.64 | 9.38 | OOM | OOM | OOM |
# | torch.compile | 2.53 | 2.84 | 3.48 | 4.74 | 7.26 | 12.30 |
# | Liger | 3.15 | 3.16 | 3.17 | 3.20 | 3.25 | 3.36 |
#
# The naive loss climbs 1.87 GB for every 1,024 tokens and dies past 4,096; torch.compile climbs
# more slowly but still linearly; Liger stays flat. This notebook measures the same sweep on *your*
# device, for every method that can run there, and puts the arithmetic beside each measured
# point, so that the picture can be explained, not just believed. It ends with the two answers a
# user wants: how many tokens fit on my card, and which method to use.
#
# "Run all" gives the full run for the device found: a T4 gets the article's sweep; a bigger GPU
# carries it on to 131,072 tokens and then runs the article's sweep again *as a T4* (a T4's
# memory, a T4's kernel configurations, in this same process): the article's OOM wall, as a
# second figure. A CPU gets a smoke run that checks the pipeline and supports no conclusion.
#
# **Run time.** CPU smoke profile, 2 cores: 40 to 55 s with cold compiler caches (the pretend-T4
# pass about 11 s of it), under 30 s with warm ones. H200, full run: the main sweep took 158 s
# (measured 2026-12-01, before the pretend-T4 sweep was added); the pretend-T4 sweep and a T4's
# own run have not been timed yet. `quick = True` keeps four token counts (8,192 and 16,384 among
# them) and three timed calls a point.

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
profile = "auto"  # "auto": the full run for the device found; or "cpu", "t4", "gpu"
quick = False  # True: a short run (fewer token counts, fewer timed calls), minutes instead of the full picture
output_dir = "results/02_memory_sweep"
dtype = None  # "float16", "bfloat16" or "float32"; None: the profile's (fp16 T4, bf16 newer GPUs, fp32 CPU)
V = None  # vocabulary; None: the profile's (the Qwen3-0.6B head on GPUs)
D = None  # hidden size; None: the profile's
memory_fraction = 0.9  # the guardrail: the share of the card's memory the process may allocate
t4_sweep = True  # on a bigger GPU, sweep again as a pretend T4 (a second figure); False: skip it

# %%
from pathlib import Path

import helpers  # first: the environment it needs (helpers.env)
import torch
from IPython.display import Markdown, display

from helpers.cce.device import T4_CAPABILITY, T4_MEMORY_BYTES
from helpers.compare import measure, sweep, sweep_results, theory
from helpers.compare.heads import QWEN3
from helpers.compare.inputs import make_inputs
from helpers.compare.methods import BUDGET_CURVE, get_method, primary_methods
from helpers.compare.units import DTYPES, dtype_name
from helpers.lab.profiles import SMOKE_NOTE, get_profile
from helpers.lab.plots import method_label, plot_memory_sweep, plot_tradeoff
from helpers.suite.report import write_report_fragment

P = get_profile(profile, quick=quick)
settings = P.section("02_memory_sweep")
device = P.torch_device
info = helpers.device_info(device)
dtype = getattr(torch, dtype or settings["dtype"])
V = V or settings["V"]
D = D or settings["D"]
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
stem = "memory_sweep_pretend_t4" if info.pretend_t4 else "memory_sweep"
labels = {name: method_label(name) for name in primary_methods()}  # one name per method, everywhere below
print(f"profile {P.name}: {P.description}")
print(f"device: {info.describe()}")
print(f"head: V={V:,}, D={D:,}, {dtype_name(dtype)}; token counts {', '.join(f'{n:,}' for n in settings['N'])}")
if P.smoke:
    print(SMOKE_NOTE)

# %% [markdown]
# ## The guardrail
#
# A sweep that pushes a method past the card's memory must fail *politely*. On a machine with
# unified memory the article's first OOM took the whole machine down; the fix was one line,
# `torch.cuda.set_per_process_memory_fraction(0.9)`, after which an allocation past 90% of the card
# raises a catchable `torch.OutOfMemoryError`. The sweep records it as the wall for that method
# and carries on.
#
# The same line lets a big GPU pretend to be a small one: capped at `memory_fraction` (90%) of a
# T4's memory, the card runs out where a T4 reader running this notebook would, and our kernels
# take their T4 configurations (`helpers.cce.device.pretend_t4_scope`), their products on CUDA
# cores as a T4's Triton compiles them. The speed stays this card's, and so do the peers' own code
# paths. On the CPU there is no allocator to cap; the
# profile's simulated card is a budget on each step's measured peak.

# %%
cap = measure.apply_memory_cap(memory_fraction, cpu_budget_bytes=settings.get("cpu_budget_bytes"), device=device)
print(cap.describe())
Ns = theory.sizes_that_fit(settings["N"], V, D, dtype, cap)
if Ns != sorted(settings["N"]):
    print(f"left out (even dE + dC would not fit): N = {sorted(set(settings['N']) - set(Ns))}")

# %% [markdown]
# ## Which methods: the gate first
#
# A quick accuracy gate (the full one is notebook 01) runs in the dtype of the sweep, on the
# configuration the sweep calls (mean over tokens, some ignored, no soft cap), at small irregular
# shapes, and notebook 01's case with realistic targets (tokens that repeat, as in text). A method
# that cannot run here is left out, with the reason. A method that runs but fails
# the gate is swept all the same and marked: its memory and time do not depend on its rounding,
# and leaving it out would hide the floor (Apple CCE fails in bf16 and is the floor's best witness).

# %%
gate = sweep.quick_gate(primary_methods(), dtype, settings["gate_shapes"], device,
                        realistic=settings.get("gate_realistic", ()))
plan = sweep.plan_methods(primary_methods(), gate, device, dtype)
methods = plan.swept
for name in primary_methods():
    if name in plan.unavailable:
        print(f"  left out  {labels[name]:<18} cannot run here: {plan.unavailable[name]}")
    elif name in plan.failed_gate:
        print(f"  sweeping  {labels[name]:<18} FAILS the accuracy gate ({plan.failed_gate[name]}); marked †")
    else:
        print(f"  sweeping  {labels[name]:<18} passed the gate ({len({r.case for r in gate.rows})} cases)")

# %% [markdown]
# ## Theory first: what each method must hold
#
# Write b for the bytes of one input element (2 in fp16/bf16, 4 in fp32). Each method's peak, in
# bytes above the inputs, read off its code and checked against the profiler:
#
# - **naive**, `F.cross_entropy((E @ C.T).float(), x)`: three fp32 N×V tensors at once in
#   `log_softmax`'s backward, **12 bytes per logit** in every dtype (29.9 GB at N = 16,384).
# - **torch.compile**: only the input-dtype logits, their gradient written over them:
#   **N·V·b + (N·D + V·D)·b**. Still N×V, but b bytes a logit instead of 12.
# - **chunked (PyTorch)**: dE, an fp32 dC and fp32 logit blocks of 256 MiB: grows with N until one
#   block's rows (441 at the Qwen3 head), flat after.
# - **Liger**: the gradients, computed during the forward, plus one logit block of about N·D
#   elements; on a T4, in fp32 and on the CPU, (V, D) temporaries for dC too.
# - **Apple CCE**: the floor, (N·D + V·D)·b, plus O(N) for the per-row LSE.
# - **ours (Triton CCE)**: the floor plus its backward's scratch, a G chunk and (16-bit) dE's fp32
#   accumulator (and, with few tokens, a G buffer; below): 1.02-1.08× the floor at the Qwen3 head with
#   1,024 tokens, 1.13-1.20× from 16,384 (bf16, on an H200; `docs/PERFORMANCE.md`).
# - **ours with the sparse backward** (`backward_impl="sparse"`, the registry's `ours_sparse`,
#   which the default "auto" picks where it pays; not swept here): the floor plus the forward's bits (N·V/128 bits), a buffer of gradient
#   tiles and the list of marked pairs: measured on an H200, 1.06× the floor at the Gemma-2-2B head
#   and 1.11-1.17× at the Qwen3 head from N = 16,384 to 131,072 (bf16, realistic inputs;
#   `docs/PERFORMANCE.md`). Where it cannot skip (a flat softmax, fewer than ~8 million (row, tile)
#   pairs) it runs the "gemm" backward and holds what that holds.
# - Any other method (**torch LCE**) has no formula here and is compared with the floor.
#
# The floor itself, the two gradients dE and dC that any method must hand back, is drawn in grey.
#
# <details><summary>The derivations, for the kernel author</summary>
#
# - **naive**: the input-dtype logits (N·V·b) die right after the upcast. The peak is in the
#   backward of `log_softmax`, where three fp32 N×V tensors are alive at once: the log-softmax saved
#   by the forward, the gradient `nll_loss` hands back (dense), and the gradient `log_softmax`
#   returns.
# - **torch.compile**: Inductor fuses upcast, softmax and loss, keeps only the input-dtype logits
#   for backward and writes their gradient over them.
# - **chunked**: dE, an fp32 dC accumulator, (16-bit inputs) an fp32 copy of C, and fp32
#   (rows, V) blocks of 256 MiB each: the raw logits, z − lse and G, plus the previous chunk's G,
#   which lives on until the next one is bound (four blocks; three when one chunk covers all N).
# - **Liger**: the (rows, V) block has rows = next_pow2(ceil(N / ceil(V / D))). dC accumulates in
#   place only on sm_80+ in 16-bit; elsewhere each chunk adds `mm(G^T, E_chunk).float()`: a (V, D)
#   matmul result and its fp32 copy.
# - **ours**: dE's fp32 accumulator (rows × D, 16-bit inputs) is sized by `helpers.cce.gemm_chunks`
#   to at most max(64 MiB, LB/16), where LB = (N·D + V·D)·b is the floor; the 64 MiB minimum keeps
#   cuBLAS's products large at small N, and is why ours sits above the floor while Apple CCE sits
#   on it. Each G chunk (rows × vocabulary columns, input dtype) is written where it can into rows
#   of dC or dE that the backward has not written yet (`helpers.cce.gemm_plan`), at no cost. Two
#   buffers may add to that: with few tokens a G buffer of up to 8% of the floor
#   (`HostTuning.g_buffer_lb_share`) ends the tail of ever narrower in-place chunks in one launch,
#   and on a small head, where even the widest in-place chunk would be host-bound, one of up to
#   128 MiB (`g_chunk_host_us`, `g_buffer_max_bytes`); fp32 inputs, whose dE is its own
#   accumulator, need a buffer of at most max(32 MiB, LB/32) for the last chunks. Plus 24 bytes of
#   fp32 per-row state.
#
# </details>

# %%
unit_name, unit_bytes = unit = sweep_results.memory_unit(theory.predicted_peak_bytes("naive", Ns[-1], V, D, dtype))
rows = ["| method | formula | " + " | ".join(f"N={n:,}" for n in Ns) + " |", "|---|---|" + "---:|" * len(Ns)]
for name in methods:
    formula = get_method(name).peak_formula or "no formula here; compared with the floor"
    cells = [theory.predicted_peak_bytes(name, n, V, D, dtype, theory.capability_for(name, info)) for n in Ns]
    rows.append(f"| {labels[name]} | {formula} | " + " | ".join("—" if c is None else f"{c / unit_bytes:.3f}" for c in cells) + " |")
floor = [theory.lower_bound_bytes(n, V, D, dtype) / unit_bytes for n in Ns]
rows.append("| floor | dE + dC | " + " | ".join(f"{c:.3f}" for c in floor) + " |")
display(Markdown(f"Predicted peak, {unit_name} above the inputs:\n\n" + "\n".join(rows)))
for name in methods:
    wall = theory.first_oom_n(name, Ns, V, D, dtype, cap, theory.capability_for(name, info))
    if wall is not None:
        print(f"theory says {labels[name]} will not fit from N={wall:,} on")

# %% [markdown]
# ### Does the theory explain the article's numbers?
#
# The article measured inside its trainer, with everything already resident counted: the inputs
# and whatever else the trainer held. If the formulas are right, the article's numbers minus
# (theory + inputs), for the T4's code paths in fp16, should be one constant at every point.

# %%
rows = ["| method | " + " | ".join(f"N={n:,}" for n in sweep.ARTICLE_N) + " |", "|---|" + "---:|" * len(sweep.ARTICLE_N)]
residuals = []
for name, article in sweep.ARTICLE_T4_PEAK_GB.items():
    cells = []
    for n, gb in zip(sweep.ARTICLE_N, article):
        ours = theory.predicted_peak_bytes(name, n, QWEN3.V, QWEN3.D, "float16", T4_CAPABILITY)
        ours += theory.input_bytes(n, QWEN3.V, QWEN3.D, "float16")
        cells.append("OOM" if gb is None else f"{gb:.2f} − {ours / 1e9:.2f} = **{gb - ours / 1e9:.2f}**")
        residuals += [] if gb is None else [gb - ours / 1e9]
    rows.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
display(Markdown("Article − (theory + inputs), GB:\n\n" + "\n".join(rows)))
print(f"residual {min(residuals):.2f} to {max(residuals):.2f} GB over {len(residuals)} points")
assert max(residuals) - min(residuals) < 0.02, "the theory no longer explains the article's table"

# %% [markdown]
# Fifteen points, three methods, one constant: about 1.59 GB was resident in the article's trainer
# before the loss ran, and every byte above it is what the formulas say. The slopes are exact:
# 12 bytes per logit for naive, 2 for torch.compile in fp16, and for Liger only dE and its logit
# block, which grow with N·D, not N·V. Our measurements below count only what the loss step itself
# allocates, so they should land on the theory, not on the article's absolute numbers.
#
# ## How we measure
#
# `helpers.compare.measure` is the one place for it. `peak_memory(fn)` returns the most memory `fn` held at
# once, above what was allocated before it started: on CUDA from the allocator's statistics
# (`reset_peak_memory_stats`, then `max_memory_allocated` minus the memory allocated before); on
# the CPU, which keeps no such statistics, from the PyTorch profiler's allocation and free events,
# replayed in time order. `latency(fn)` is the median (with p10 and p90) of timed calls after
# warm-up, with CUDA events on a GPU. Inputs are random, never zeros.
#
# Before trusting it with the sweep: a known allocation, then one naive step against 12·N·V.

# %%
known = 256 * 1024**2 if device.type == "cuda" else 8 * 1024**2
measured = measure.peak_memory(lambda: torch.empty(known, dtype=torch.uint8, device=device), device=device)[1]
print(f"a {known:,}-byte tensor: measured {measured:,} bytes")
assert abs(measured - known) <= 0.01 * known
n0 = Ns[0]
# On the CPU in fp32: a CPU's fp16 matmul may convert its operands in scratch of its own (how much
# depends on the processor), memory of the BLAS, not of the loss.
meter_dtype = torch.float32 if device.type == "cpu" else dtype
E0, C0, x0 = make_inputs(n0, V, D, meter_dtype, device, requires_grad=True)
naive_step = measure.loss_step("naive", E0, C0, x0)
naive_step()  # warm-up: one-time workspaces are not the loss's memory
measured = measure.peak_memory(naive_step, device=device)[1]
predicted = theory.predicted_peak_bytes("naive", n0, V, D, meter_dtype, info.capability)
print(f"naive at N={n0:,}: measured {measured / unit_bytes:.4f} {unit_name}, 12·N·V = {predicted / unit_bytes:.4f} {unit_name}")
assert abs(measured / predicted - 1) < 0.05
del E0, C0, x0, naive_step
measure.release_memory(device)

# %% [markdown]
# ## The sweep
#
# Every method that can run here, at every N, on fresh random inputs (E, C normal, C scaled so
# the logits have a standard deviation of about 2, uniform targets: a dense softmax). Per point:
# warm-up, one call under `peak_memory`, then the timed calls. A point that runs out of memory is
# recorded as OOM, the memory released, and the method skipped at larger N.
#
# Each point is appended to `points.jsonl` as soon as it is measured, keyed by (method, N, V, D,
# dtype, device, pretend T4, cap) and the versions of torch, Triton, the peers' packages and our
# own code: a re-run, or a run cut short by a Kaggle session limit, picks up where it stopped, and
# says how many points it reused. A point from other versions is measured again.

# %%
records = sweep.run_sweep(
    methods, Ns, V=V, D=D, dtype=dtype, store=out / "points.jsonl", memory_cap=cap, device=device,
    warmup=settings["warmup"], repeats=settings["repeats"], seed=settings["seed"],
)
count = {status: sum(r["status"] == status for r in records) for status in ("ok", "oom", "skipped after OOM", "error")}
reused = sum(r["reused"] for r in records)
print(f"{len(records)} points: {count['ok']} measured ({reused} of them reused from points.jsonl), "
      f"{count['oom']} out of memory, {count['skipped after OOM']} skipped after an OOM, {count['error']} errors")

# %% [markdown]
# ## The picture
#
# Left, peak memory on log-log axes: a line with slope one grows in proportion to N, a flat line
# does not depend on N at all. Lines with hollow markers are measured; the thin dashed line of the
# same colour is the theory, hidden under the measured line where the two agree, and carried past
# the wall to show where the method would have gone. A cross is an out-of-memory point, at its N
# and where the theory says it would have been (at least on the line it went past). The black
# dashed line is what a step may use here (the cap minus the inputs); on a card bigger than a T4,
# the red dashed line is what a T4 leaves, the wall of the article. The grey dotted vertical line
# is the article's real micro-batch, N = 16,384. A method that fails the accuracy gate is drawn
# dotted.
#
# Right, forward+backward time. A caveat the article made and we repeat: times on a T4 are not a
# verdict on the kernels (Liger's fast paths need sm_80 or newer), and on the CPU the Triton
# kernels run in an interpreter.

# %%
def latency_caveat(info):
    if info.pretend:
        card = info.pretend_card
        return f"pretend {card.label}: {card.a_label}'s memory, but this GPU's speed"
    if not info.is_cuda:
        return "CPU: Triton kernels run in the interpreter; these times say nothing about a GPU"
    return "" if info.has_bf16_matmul else "T4 times are not a verdict on the kernels (Liger's fast paths need sm_80+)"


def room(cap, V, D, dtype, Ns):
    return {n: cap.room_for(theory.input_bytes(n, V, D, dtype)) for n in Ns} if cap.usable_bytes else None


t4 = theory.t4_card(memory_fraction)
bigger_than_t4 = info.is_cuda and not info.pretend_t4 and cap.usable_bytes > t4.cap.usable_bytes
fig = plot_memory_sweep(
    records, path=out / f"{stem}.png", room_bytes=room(cap, V, D, dtype, Ns),
    t4_room_bytes=room(t4.cap, V, D, dtype, Ns) if bigger_than_t4 else None,
    micro_batch_N=sweep.ARTICLE_MICRO_BATCH_N, latency_caveat=latency_caveat(info), unit=unit,
    failed_gate=plan.failed_gate, smoke=P.smoke,
    title=f"{info.name if info.is_cuda else 'CPU'}: V={V:,}, D={D:,}, {dtype_name(dtype)}",
)

# %% [markdown]
# ## The T4's wall, on this card
#
# The figure a Kaggle user came for is the one with a T4's 16 GB in it. On a bigger GPU this
# notebook runs the article's sweep a second time, *as a T4*: inside
# `helpers.cce.device.pretend_t4_scope()` the allocator is capped at `memory_fraction` of a T4's
# memory, our kernels take their T4 configurations, a method a T4 cannot run (Apple CCE: with
# current Triton its backward needs more than a T4's 64 KB of shared memory) says so, and the
# quick gate runs again in fp16. Afterwards the card is itself again. On a T4, or under
# `--pretend-t4`, the figure above is already the T4's. On the CPU the same pass runs at smoke
# sizes in fp16 with the T4's kernel configurations: a check of its pipeline, not a T4 (a CPU has
# no T4 memory to pretend).

# %%
this_is_a_t4 = info.is_cuda and info.capability == T4_CAPABILITY  # a real one, or a pretend one
t4_settings = settings.get("t4_sweep") if t4_sweep and not this_is_a_t4 else None
t4_pass = None
if t4_settings:
    t4_pass = sweep.run_pretend_t4_sweep(primary_methods(), t4_settings, V=V, D=D, device=device,
                                         memory_fraction=memory_fraction, store=out / "points.jsonl")
    print(t4_pass.cap.describe())
    for name in primary_methods():
        if name in t4_pass.plan.unavailable:
            print(f"  left out  {labels[name]:<18} cannot run here as a T4: {t4_pass.plan.unavailable[name]}")
        elif name in t4_pass.plan.failed_gate:
            print(f"  sweeping  {labels[name]:<18} FAILS the {t4_pass.dtype} gate ({t4_pass.plan.failed_gate[name]}); marked †")
        else:
            print(f"  sweeping  {labels[name]:<18} passed the {t4_pass.dtype} gate")
    t4_unit = sweep_results.memory_unit(theory.predicted_peak_bytes("naive", t4_pass.Ns[-1], V, D, t4_pass.dtype))
    as_t4 = t4_pass.info.name if t4_pass.info.is_cuda else "CPU with a T4's kernel configurations"
    t4_fig = plot_memory_sweep(
        t4_pass.records, path=out / "memory_sweep_pretend_t4.png",
        room_bytes=room(t4_pass.cap, V, D, t4_pass.dtype, t4_pass.Ns), micro_batch_N=sweep.ARTICLE_MICRO_BATCH_N,
        latency_caveat=latency_caveat(t4_pass.info), unit=t4_unit, failed_gate=t4_pass.plan.failed_gate,
        smoke=P.smoke, title=f"{as_t4}: V={V:,}, D={D:,}, {t4_pass.dtype}",
    )
elif this_is_a_t4:
    print("this card is a T4 (or a pretend one): the figure above is the T4's")
else:
    print("no T4 sweep: t4_sweep = False, or the profile has none")
# The T4's own points: the second pass, or this sweep when the card is a T4.
t4_records, t4_plan = (t4_pass.records, t4_pass.plan) if t4_pass else (records, plan) if this_is_a_t4 else (None, None)

# %%
if t4_pass:
    display(Markdown(sweep_results.results_pivot(t4_pass.records, labels, failed_gate=t4_pass.plan.failed_gate)))
    t4_reading = sweep_results.describe_methods(t4_pass.records, V, smoke=P.smoke)
    for name, sentence in t4_reading.items():
        print(f"{labels[name]}: {sentence}")

# %% [markdown]
# ## Memory for speed: one loss, many budgets
#
# The sweep above runs every method as it ships. Ours can also be told how much memory it may take
# for speed: `memory_budget` (`"default"`: `"min"`, the least, on most cards and 1 GiB on a T4; or a number
# of bytes, or `"auto"`). On a T4 the default is 1 GiB: Triton runs a T4's 16-bit products as fp32 FMAs, not
# on its tensor cores, so there cuBLAS makes our logits, and the held-logits schedule below (three products)
# beats the recompute design (four) at three to four times its memory: ~1.4x faster on a T4 by its datasheet's
# rates (an H100 standing in for one measured ~3x: its host is slower at issuing the recompute design's
# cuBLAS pieces than its GPU is at running them). Under "min" it
# recomputes the logits in the backward: four N×V×D products and nearly nothing above the gradients
# themselves. Given room, it holds the logits of R rows at a time and makes the gradients in the
# forward, as torch.compile and Liger do: three products, at R·V·b bytes per chunk (plus dC's fp32
# accumulator, 4·V·D, unless it accumulates dC in its own dtype for a few chunks). The loss predicts
# each schedule's memory and time and runs the fastest that fits; `stats["why"]` says which and why.
#
# Below, ours at budgets from 256 MiB to 64 GiB (as good as unlimited here), its default among them, as one
# line, time against peak memory, with the other methods as points. A point to the left is lighter, a point lower is
# faster: what a user picks depends on what the rest of the step needs. The budgets pass the same
# quick gate first. Points already measured above are reused from `points.jsonl`.

# %%
tradeoff = settings.get("tradeoff")
tradeoff_records, tradeoff_plan = None, None
budget_labels = {**labels, **{name: method_label(name) for name in BUDGET_CURVE}}
if tradeoff:
    budgets = [m for m in BUDGET_CURVE if m != "ours"]
    budget_gate = sweep.quick_gate(budgets, dtype, settings["gate_shapes"][:1], device)
    tradeoff_plan = sweep.plan_methods(budgets, budget_gate, device, dtype)
    for name, why in {**tradeoff_plan.unavailable, **tradeoff_plan.failed_gate}.items():
        print(f"  {method_label(name)}: {why}")
    points = [m for m in methods if m not in BUDGET_CURVE] + ["ours"] * ("ours" in methods) + tradeoff_plan.swept
    tradeoff_Ns = sweep.sizes_that_fit(tradeoff["N"], V, D, dtype, cap)
    tradeoff_records = sweep.run_sweep(
        points, tradeoff_Ns, V=V, D=D, dtype=dtype, store=out / "points.jsonl", memory_cap=cap, device=device,
        warmup=settings["warmup"], repeats=settings["repeats"], seed=settings["seed"],
    )
    tradeoff_fig = plot_tradeoff(
        tradeoff_records, BUDGET_CURVE, path=out / "memory_tradeoff.png", smoke=P.smoke,
        failed_gate={**plan.failed_gate, **tradeoff_plan.failed_gate},
        title=f"Time against memory, {info.name if info.is_cuda else 'CPU'}: V={V:,}, D={D:,}, {dtype_name(dtype)}",
    )
    display(Markdown(sweep_results.results_pivot(tradeoff_records, budget_labels, failed_gate=tradeoff_plan.failed_gate)))
else:
    print("no trade-off curve: the profile has none")

# %% [markdown]
# ## How many tokens fit?
#
# The theory, checked against every point above, answers the question the other way round: for
# each method, the largest N whose loss step fits on this card and on a T4 (in fp16, 90% of its
# memory, as the guardrail leaves it). **It counts only the loss step**: its inputs E, C and x, and
# what forward and backward hold above them. A real training step also holds the model's weights,
# gradients, optimizer state and activations, so a real micro-batch is smaller; notebook 05 measures
# that for the whole Qwen3-0.6B. A method with no formula has no answer here; a method a card cannot
# run says why.

# %%
cards = [theory.this_card(info, cap, dtype, primary_methods()), t4]
cannot_run = {cards[0].label: plan.unavailable}
if t4_plan is not None and info.is_cuda:
    cannot_run[t4.label] = t4_plan.unavailable
display(Markdown(theory.fits_table(primary_methods(), V, D, cards, labels, cannot_run)))

# %% [markdown]
# Another card, another head: change the values below (V and D of your model, the dtype you train
# in, the card's memory in GB, its generation). It starts at a T4 (the 15 GiB, 16.1 GB, that
# `helpers.cce.device` counts for one) with this notebook's head. The same guardrail applies: the
# process may use `memory_fraction` of the card. Whether a method runs on that card at all (Apple
# CCE does not on a T4) is for the sweeps above to say; the widget only does the arithmetic.

# %%
import ipywidgets as widgets

from helpers.lab.widgets import explore

GENERATIONS = {"T4 (sm_75)": (7, 5), "Ampere (sm_80)": (8, 0), "Hopper (sm_90)": (9, 0)}


def tokens_that_fit(V, D, dtype, card_GB, generation):
    try:
        asked = theory.card(f"a {card_GB:g} GB {generation} card", card_GB * 1e9, dtype, GENERATIONS[generation],
                           memory_fraction)
        display(Markdown(theory.fits_table(primary_methods(), V, D, [asked], labels)))
    except ValueError as error:
        print(f"cannot answer: {error}")


explore(
    tokens_that_fit, V=widgets.IntText(V), D=widgets.IntText(D),
    dtype=widgets.Dropdown(options=DTYPES, value="float16"),
    card_GB=widgets.FloatText(round(T4_MEMORY_BYTES / 1e9, 1)),
    generation=widgets.Dropdown(options=list(GENERATIONS), value="T4 (sm_75)"),
);

# %% [markdown]
# ## Measured against theory
#
# Where they differ, and why. For naive and torch.compile the formulas count every tensor, and
# the ratio should sit at 1.00 (a GPU may add a few MB of cuBLAS or Triton scratch). Liger's
# formula follows its code path for this device (in-place dC accumulation only on sm_80+ in 16-bit).
# Ours counts its G chunk and fp32 accumulator; on an H200 it sat within 0.6% of measured
# (the excess at large N: O(N) per-row vectors the formula leaves out). For Apple
# CCE the formula is the floor (its O(N) LSE is left out: about 0.6% here); PyTorch's
# `linear_cross_entropy` has none and is shown against the floor. Every measured peak must be at
# least the floor, or the measurement is wrong.

# %%
display(Markdown(sweep_results.results_pivot(records, labels, cell="theory_ratio", failed_gate=plan.failed_gate)))
for r in records:
    if r["status"] == "ok":
        assert r["peak_bytes"] >= 0.99 * r["lower_bound_bytes"], f"{labels[r['method']]} at N={r['N']} is below the floor"
        if r["method"] == "naive" and meter_dtype == dtype:
            assert abs(r["peak_bytes"] / r["theory_bytes"] - 1) < 0.05, f"naive at N={r['N']} is off 12·N·V"

# %% [markdown]
# ## The results, in words
#
# The table reads like the article's: a row per method, least memory first, a column per N, each
# cell the peak above the inputs and the time of one forward and backward. Then one sentence per
# method: does its memory grow with the logits (N×V) or only with the gradients (N·D), where did it
# hit the wall (beside the wall the theory predicted), and how fast is it next to torch.compile?
#
# On the CPU smoke run the shapes are too small for any verdict: at V = 257 one 256 MiB chunk
# (and ours' 32 MiB G chunk) holds every row, so chunked and ours *are* the N×V computation there,
# and the CPU's times say nothing about a GPU. The cell then says only what ran.

# %%
display(Markdown(sweep_results.results_pivot(records, labels, failed_gate=plan.failed_gate)))
reading = sweep_results.describe_methods(records, V, smoke=P.smoke)
if P.smoke:
    print(SMOKE_NOTE)
for name, sentence in reading.items():
    wall = theory.first_oom_n(name, Ns, V, D, dtype, cap, theory.capability_for(name, info))
    theory_says = "no formula" if not theory.has_formula(name) else "no wall" if wall is None else f"wall at N={wall:,}"
    gate_note = f" † fails the accuracy gate ({plan.failed_gate[name]})" if name in plan.failed_gate else ""
    print(f"{labels[name]}: {sentence} (theory: {theory_says}){gate_note}")

# %% [markdown]
# ## Files and the report
#
# The points go to `memory_sweep.csv` and `.json` (with the settings, the methods left out and
# why, the versions), the figures to PNG, and a fragment to the suite's report: a one-line headline
# and, per method, the facts its opening table reads (peak and time at N = 16,384 on this card,
# the peak as a T4, whether it runs on a T4). A smoke run gives no facts: its shapes say nothing
# about N = 16,384.

# %%
meta = {
    "profile": P.name, "smoke": P.smoke, "device": info.as_dict(), "dtype": dtype_name(dtype), "V": V, "D": D,
    "pretend": info.pretend, "memory_fraction": memory_fraction, "memory_cap_bytes": cap.usable_bytes,
    "methods": methods, "failed_gate": plan.failed_gate, "left_out": plan.unavailable, "N": Ns,
    "readings": reading, "versions": sweep.library_versions(),
}
files = [*sweep_results.write_results(records, out, stem, meta), out / f"{stem}.png"]
if tradeoff_records:
    tradeoff_meta = {**meta, "methods": sorted({r["method"] for r in tradeoff_records}),
                     "failed_gate": tradeoff_plan.failed_gate, "left_out": tradeoff_plan.unavailable,
                     "N": sorted({r["N"] for r in tradeoff_records}), "readings": {}}
    files += [*sweep_results.write_results(tradeoff_records, out, "memory_tradeoff", tradeoff_meta),
              out / "memory_tradeoff.png"]
if t4_pass:
    t4_meta = {**meta, "device": t4_pass.info.as_dict(), "dtype": t4_pass.dtype, "pretend": "t4",
               "memory_cap_bytes": t4_pass.cap.usable_bytes,
               "methods": t4_pass.plan.swept, "failed_gate": t4_pass.plan.failed_gate,
               "left_out": t4_pass.plan.unavailable, "N": t4_pass.Ns, "readings": t4_reading}
    files += [*sweep_results.write_results(t4_pass.records, out, "memory_sweep_pretend_t4", t4_meta),
              out / "memory_sweep_pretend_t4.png"]
print("results: " + ", ".join(f.name for f in files) + f" in {out}")

headline = sweep_results.headline(records, labels=labels, t4_records=t4_records, smoke=P.smoke)
facts = {} if P.smoke else sweep_results.report_facts(records, t4_records=t4_records, t4_plan=t4_plan)
if tradeoff_records and BUDGET_CURVE[0] in facts:  # what ours' budgets bought, for the report's sentences
    budget_points = sweep_results.report_facts([r for r in tradeoff_records if r["method"] in BUDGET_CURVE[1:]])
    facts[BUDGET_CURVE[0]]["budgets"] = {m: {**f["sweep"], "gate": "fail" if m in tradeoff_plan.failed_gate else "pass"}
                                for m, f in budget_points.items()}
print(f"headline: {headline}")
reading_lines = "".join(f"\n- **{labels[name]}**{' †' if name in plan.failed_gate else ''}: {sentence}"
                        for name, sentence in reading.items())
reading_lines += "".join(f"\n- *not swept*, {labels[name]}: {why}" for name, why in plan.unavailable.items())
t4_section = "" if not t4_pass else f"""
### {"As a T4" if t4_pass.info.is_cuda else "The T4 pass at smoke size (a T4's kernel configurations, not its memory)"}, {t4_pass.dtype}

{t4_pass.cap.describe()}.
{"".join(f"{chr(10)}- **{labels[name]}**: {sentence}" for name, sentence in t4_reading.items())}

![Peak memory and latency against N, as a T4](memory_sweep_pretend_t4.png)

{sweep_results.results_pivot(t4_pass.records, labels, failed_gate=t4_pass.plan.failed_gate)}
"""
tradeoff_section = "" if not tradeoff_records else f"""
### Memory for speed: ours under memory budgets, the others as points

![Time against peak memory](memory_tradeoff.png)

{sweep_results.results_pivot(tradeoff_records, budget_labels, failed_gate=tradeoff_plan.failed_gate)}
{"" if info.is_cuda else chr(10) + "On a CPU a budget buys no speed: its schedule holds logits to spare the GPU a recomputing product, and under the interpreter the time is the kernels' launches and Python, not arithmetic; the points show the pipeline, not the trade." + chr(10)}"""
write_report_fragment(out, f"""
Peak memory of loss forward+backward against tokens N on {info.describe()},
V={V:,}, D={D:,}, {dtype_name(dtype)}; {cap.describe()}.
{reading_lines}

![Peak memory and latency against N]({stem}.png)

{sweep_results.results_pivot(records, labels, failed_gate=plan.failed_gate)}
{t4_section}
{tradeoff_section}
### How many tokens fit (the loss step only, by the theory)

{sweep_results.theory_agreement(records, labels)}

{theory.fits_table(primary_methods(), V, D, cards, labels, cannot_run)}
""", headline=headline, facts=facts, smoke=P.smoke);
