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
# # 04 · Cut Cross-Entropy, built up from the naive loss
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/04_kernel_walkthrough.ipynb) [![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)](https://kaggle.com/kernels/welcome?src=https://github.com/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/04_kernel_walkthrough.ipynb)
#
# A language model's last step turns each of N token embeddings (rows of **E**, N×D) into V
# scores, one per vocabulary entry (rows of the classifier **C**, V×D), and the loss compares
# them with the target tokens **x**. Written naively it builds the N×V logit matrix, and for
# today's vocabularies that matrix is the largest tensor in training.
#
# This notebook builds the method of *Cut Your Losses in Large-Vocabulary Language Models*
# (Wijmans et al., arXiv 2411.09009) one idea at a time, so that at the end the logit matrix
# visibly never has to exist:
#
# 1. **The memory arithmetic**: what the logits cost, and what no method can avoid.
# 2. **The decomposition** loss = LSE − (C<sup>T</sup>E)<sub>x</sub>: why only N numbers must be kept.
# 3. **Algorithm 1**, the indexed dot.
# 4. **Algorithm 2**, the online log-sum-exp.
# 5. **The backward**: recompute, G = S − 1[v = x], dE = G C, dC = G<sup>T</sup> E.
# 6. **The gradient filter**: skip tiles of G too small to matter.
# 7. **The softmax sparsity curve**: why there is so much to skip on real data.
# 8. **Vocabulary sorting**: gather the large entries into fewer tiles.
# 9. **Kahan summation**: keep low-precision accumulation honest.
#
# Then what the production kernel does differently, and, on a GPU, what it all buys at a real
# model's head: memory and time of your kernels, the naive loss and the production kernel.
#
# Each step has the same shape, after [Triton-Puzzles](https://github.com/srush/Triton-Puzzles):
# the formula, a plain PyTorch **spec**, a small Triton **kernel**, and a **check** that they agree
# (and, where it makes sense, that they agree with this package's production kernels). The kernels
# here are written for reading, not speed; `helpers/cce/kernels/` holds the fast ones. On a CPU
# they run under the Triton interpreter.
#
# **Your turn** cells ask you to write code: a warm-up kernel, two lines of PyTorch, three pieces
# of Triton inside the real kernels (the online merge of the forward, the dC accumulation of the
# backward, and a stretch: the production kernel's filter rule) and one line of Kahan summation.
# Each gap holds `raise NotImplementedError`: run the cell and its check says *not filled in yet*;
# write your code and run the cell again until the check says *right*. A wrong answer is told what
# looks wrong. Every check runs your current code on fresh inputs, so running a check again never
# turns a wrong answer right. Until yours is right, later cells use a worked solution kept out of
# sight, so the notebook always runs to the end.
#
# ## The session (90 minutes)
#
# **You will** see why the logits are the largest tensor in training, write the two reductions of
# the forward pass and the gradient of the backward without them, and measure what that buys.
# **You need** PyTorch, and the softmax and its gradient; no Triton (the primer covers what is
# used). **You run** the notebook on a GPU (Colab or Kaggle's free T4 should be enough: it passes on a
# pretend T4, a larger GPU held to a T4's memory, shared memory and fp16, but has not run on a real one) or
# on a Linux CPU,
# where the kernels run under Triton's interpreter, in fp32 and fp16 (the interpreter's bf16 is
# broken): the bf16 stories of sections 6 and 9 are then told on fp16 or emulated in PyTorch.
#
# | min | section | you |
# |---|---|---|
# | 10 | 1-2 · memory arithmetic, the decomposition | move the sliders; discuss: what must survive the forward? |
# | 15 | primer · Triton in ten minutes | complete the warm-up kernel |
# | 10 | 3 · the indexed dot | exercise 1 (PyTorch) |
# | 15 | 4 · the online log-sum-exp | exercise 2 (Triton: the merge inside the forward kernel) |
# | 15 | 5 · the backward | exercise 3 (derive G), exercise 4 (Triton: dC's accumulation) |
# | 10 | 6-8 · filter, sparsity, sorting | read the pictures; discuss the dE error after sorting |
# | 5 | 9 · Kahan summation | exercise 5 (one line) |
# | 10 | 10-11 · production, the payoff | discuss: why are the teaching kernels so much slower? stretch exercise |
#
# **If time runs out**, stop after section 5: the method is complete there. Skip the fp16 aside of
# section 5 and section 9 first; section 10 reads well at home. The stretch exercise (section 10)
# is for whoever finishes early.
#
# **Run time** (the whole notebook, with no one typing; every run prints its seconds per section
# and writes them to `results.json`'s `section_seconds`): on a 2-core CPU 17-30 s, attendee or
# teacher, fp32 or the T4's fp16 (the longest section about 6 s; more while other work shares the
# cores); on an H200 as a pretend T4 (fp16, 64 KB of
# shared memory enforced) 22 s as an attendee and 15 s as the teacher, the longest section the
# online log-sum-exp (6 s, its kernels compiling) and the payoff (4 s); on the H200 as itself 51 s
# and 20 s, the attendee's first run compiling longer (`docs/measurements/h200-2026-12-02/workshop-04/`).
# A real T4 multiplies fp16 about twelve times slower than an H200 (and in Triton kernels, these
# included, on its CUDA cores, not its tensor cores), so expect the payoff to take longer there; the
# minutes above are for people, not for the machine.
# **Needs Triton**, which installs on Linux only: on macOS or Windows open the notebook in Colab or
# Kaggle (the badges above).
#
# **Teachers:** `SOLUTIONS = True` in the parameters cell fills every gap with the worked
# solutions (the test suite runs so); `show_solution("fold_tile")` prints one; `exercises.reset(name)`
# forgets one attendee's result. Widgets (sections 1 and 6) need a live kernel; a headless run
# shows their first picture only.

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
import helpers  # first: on a CPU it switches the Triton interpreter on before any kernel is defined

import json
import math
import time
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from helpers.cce import linear_cross_entropy
from helpers.cce.options import tile_eps
from helpers.compare.inputs import make_inputs
from helpers.lab.profiles import get_profile
from helpers.suite.report import write_report_fragment
from helpers.spec import reference_loss_and_grads, relative_error
from helpers.lab.teaching import (
    DIAGNOSES,
    VOCABULARIES,
    Exercises,
    SectionTimer,
    block_mask,
    check,
    check_exercise,
    entries_per_row,
    expand_mask,
    gigabytes,
    kahan_step,
    masks_agree,
    memory_footprint,
    row_mass_mask,
    show_solution,  # noqa: F401  (for the teacher: show_solution("fold_tile") prints one)
    skipped_fraction,
    teaching_block_d,
    vocabulary_order,
)

# %% tags=["parameters"]
profile = "auto"
output_dir = "results/04_kernel_walkthrough"
SOLUTIONS = False  # attendees: False; True: the worked solutions fill every "your turn" gap (teacher, test suite)

# %%
P = get_profile(profile)
cfg = P.section("04_kernel_walkthrough")
device = P.torch_device
dtype = getattr(torch, cfg["dtype"])  # inputs of the kernel steps
low_precision = getattr(torch, cfg["low_precision"])  # the accumulator of the Kahan kernel
BLOCK_N, BLOCK_V = cfg["BLOCK_N"], cfg["BLOCK_V"]
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(cfg["seed"])

# Kernel against spec, as a relative L2 error. Forward quantities (the indexed dot, the LSE, the
# loss): both sides sum exact products of the same rounded inputs, the kernel in fp32, so they
# agree to fp32 rounding in every dtype. Backward: the kernel also rounds G to `dtype` before its
# two products (tensor cores take both operands in one dtype), about that dtype's rounding; a
# kernel that drops a tile, a target or the scale misses these bounds by orders of magnitude.
FORWARD_BOUND = 1e-5
BACKWARD_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
# fp32 tl.dot would use tf32 (10-bit mantissa) on a GPU unless asked for "ieee".
DOT_PRECISION = "ieee" if dtype == torch.float32 else None
# The production kernels' launch configurations: their own choice on a GPU. The interpreter's cost
# grows with the number of tiles, so on a CPU we ask for the T4 tier's larger tiles.
PRODUCTION_CONFIGS = "turing-64k" if device.type == "cpu" else None
# The teaching kernels load D in chunks of BLOCK_D, as large as fits this card's shared memory
# (all of D under the CPU interpreter, which has no such limit).
SHARED_MEMORY = helpers.device_info(device).shared_memory_per_block_bytes

plt.rcParams.update({"font.size": 16, "axes.titlesize": 18, "lines.linewidth": 3, "figure.dpi": 80})
results = {"profile": P.name, "device": helpers.device_info(device).describe(), "solutions": SOLUTIONS,
           "checks": [], "exercises": {}, "numbers": {}}
started = time.perf_counter()
section = SectionTimer()  # section("...") at each section's first cell: seconds per section in results.json
exercises = Exercises(SOLUTIONS, seed=cfg["seed"])
results["exercises"] = exercises.right  # filled in as the checks run
print(f"profile {P.name!r} on {results['device']}; kernel inputs in {cfg['dtype']}")


def record(result: dict) -> None:
    results["checks"].append(result)


def close_to(got, want, name, bound=FORWARD_BOUND):
    """The notebook's one kernel-vs-spec check: relative L2 error at most ``bound``."""
    record(check(name, got, want, rel_l2=bound))


def random_inputs(N, V, D, generator):
    """E (N, D), C (V, D), x (N,) in the notebook's dtype and device, drawn from ``generator``."""
    E_ = (torch.randn(N, D, generator=generator) / D**0.25).to(dtype).to(device)
    C_ = (torch.randn(V, D, generator=generator) / D**0.25).to(dtype).to(device)
    return E_, C_, torch.randint(0, V, (N,), generator=generator).to(device)


# %% [markdown]
# ## 1 · The memory arithmetic
#
# The naive loss computes the logits $z = E C^{\mathsf T}$ (N×V) and a softmax over each row.
# Its memory is
#
# $$\text{logits} = N \cdot V \cdot \text{bytes}, \qquad \text{lower bound} = \underbrace{N D \cdot\text{bytes}}_{dE} + \underbrace{V D\cdot\text{bytes}}_{dC}.$$
#
# The lower bound is what *any* method must hand back: the two gradients. Everything above it is
# the price of the method. The numbers come from one plain function, `memory_footprint`; below we
# print them for the Qwen3-0.6B head (V = 151,936, D = 1,024) at N = 16,384 tokens (a batch of 8
# sequences of 2,048).

# %%
section("1 · the memory arithmetic")
from helpers.compare.heads import QWEN3

footprint = memory_footprint(16_384, QWEN3.V, QWEN3.D, "float32")
for item, n_bytes in footprint.items():
    print(f"{item:>12}: {gigabytes(n_bytes):9.4f} GB")
print(f"fp32 logits are {footprint['logits'] / footprint['lower_bound']:.0f}× the lower bound, "
      f"the naive loss's peak {footprint['naive_peak'] / footprint['lower_bound']:.0f}×")
assert round(gigabytes(footprint["logits"]), 2) == 9.96 and round(gigabytes(footprint["lower_bound"]), 2) == 0.69
results["numbers"]["qwen3_fp32_logits_gb_at_16384"] = gigabytes(footprint["logits"])
results["numbers"]["qwen3_naive_peak_gb_at_16384"] = gigabytes(footprint["naive_peak"])

# %% [markdown]
# 9.96 GB for one tensor, on a 16 GB card, before a single weight or activation of the model.
# And the naive loss holds more than that at once: inside the backward of `log_softmax` three
# fp32 N×V tensors are alive together (the log-softmax saved by the forward, the gradient handed
# to it, the gradient it returns), **12 bytes per logit: 29.9 GB** here, whatever the input dtype
# (notebook 02 measures it). The gradients themselves, the lower bound, need 0.69 GB in fp32,
# half that in bf16.
#
# **Explore** (interactive: run in Jupyter, Colab or Kaggle). The sliders call the same
# `memory_footprint` (nothing is computed only in the widget). At the defaults the naive peak is
# past the red line, a free T4's 16 GB: how many tokens fit under it?

# %%
def show_memory(N=16_384, vocabulary="Qwen3 (151,936)", D=1_024, dtype=cfg["dtype"], card_gb=16.0):
    f = memory_footprint(N, VOCABULARIES[vocabulary], D, dtype)
    bars = [(f"logits ({dtype})", f["logits"], "C1")]
    if "logits_fp32" in f:  # 16-bit inputs: the upcast copy is a second tensor
        bars.append(("logits, fp32 copy", f["logits_fp32"], "C1"))
    bars += [("naive peak, all at once (12 bytes per logit)", f["naive_peak"], "C3"),
             (f"lower bound dE + dC ({dtype})", f["lower_bound"], "C2")]
    fig, ax = plt.subplots(figsize=(10, 4))
    sizes = [gigabytes(b) for _, b, _ in bars]
    ax.barh([label for label, _, _ in bars], sizes, color=[c for _, _, c in bars])
    for y, size in enumerate(sizes):  # the value beside each bar: the lower bound's is too thin to see
        ax.annotate(f"{size:,.2f} GB", (size, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=9)
    ax.axvline(card_gb, color="red", linestyle="--", label=f"card: {card_gb:g} GB")
    ax.set_xlim(0, max(max(sizes), card_gb) * 1.18)  # room for the labels
    ax.set_xlabel("GB")
    fig.suptitle(f"N = {N:,}, {vocabulary}, D = {D:,}, inputs in {dtype}")
    ax.legend(loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    return fig


fig = show_memory()
fig.savefig(out / "memory.png")
plt.show()

# %%
from ipywidgets import Dropdown, FloatText, SelectionSlider

from helpers.lab.widgets import explore

def explore_memory(**settings):
    show_memory(**settings)
    plt.show()


explore(
    explore_memory,
    N=SelectionSlider(options=[2**k for k in range(10, 18)], value=16_384, description="N tokens"),
    vocabulary=Dropdown(options=list(VOCABULARIES), value="Qwen3 (151,936)"),
    D=Dropdown(options=[768, 1_024, 2_048, 2_304, 4_096], value=1_024),
    dtype=Dropdown(options=["float32", "bfloat16", "float16"], value=cfg["dtype"]),
    card_gb=FloatText(value=16.0, description="card GB"),
);

# %% [markdown]
# ## 2 · The decomposition: only N numbers must survive the forward pass
#
# For row $i$ with target $x_i$, cross-entropy is minus the log of the softmax at the target:
#
# $$\ell_i = -\log \frac{e^{z_{i,x_i}}}{\sum_v e^{z_{i,v}}} = \underbrace{\log \sum_v e^{(C^{\mathsf T} E_i)_v}}_{\mathrm{LSE}_i} \;-\; \underbrace{C_{x_i}^{\mathsf T} E_i}_{(C^{\mathsf T}E)_{x_i}}.$$
#
# Two terms, each one number per row:
#
# - the **indexed dot** $C_{x_i}^{\mathsf T} E_i$ needs one row of C per token: N·D work, no V at all;
# - the **log-sum-exp** needs every logit of the row, but only as a running reduction: it can be
#   computed block by block and the block thrown away.
#
# And the backward needs the softmax $S_{i,v} = e^{z_{i,v} - \mathrm{LSE}_i}$, which we can
# *recompute* from E, C and the N numbers $\mathrm{LSE}_i$. So between forward and backward we
# keep N floats, not N×V. The spec, checked against `F.cross_entropy`:

# %%
section("2 · the decomposition")
N, V, D = cfg["shape"]  # ragged on purpose: no dimension is a multiple of a block
E, C, x = random_inputs(N, V, D, torch.Generator().manual_seed(cfg["seed"]))


def loss_spec(E, C, x):
    """ℓ_i = LSE_i - C_{x_i} . E_i, (N,), in float64."""
    z = E.double() @ C.double().T  # (N, V): fine for a spec on small shapes
    return torch.logsumexp(z, dim=1) - z[torch.arange(len(x)), x]


want = F.cross_entropy(E.double() @ C.double().T, x, reduction="none")
record(check("loss = LSE - indexed dot  vs  F.cross_entropy", loss_spec(E, C, x), want, atol=1e-12))
print(f"N={N}, V={V}, D={D}; kept between passes: {N * 4} bytes of LSE instead of {N * V * 4:,} of logits")

# %% [markdown]
# ## Primer · Triton in ten minutes
#
# A Triton kernel is a Python function, compiled for the GPU, that runs once per **program**;
# the **grid** says how many programs (`kernel[(n_programs,)](...)`), and `tl.program_id(0)` tells
# each program which one it is. A program does not handle one element, like a CUDA thread, but a
# **block** of them at once: `tl.arange(0, BLOCK)` is the vector 0..BLOCK-1, and every operation
# works on whole blocks (vectors or 2-D tiles). BLOCK sizes are `tl.constexpr`: fixed when the
# kernel is compiled, powers of two.
#
# - **Pointers and offsets.** A tensor arrives as a pointer to its first element; `ptr + offsets`
#   is a block of pointers. A row-major (R, D) matrix's element (r, d) is at `ptr + r * D + d`, so
#   `rows[:, None] * D + d[None, :]` addresses a (len(rows), len(d)) tile.
# - **Masks.** The last block usually runs past the end. `tl.load(ptrs, mask=m, other=0.0)` reads
#   only where `m` is true (0 elsewhere); `tl.store(ptrs, values, mask=m)` writes only there.
# - **Reductions and products.** `tl.sum`, `tl.max` (with `axis=`), `tl.exp`, and `tl.dot(a, b)`:
#   a (M, K) by (K, N) tile product on the tensor cores, M, N, K at least 16, accumulated in fp32.
# - **Why tiles.** A tile loaded once is reused by every product in it: a (BLOCK_N, BLOCK_D) block
#   of E serves BLOCK_V logits per row. The tiles live in the multiprocessor's on-chip memory
#   (registers and shared memory: 64 KB per block on a T4), which is why tile sizes depend on the
#   card (`teaching_block_d` picks ours) and why only tiles, never the N×V matrix, exist.
# - **Atomics.** When several programs add into the same output, `tl.atomic_add` makes the adds safe.
#
# **Shapes in this notebook** (a cheat-sheet): `E` (N, D) and `C` (V, D) inputs; `x` (N,) targets;
# logits `z = E Cᵀ` (N, V), never stored; `lse` (N,); `S`, `G` (N, V) in the specs, (BLOCK_N,
# BLOCK_V) tiles in the kernels; `dE` (N, D), `dC` (V, D). A program owns `BLOCK_N` rows and walks
# the vocabulary in `BLOCK_V` columns and D in `BLOCK_D` chunks.
#
# ### Warm-up: your first kernel
# `out = alpha * x + y` over `n` elements, `BLOCK` per program. The offsets and the mask are
# written; load `y` and store the result.

# %%
section("primer · Triton in ten minutes")


@triton.jit
def scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last program's block runs past n
    x = tl.load(x_ptr + offsets, mask=mask)  # noqa: F841  (the attendee's gap uses it)
    # ---- your turn: load y, store alpha * x + y ----
    raise NotImplementedError
    # ---- end of your turn ----


def check_scaled_add(kernel):
    g = exercises.fresh()
    n = int(torch.randint(1_000, 3_000, (1,), generator=g))  # not a multiple of BLOCK
    x_, y_ = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)

    def launch(x_, y_):
        out_ = torch.full_like(x_, float("nan"))  # an element never stored stays nan
        kernel[(triton.cdiv(n, 256),)](x_, y_, out_, n, 0.5, BLOCK=256)
        return out_

    def diagnose(got, want):
        if torch.isnan(got).any():
            return f"{int(torch.isnan(got).sum())} elements never stored: store every offset below n, under the mask"
        return "the stored values are not alpha * x + y"

    return check_exercise("warm-up: alpha * x + y", launch, lambda x_, y_: 0.5 * x_ + y_, [(x_, y_)],
                          atol=1e-6, rtol=1e-6, diagnose=diagnose)


exercises.check("scaled_add", scaled_add_kernel, check_scaled_add)

# %% [markdown]
# ## 3 · Algorithm 1: the indexed dot
#
# $$o_i = C_{x_i}^{\mathsf T} E_i = \sum_{d} E_{i,d}\, C_{x_i, d}$$
#
# ### Your turn (1): the indexed dot in PyTorch
# Write $o$ (N,) from `E` (N, D), `C` (V, D) and `x` (N,) without forming the N×V logits.
# *Hint:* PyTorch indexes a tensor's rows with a tensor of indices.

# %%
section("3 · the indexed dot")


def indexed_dot_spec(E, C, x):
    """o (N,) in float64."""
    # ---- your turn: one line, no (N, V) tensor ----
    raise NotImplementedError
    # ---- end of your turn ----
    return o  # noqa: F821  (defined in the gap above, by the attendee)


def indexed_dot_truth(E, C, x):  # the answer read off the full logits: what we want to avoid
    return (E.double() @ C.double().T)[torch.arange(len(x)), x]


def check_indexed_dot(attempt):  # fresh inputs at every run, a ragged shape and a tiny one
    E_, C_, x_ = random_inputs(37, 211, 24, exercises.fresh())
    return check_exercise("indexed dot", attempt, indexed_dot_truth, [(E_, C_, x_), (E_[:5], C_[:7], x_[:5] % 7)],
                          atol=1e-9, rtol=1e-9, diagnose=DIAGNOSES["indexed_dot"])


exercises.check("indexed_dot", indexed_dot_spec, check_indexed_dot)

# %% [markdown]
# The kernel: each program owns `BLOCK_N` rows, loads their targets, and gathers the matching rows
# of C. D fits in one block here (`BLOCK_D` is D rounded up to a power of two): no tile product,
# so nothing goes through shared memory. Inputs are read in their dtype and multiplied in fp32.

# %%
@triton.jit
def indexed_dot_kernel(
    E_ptr, C_ptr, x_ptr, o_ptr,  # E (N, D), C (V, D) contiguous; x (N,); o (N,) fp32
    N, D,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < N
    mask = row_mask[:, None] & (d < D)[None, :]
    target = tl.load(x_ptr + rows, mask=row_mask, other=0)  # (BLOCK_N,)
    e = tl.load(E_ptr + rows[:, None] * D + d[None, :], mask=mask, other=0.0)
    c = tl.load(C_ptr + target[:, None] * D + d[None, :], mask=mask, other=0.0)  # the gather
    tl.store(o_ptr + rows, tl.sum(e.to(tl.float32) * c.to(tl.float32), axis=1), mask=row_mask)


def indexed_dot(E, C, x, block_n=BLOCK_N):
    N, D = E.shape
    o = torch.empty(N, dtype=torch.float32, device=E.device)
    indexed_dot_kernel[(triton.cdiv(N, block_n),)](
        E, C, x, o, N, D, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D))
    return o


close_to(indexed_dot(E, C, x), exercises.use("indexed_dot")(E, C, x), "Algorithm 1 kernel vs spec")

# %% [markdown]
# ## 4 · Algorithm 2: the log-sum-exp, one vocabulary block at a time
#
# $\log\sum_v e^{z_v}$ overflows if computed as written (fp32's `exp` overflows past 88), so one
# subtracts the maximum: $\mathrm{LSE} = m + \log \sum_v e^{z_v - m}$ with $m = \max_v z_v$.
# Over blocks, each block $b$ keeps a pair $(m_b, s_b)$ with $s_b = \sum_{v\in b} e^{z_v - m_b}$,
# and two pairs merge exactly:
#
# $$m = \max(m_1, m_2), \qquad s = s_1\, e^{m_1 - m} + s_2\, e^{m_2 - m}, \qquad \mathrm{LSE} = m + \log s.$$
#
# First on numbers: a row of six logits, large enough that the naive formula overflows.

# %%
section("4 · the online log-sum-exp")
z_row = torch.tensor([1000.0, 998.0, 1001.0, 3.0, 999.5, 1002.0])
block1, block2 = z_row[:3], z_row[3:]
m1, s1 = block1.max(), torch.exp(block1 - block1.max()).sum()
m2, s2 = block2.max(), torch.exp(block2 - block2.max()).sum()
m = torch.maximum(m1, m2)
s = s1 * torch.exp(m1 - m) + s2 * torch.exp(m2 - m)
print(f"naive log(sum(exp(z)))     = {torch.log(torch.exp(z_row).sum()).item()}")
print(f"block 1: m1 = {m1.item():7.1f}, s1 = {s1.item():.6f}")
print(f"block 2: m2 = {m2.item():7.1f}, s2 = {s2.item():.6f}")
print(f"merged:  m  = {m.item():7.1f}, s  = {s.item():.6f}, LSE = m + log s = {(m + torch.log(s)).item():.6f}")
print(f"torch.logsumexp(z)         = {torch.logsumexp(z_row, 0).item():.6f}")
record(check("merge identity on numbers", m + torch.log(s), torch.logsumexp(z_row, 0), atol=1e-4))

# %% [markdown]
# The spec folds the blocks in one by one with that merge: this *online* form is what the kernel
# will do.

# %%
def merge_lse(m1, s1, m2, s2):
    """The (m, s) pair of two blocks together: both sums rescaled to the larger maximum."""
    m = torch.maximum(m1, m2)
    return m, s1 * torch.exp(m1 - m) + s2 * torch.exp(m2 - m)


def lse_spec(E, C, block_v):
    """LSE_i = log sum_v exp(E_i . C_v), (N,), one (N, block_v) logit block alive at a time."""
    m = torch.full((E.shape[0],), -math.inf, dtype=torch.float64, device=E.device)
    s = torch.zeros(E.shape[0], dtype=torch.float64, device=E.device)
    for v0 in range(0, C.shape[0], block_v):
        z = E.double() @ C[v0 : v0 + block_v].double().T  # (N, block_v), then discarded
        m, s = merge_lse(m, s, z.max(dim=1).values, torch.exp(z - z.max(dim=1, keepdim=True).values).sum(1))
    return m + torch.log(s)


record(check("online LSE spec vs torch.logsumexp", lse_spec(E, C, BLOCK_V),
             torch.logsumexp(E.double() @ C.double().T, dim=1), atol=1e-10))

# %% [markdown]
# The kernel: each program owns `BLOCK_N` rows and walks the whole vocabulary. The `(BLOCK_N,
# BLOCK_V)` logit tile is built by `tl.dot` in on-chip memory, `BLOCK_D` columns of E and C at a
# time, folded into `(m, s)` and dropped. Global memory sees E and C read, and N floats written.
# Columns past V are set to −∞, which adds $e^{-\infty} = 0$.
#
# ### Your turn (2): the merge, in Triton
# The fold is yours: `fold_tile` gets each row's running pair, `m` and `s` (both `(BLOCK_N,)`,
# fp32), and the new logit tile `z` (`(BLOCK_N, BLOCK_V)`), and returns the pair after it. The
# tile is one block of the merge above, with its own maximum and sum. `m_new` is written; fill in
# `s_new`. *Hints:* `tl.exp`, `tl.sum(..., axis=1)`, and `m_new[:, None]` to broadcast a row's
# value over its columns. The kernel calls whatever `fold_tile` you pass it (`FOLD`), so the check
# runs your line inside the real kernel, against the spec, on fresh inputs and on logits large
# enough that a fold without the maximum overflows.

# %%
@triton.jit
def fold_tile(m, s, z):
    """Each row's running (m, s) after the logit tile z (BLOCK_N, BLOCK_V)."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    # ---- your turn: s_new, from s and the tile, both rescaled to m_new ----
    raise NotImplementedError
    # ---- end of your turn ----
    return m_new, s_new  # noqa: F821  (defined in the gap above, by the attendee)


# %%
@triton.jit
def lse_kernel(
    E_ptr, C_ptr, lse_ptr,  # E (N, D), C (V, D) contiguous; lse (N,) fp32
    N, V, D,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FOLD: tl.constexpr,  # a @triton.jit (m, s, z) -> (m, s): fold_tile
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        # 1. the logit tile, on chip only: z = E[rows] C[cols]^T, BLOCK_D columns of D at a time
        z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            e = tl.load(E_ptr + rows[:, None] * D + d[None, :],
                        mask=(rows < N)[:, None] & (d < D)[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
            c = tl.load(C_ptr + cols[None, :] * D + d[:, None],
                        mask=(d < D)[:, None] & (cols < V)[None, :], other=0.0)  # (BLOCK_D, BLOCK_V) = C^T
            z = tl.dot(e, c, z, input_precision=DOT_PRECISION)  # z + e c
        z = tl.where((cols < V)[None, :], z, float("-inf"))
        # 2. [merge] fold the tile into each row's (m, s): section 4's identity, in fold_tile
        m, s = FOLD(m, s, z)
    # 3. LSE = m + log s
    tl.store(lse_ptr + rows, m + tl.log(s), mask=rows < N)


def lse(E, C, fold=None, block_n=BLOCK_N, block_v=BLOCK_V, block_d=None):
    """LSE (N,) fp32 of the logits E C^T; ``fold``: the merge the kernel calls (when None, yours
    once its check passed, else the worked solution); ``block_d``: D's chunk (None: what fits)."""
    N, D = E.shape
    out_lse = torch.empty(N, dtype=torch.float32, device=E.device)
    lse_kernel[(triton.cdiv(N, block_n),)](
        E, C, out_lse, N, C.shape[0], D, BLOCK_N=block_n, BLOCK_V=block_v,
        BLOCK_D=block_d or teaching_block_d(D, block_n, block_v, SHARED_MEMORY), DOT_PRECISION=DOT_PRECISION,
        FOLD=fold if fold is not None else exercises.use("fold_tile"))
    return out_lse


# %%
def check_fold_tile(fold):
    """Your fold inside the LSE kernel, on fresh inputs: a ragged shape, and logits past 88 where a
    bare exp overflows fp32."""
    E_, C_, _ = random_inputs(45, 3 * BLOCK_V + 17, 24, exercises.fresh())
    return check_exercise("the merge inside the LSE kernel", lambda E, C: lse(E, C, fold),
                          lambda E, C: lse_spec(E, C, BLOCK_V), [(E_, C_), (E_[:7] * 50, C_[:100])],
                          atol=0.0, rtol=FORWARD_BOUND, diagnose=DIAGNOSES["fold_tile"])


exercises.check("fold_tile", fold_tile, check_fold_tile)

# %% [markdown]
# The kernel with the merge in place (yours once it is right), against the spec; and the same
# LSE with D loaded in chunks of 16, so that the loop over D is checked even where all of D fits.

# %%
lse_E_C = lse(E, C)
close_to(lse_E_C, lse_spec(E, C, BLOCK_V), "Algorithm 2 kernel vs spec")
close_to(lse(E, C, block_d=16), lse_E_C, "Algorithm 2 kernel, D in chunks of 16 vs all of D")

# %% [markdown]
# The two algorithms together are the forward pass: $\ell = \mathrm{LSE} - o$. We check the mean
# loss against the float64 reference and against the package's production Cut Cross-Entropy.
#
# `production_loss_and_grads` is the one place this notebook calls the production kernels
# (`helpers.cce.linear_cross_entropy`). Until section 6 we switch its gradient filter off, so
# that it computes what our kernels compute.

# %%
def production_loss_and_grads(E, C, x, **options):
    """(loss, dE, dC) of the mean loss from the package's production CCE."""
    E_, C_ = E.detach().clone().requires_grad_(True), C.detach().clone().requires_grad_(True)
    loss = linear_cross_entropy(E_, C_, x, reduction="mean", configs=PRODUCTION_CONFIGS, **options)
    loss.backward()
    return loss.detach(), E_.grad, C_.grad


def forward_loss(E, C, x):
    return (lse(E, C) - indexed_dot(E, C, x)).mean()


loss_ours = forward_loss(E, C, x)
loss_ref, dE_ref, dC_ref = reference_loss_and_grads(E, C, x)
loss_prod, dE_prod, dC_prod = production_loss_and_grads(E, C, x, filter_eps=None)
close_to(loss_ours, loss_ref, "forward: teaching kernels vs float64 reference")
close_to(loss_ours, loss_prod.float(), "forward: teaching kernels vs production")
print(f"mean loss {loss_ours.item():.6f} (float64 reference {loss_ref.item():.6f})")

# %% [markdown]
# ## 5 · The backward: recompute, then two products
#
# The mean loss is $L = \frac1N \sum_i \ell_i$ with $\ell_i = \mathrm{LSE}_i - z_{i,x_i}$, and
# $\partial\,\mathrm{LSE}_i / \partial z_{i,v} = S_{i,v}$, the softmax, $S_{i,v} = e^{z_{i,v} -
# \mathrm{LSE}_i}$. Call $G = \partial L / \partial z$ (N×V). The chain rule through
# $z = E C^{\mathsf T}$ then gives the two products
#
# $$dE = G\,C \quad (N\times D), \qquad dC = G^{\mathsf T} E \quad (V\times D).$$
#
# No stored logits are needed: tile by tile, the kernel rebuilds $z$ from E and C, turns it into
# $S$ with the saved $\mathrm{LSE}$, forms G's tile, and adds the tile's share to dE and dC.
# Compared with keeping the logits that costs one more N×V×D product (the recomputation), in
# exchange for N×V fewer bytes.
#
# ### Your turn (3): the gradient with respect to the logits
# Derive $G_{i,v}$ from the two lines above (what does $-z_{i,x_i}$ contribute, and where?), then
# write it: `G` (N, V) from the softmax `S` (N, V) and the targets `x` (N,). The check compares it
# with what autograd finds for the logits; then the spec turns it into dE and dC.

# %%
section("5 · the backward")


def logit_gradient(S, x):
    """G (N, V) of the mean loss, from the softmax S (N, V) and the targets x (N,)."""
    # ---- your turn: G, derived above ----
    raise NotImplementedError
    # ---- end of your turn ----
    return G  # noqa: F821  (defined in the gap above, by the attendee)


def logit_gradient_truth(S, x):  # autograd's answer; log S are logits whose softmax is S
    z = S.log().requires_grad_(True)
    F.cross_entropy(z, x).backward()
    return z.grad


def check_logit_gradient(attempt):
    E_, C_, x_ = random_inputs(29, 150, 16, exercises.fresh())
    S_ = torch.softmax(E_.double() @ C_.double().T, dim=1)
    return check_exercise("G, the gradient of the mean loss w.r.t. the logits", attempt, logit_gradient_truth,
                          [(S_, x_), (torch.softmax(E_[:5].double() @ C_[:7].double().T, dim=1), x_[:5] % 7)],
                          atol=0.0, rtol=1e-9, diagnose=DIAGNOSES["logit_gradient"])


exercises.check("logit_gradient", logit_gradient, check_logit_gradient)

# %% [markdown]
# Once the check passes, `show_solution("logit_gradient")` prints the worked answer. The spec of the
# whole backward, from your G, checked against autograd's dE and dC:

# %%
def backward_spec(E, C, x, lse_rows, keep=None):
    """(dE, dC) of the mean loss, float64, given the forward's LSE (N,).

    keep (N, V) bool, optional: the entries of G to use (section 6's filter); all when None.
    """
    E64, C64 = E.double(), C.double()
    S = torch.exp(E64 @ C64.T - lse_rows.double()[:, None])  # (N, V): recomputed, not stored
    G = exercises.use("logit_gradient")(S, x)
    if keep is not None:
        G = G * keep
    return G @ C64, G.T @ E64


lse_ref = torch.logsumexp(E.double() @ C.double().T, dim=1)
for name, got, want in zip(("dE", "dC"), backward_spec(E, C, x, lse_ref), (dE_ref, dC_ref)):
    close_to(got, want, f"backward spec vs float64 autograd: {name}", 1e-10)

# %% [markdown]
# The kernel: one program per `BLOCK_N` rows, walking the vocabulary like the forward, and D in
# chunks of `BLOCK_D` twice per tile: once to rebuild the logits, once for the two products. dE's
# rows belong to this program alone, so it adds its share with a plain load, add and store. dC's
# tile is shared by every row block, so each program must add its share with `tl.atomic_add` into
# an fp32 buffer. G is rounded to the input dtype before the products (tensor cores want both
# operands in one dtype), and rounded *unscaled*: the mean's 1/N multiplies the products' fp32
# results, not G. Why, in fp16, is the subject of the aside after the checks (`SCALE_BEFORE_CAST`
# there does it the wrong way).
#
# The kernel already has the **filter** of the next section: a tile is skipped when `KEEP_TILE`
# says so (`keep_tile` below: every $|S - \mathbb 1|$ below `eps`), and the kernel writes which
# tiles it computed to `tile_kept`. With `eps = 0` nothing is skipped.
#
# ### Your turn (4): dC's share of a tile, in Triton
# `add_dC_tile` gets the pointer to dC (V, D) (fp32, row-major), the G tile `G` (BLOCK_N,
# BLOCK_V) in the input dtype, E's chunk `e` (BLOCK_N, BLOCK_D), the tile's vocabulary indices
# `cols` (BLOCK_V,) and D indices `d` (BLOCK_D,), the sizes V and D, and `scale` (the 1/N to apply
# after the product). Add the tile's share of $dC = G^{\mathsf T} E$ into dC. *Hints:*
# `tl.trans`, `tl.dot`, the primer's pointer arithmetic and masks, and why a plain store is wrong
# here. The check runs your function inside the backward kernel, against the spec, on fresh inputs.

# %%
@triton.jit
def add_dC_tile(dC_ptr, G, e, cols, d, V, D, scale):
    """dC[cols, d] += scale * G^T e, safely although every row block adds to the same tile."""
    # ---- your turn: the (BLOCK_V, BLOCK_D) product and its masked, atomic add into dC ----
    raise NotImplementedError
    # ---- end of your turn ----


@triton.jit
def keep_tile(G, eps):
    """The paper's filter rule: compute a tile unless every |G| in it is below eps."""
    return tl.max(tl.abs(G)) >= eps


# %%
@triton.jit
def backward_kernel(
    E_ptr, C_ptr, x_ptr, lse_ptr,  # E (N, D), C (V, D) contiguous; x (N,); lse (N,) fp32
    dE_ptr, dC_ptr,  # dE (N, D) fp32; dC (V, D) fp32, zero-filled, accumulated atomically
    tile_kept_ptr,  # (cdiv(N, BLOCK_N), cdiv(V, BLOCK_V)) bool: tiles whose products ran
    N, V, D,
    grad_scale,  # 1/N for the mean
    eps,  # filter threshold on |S - onehot|; 0 keeps every tile
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SCALE_BEFORE_CAST: tl.constexpr,  # the wrong way, for the fp16 aside: G * grad_scale rounded
    KEEP_TILE: tl.constexpr,  # a @triton.jit (G, eps) -> keep?: keep_tile
    ADD_DC: tl.constexpr,  # a @triton.jit adding a tile's share into dC: add_dC_tile
):
    pid_n = tl.program_id(0)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    target = tl.load(x_ptr + rows, mask=row_mask, other=-1)
    lse_rows = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    for vb in range(0, tl.cdiv(V, BLOCK_V)):
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        tile_mask = row_mask[:, None] & (cols < V)[None, :]
        # 1. recompute the logit tile (over D in chunks) and its softmax from the saved LSE
        z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            e = tl.load(E_ptr + rows[:, None] * D + d[None, :],
                        mask=row_mask[:, None] & (d < D)[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
            c = tl.load(C_ptr + cols[:, None] * D + d[None, :],
                        mask=(cols < V)[:, None] & (d < D)[None, :], other=0.0)  # (BLOCK_V, BLOCK_D)
            z = tl.dot(e, tl.trans(c), z, input_precision=DOT_PRECISION)
        S = tl.exp(z - lse_rows[:, None])
        # 2. G = S - 1[v = x], zero outside the matrix
        G = tl.where(cols[None, :] == target[:, None], S - 1.0, S)
        G = tl.where(tile_mask, G, 0.0)
        # 3. [filter] skip the tile when the rule says its products round away
        keep = KEEP_TILE(G, eps)
        if keep:
            # 4. G in the input dtype, scaled after the products (in fp32) unless told otherwise
            if SCALE_BEFORE_CAST:
                G_low = (G * grad_scale).to(E_ptr.dtype.element_ty)
                scale_after = 1.0
            else:
                G_low = G.to(E_ptr.dtype.element_ty)
                scale_after = grad_scale
            # 5. dE += G C into this program's own rows; dC += G^T E, shared by every row block
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_mask = row_mask[:, None] & (d < D)[None, :]
                e = tl.load(E_ptr + rows[:, None] * D + d[None, :], mask=d_mask, other=0.0)
                c = tl.load(C_ptr + cols[:, None] * D + d[None, :],
                            mask=(cols < V)[:, None] & (d < D)[None, :], other=0.0)
                dE_ptrs = dE_ptr + rows[:, None] * D + d[None, :]
                dE_part = tl.dot(G_low, c, input_precision=DOT_PRECISION) * scale_after
                tl.store(dE_ptrs, tl.load(dE_ptrs, mask=d_mask, other=0.0) + dE_part, mask=d_mask)
                ADD_DC(dC_ptr, G_low, e, cols, d, V, D, scale_after)
        tl.store(tile_kept_ptr + pid_n * tl.cdiv(V, BLOCK_V) + vb, keep)


def backward(E, C, x, lse_rows, eps=0.0, scale_before_cast=False, block_n=BLOCK_N, block_v=BLOCK_V,
             block_d=None, keep=None, add_dC=None):
    """(dE, dC, tile_kept) of the mean loss; dE and dC in fp32. ``keep``, ``add_dC``: the filter
    rule and dC's accumulation the kernel calls (None: keep_tile, and exercise 4's in use)."""
    (N, D), V = E.shape, C.shape[0]
    dE = torch.zeros(N, D, dtype=torch.float32, device=E.device)
    dC = torch.zeros(V, D, dtype=torch.float32, device=E.device)
    tile_kept = torch.empty(triton.cdiv(N, block_n), triton.cdiv(V, block_v), dtype=torch.bool,
                            device=E.device)
    backward_kernel[(triton.cdiv(N, block_n),)](
        E, C, x, lse_rows, dE, dC, tile_kept, N, V, D, 1.0 / N, eps,
        BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d or teaching_block_d(D, block_n, block_v, SHARED_MEMORY),
        DOT_PRECISION=DOT_PRECISION, SCALE_BEFORE_CAST=scale_before_cast, KEEP_TILE=keep or keep_tile,
        ADD_DC=add_dC or exercises.use("add_dC_tile"))
    return dE, dC, tile_kept


def check_add_dC_tile(add_dC):
    """Your dC accumulation inside the backward kernel, on fresh ragged inputs, against the spec's dC."""
    E_, C_, x_ = random_inputs(2 * BLOCK_N + 5, 2 * BLOCK_V + 9, 24, exercises.fresh())
    lse_ = torch.logsumexp(E_.double() @ C_.double().T, dim=1).float()
    dC_want = backward_spec(E_, C_, x_, lse_)[1]
    unit = dC_want.abs().max()  # compared in units of dC's largest entry: the input dtype's rounding
    return check_exercise("dC's accumulation inside the backward kernel",
                          lambda E, C: backward(E, C, x_, lse_, block_d=16, add_dC=add_dC)[1] / unit,
                          lambda E, C: dC_want / unit, [(E_, C_)],
                          atol=BACKWARD_BOUND, rtol=0.0, diagnose=DIAGNOSES["add_dC_tile"])


exercises.check("add_dC_tile", add_dC_tile, check_add_dC_tile)

# %% [markdown]
# The whole backward kernel (with your dC once it is right) against the spec and production, and
# with D in chunks of 16:

# %%
dE_ours, dC_ours, _ = backward(E, C, x, lse_E_C)
dE_spec, dC_spec = backward_spec(E, C, x, lse_E_C)
close_to(dE_ours, dE_spec, "backward kernel vs spec: dE", BACKWARD_BOUND)
close_to(dC_ours, dC_spec, "backward kernel vs spec: dC", BACKWARD_BOUND)
close_to(dE_ours, dE_prod.double(), "backward kernel vs production: dE", BACKWARD_BOUND)
close_to(dC_ours, dC_prod.double(), "backward kernel vs production: dC", BACKWARD_BOUND)
for name, chunked, whole in zip(("dE", "dC"), backward(E, C, x, lse_E_C, block_d=16), (dE_ours, dC_ours)):
    close_to(chunked, whole, f"backward kernel, D in chunks of 16 vs all of D: {name}", BACKWARD_BOUND)

# %% [markdown]
# ### Aside: why G is rounded unscaled (fp16)
#
# A T4 computes in fp16, whose smallest positive number is 2<sup>-24</sup> ≈ 6·10<sup>-8</sup>
# (below 2<sup>-14</sup> it is *subnormal*: fewer significant bits the smaller it gets). The
# gradient of the mean loss with respect to a logit is G/N, and a softmax entry is about 1/V: at
# the GPU profile's N = 1,031 and V = 32,011 that is 3·10<sup>-8</sup>, which rounds to 0 or to 2<sup>-24</sup>.
# Rounded *before* the products, those entries are lost or badly rounded, and with them most of dC
# and dE's small terms. Rounded *after* (G = S − onehot, entries about 1/V, in fp16's normal range),
# only the usual fp16 rounding remains. The same kernel both ways, in fp16, against float64:

# %%
section("5b · aside: fp16")
E16, C16 = E.to(torch.float16), C.to(torch.float16)
lse16 = lse(E16, C16)
dE16_spec, dC16_spec = backward_spec(E16, C16, x, lse16)
G_over_N = (torch.softmax(E16.double() @ C16.double().T, dim=1) - F.one_hot(x, C16.shape[0]).double()) / len(x)
in_fp16 = G_over_N.to(torch.float16)
print(f"N = {len(x):,}, V = {C16.shape[0]:,}: entries of G/N that are 0 in fp16: {(in_fp16 == 0).double().mean().item():.1%}, "
      f"subnormal: {((in_fp16 != 0) & (in_fp16.abs() < 2.0**-14)).double().mean().item():.1%}")
scaled_errors = {}
for before in (True, False):
    dE16, dC16, _ = backward(E16, C16, x, lse16, scale_before_cast=before)
    way = "G/N rounded to fp16" if before else "G rounded, 1/N after"
    scaled_errors[way] = {"dE": relative_error(dE16, dE16_spec), "dC": relative_error(dC16, dC16_spec)}
    print(f"{way:<22}: dE error {scaled_errors[way]['dE']:.2e}, dC error {scaled_errors[way]['dC']:.2e}")
results["numbers"]["fp16_scale_before_or_after_cast"] = scaled_errors
gap = scaled_errors["G/N rounded to fp16"]["dE"] / scaled_errors["G rounded, 1/N after"]["dE"]
if gap < 10:  # a small profile's G/N is inside fp16's normal range: the lesson needs the GPU profile's shape
    print(f"At this shape G/N's typical entry, 1/(N V) = {1 / (len(x) * C16.shape[0]):.1e}, keeps most of its bits in "
          f"fp16 (normal from 6.1e-05, subnormal down to 6.0e-08 with fewer bits): the two ways differ {gap:.1f}x here. At the GPU profile's N = 1,031, V = 32,011 "
          "(3.0e-08 an entry) an H200 measured dE 1.06e-02 rounded first against 4.36e-05 after (244x), dC 3.52e-03 "
          "against 4.35e-05 (81x): docs/measurements/h200-2026-12-01b/suite-gpu-quick/04_kernel_walkthrough/results.json")
record({"name": "fp16: rounding G/N first is no more accurate than rounding G and scaling after",
        "ok": gap >= 0.9, "gap": gap})
close_to(dE16, dE16_spec, "fp16 backward kernel (G unscaled) vs spec: dE", 2e-3)
close_to(dC16, dC16_spec, "fp16 backward kernel (G unscaled) vs spec: dC", 2e-3)

# %% [markdown]
# The production kernel does the same: it keeps G = S − onehot unscaled in the input dtype and
# applies each row's upstream gradient (1/N here, or the GradScaler's scale in fp16 training)
# to the products' fp32 results. A loss that rounds G/N in the forward pass, before a trainer's
# loss scale reaches it, cannot be rescued by that scale: notebook 03 measures what it costs Liger
# in fp16 training. In bf16 (fp32's range, 8 significant bits) the two ways differ only by rounding.
#
# One entry the production kernel forms differently: the target's. Here `S - 1.0` subtracts two
# numbers near 1 when the model is sure of the target (p → 1), and `S` itself came from
# `exp(z - lse)`, two rounded numbers of the logits' size: the row's gradient is then wrong by about
# one unit in the last place of |z| however small 1 − p is. The production forward also sums each
# row's softmax mass *without* the target's column, r = 1 − p, and the backward writes −r (times the
# row's coefficients) there, so a confident token's gradient keeps fp32's relative precision
# (`tests/cce/test_confident.py`; the README's Caveats give the figures).

# %% [markdown]
# That is the whole method: forward keeps N floats, backward recomputes. Peak memory is the
# inputs, the two gradients and O(N), which is the lower bound of section 1. What remains is
# speed: the backward does two N×V×D products per tile plus the recomputation. The next three
# ideas aim to make most tiles cheap (how far the production kernel gets is the last section's
# story).
#
# ## 6 · The gradient filter
#
# Most entries of $S$ are tiny. Adding a tiny number to a low-precision sum changes nothing, so
# the products of tiles made only of tiny entries can be skipped. How tiny? bf16 stores 8
# significant bits (7 in the mantissa, one implicit): the step after 1 is $2^{-7}$, and anything
# up to half of it rounds away.

# %%
section("6 · the gradient filter")
one = torch.tensor(1.0, dtype=torch.bfloat16)
print(f"{'k':>3} {'1 + 2^-k in bf16':>18} {'survives?':>10}   (fp16 for comparison)")
survives_bf16 = {}
for k in range(6, 13):
    total = one + 2.0**-k  # computed and rounded in bf16
    total_fp16 = torch.tensor(1.0, dtype=torch.float16) + 2.0**-k
    survives_bf16[k] = bool(total != one)
    print(f"{k:>3} {total.item():>18.10f} {str(survives_bf16[k]):>10}   {total_fp16.item():.10f}")
assert survives_bf16[7] and not survives_bf16[8] and not survives_bf16[9] and not survives_bf16[10]
results["numbers"]["bf16_smallest_surviving_k"] = max(k for k, v in survives_bf16.items() if v)

# %% [markdown]
# So in bf16, $1 + 2^{-9}$ and $1 + 2^{-10}$ are both exactly 1: everything from $2^{-8}$ down
# vanishes. A row of G has entries of order 1 (at the target, $S_x - 1$; at the top predictions).
# An entry below $2^{-12}$ is at least $2^{4} = 16$ times under what a bf16 sum of order 1 can
# still register, so even a handful of them together is lost in rounding. The paper takes
# $\varepsilon = 2^{-12}$ for bf16; the factor of 16 below $2^{-8}$ is the margin. (The same ratio
# for fp16, whose step after 1 is $2^{-10}$, gives $2^{-15}$: the production kernel's default for
# fp16. For fp32 it leaves the filter off.)
#
# The filter works on **tiles**, because a GPU program computes a whole `BLOCK_N × BLOCK_V` tile
# or nothing. A tile is skipped when every entry has $|G| < \varepsilon$ (the paper's rule; the
# production kernel's is stricter, see the end); a tile holding a target is never skipped (there
# $|S_x - 1|$ is large). `block_mask` in `helpers.lab.teaching` is the spec.
#
# What there is to skip depends on the data, and benchmarks on random data mislead both ways: a
# near-uniform softmax (every entry about 1/V, below $2^{-12}$) lets the filter skip almost every
# tile, while random logits of larger spread scatter hundreds of significant entries over every
# row and leave nothing to skip. A trained model sits in between. We use data built to look like
# one (`helpers.compare.inputs.make_inputs(..., regime="realistic")`; section 7 shows its softmax): a small head for the kernel, which the CPU
# interpreter runs slowly, and a larger one, in plain PyTorch, for the pictures.

# %%
EPS = 2.0**-12
Ns, Vs, Ds = cfg["sparse"]
E_s, C_s, x_s = make_inputs(Ns, Vs, Ds, dtype, device, regime="realistic", seed=cfg["seed"])
G_s = torch.softmax(E_s.double() @ C_s.double().T, dim=1) - F.one_hot(x_s, Vs).double()  # spec only

lse_s = lse(E_s, C_s)
dE_filt, dC_filt, kept_filt = backward(E_s, C_s, x_s, lse_s, eps=EPS)
_, dE_s64, dC_s64 = reference_loss_and_grads(E_s, C_s, x_s)

record(masks_agree("filter: the kernel's tiles vs block_mask", kept_filt, G_s, BLOCK_N, BLOCK_V, EPS))
print(f"kernel, N = {Ns}, V = {Vs:,}, {BLOCK_N} x {BLOCK_V} tiles: skipped {skipped_fraction(kept_filt):.1%} of "
      f"{kept_filt.numel()} tiles at eps = 2^-12")

# %% [markdown]
# Two questions. Does the kernel compute what the spec computes *on the tiles it keeps*? The
# spec takes the same tiles (`expand_mask` turns the tile mask into an N×V entry mask). And what
# does skipping cost? The filter is an approximation: compare its error with the error of merely
# *storing* the exact gradient in the run's 16-bit dtype, which every such training run pays anyway. In an
# fp16 run (the T4's) that yardstick is 8 times finer than bf16's, and $2^{-12}$ is bf16's ε: the cell also
# runs fp16's own, $2^{-15}$.

# %%
keep_s = expand_mask(kept_filt, BLOCK_N, BLOCK_V, Ns, Vs)  # (Ns, Vs) bool
dE_filt_spec, dC_filt_spec = backward_spec(E_s, C_s, x_s, lse_s, keep=keep_s)
close_to(dE_filt, dE_filt_spec, "filtered kernel vs spec on the same tiles: dE", BACKWARD_BOUND)
close_to(dC_filt, dC_filt_spec, "filtered kernel vs spec on the same tiles: dC", BACKWARD_BOUND)

# The yardstick: the exact gradients stored in this run's 16-bit dtype (bf16's where the run is fp32).
storage_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
storage_name = str(storage_dtype).removeprefix("torch.")
storage_error = {"dE": relative_error(dE_s64.to(storage_dtype), dE_s64),
                 "dC": relative_error(dC_s64.to(storage_dtype), dC_s64)}


def filter_cost(dE, dC, G, keep, label):
    """Print and return the filter's error against float64, next to the error of storing the exact gradient."""
    dropped = (G.abs() * ~keep).sum(dim=1).mean().item()  # softmax mass left out, per row
    errors = {"dE": relative_error(dE, dE_s64), "dC": relative_error(dC, dC_s64), "dropped_mass_per_row": dropped}
    print(f"{label}: dropped softmax mass per row {dropped:.1e}")
    for k in ("dE", "dC"):
        print(f"   {k}: error {errors[k]:.2e}  ({errors[k] / storage_error[k]:.1f}× storing the exact {k} in {storage_name})")
    return errors


results["numbers"]["storage_error"] = {"dtype": storage_name, **storage_error}
results["numbers"]["filter_error"] = filter_cost(dE_filt, dC_filt, G_s, keep_s, "filtered, original order")
if dtype == torch.float16:  # fp16's own threshold: the same margin of 16 below half its step after 1
    dE_f16, dC_f16, kept_f16 = backward(E_s, C_s, x_s, lse_s, eps=2.0**-15)
    print(f"at fp16's own eps = 2^-15: skipped {skipped_fraction(kept_f16):.1%} of the tiles")
    results["numbers"]["filter_error_fp16_eps"] = filter_cost(
        dE_f16, dC_f16, G_s, expand_mask(kept_f16, BLOCK_N, BLOCK_V, Ns, Vs), "filtered at 2^-15, original order")

# %% [markdown]
# The tile mask as a picture, on the larger head: each cell is one `BLOCK_N × BLOCK_V` tile of G,
# dark where the products run, light where they are skipped. We checked above that the kernel
# skips exactly the tiles `block_mask` marks, so the spec can draw it, with the same tiles
# (`BLOCK_N` x `BLOCK_V`, this profile's; the production kernel's are larger). Each row's few dozen large
# entries (section 7 counts them) are spread over more vocabulary blocks than on the small head, so more
# tiles hold none of them. How much is skipped depends on the tile as much as on the data: a tile of more
# rows is more likely to catch one row's large entry. The table under the picture counts it.

# %%
Nc, Vc, Dc = cfg["curve"]
E_c, C_c, x_c = make_inputs(Nc, Vc, Dc, torch.float32, device, regime="realistic", seed=cfg["seed"])
z_c = E_c.double() @ C_c.double().T  # (Nc, Vc): plain PyTorch, no kernel
S_c = torch.softmax(z_c, dim=1)
G_c = S_c - F.one_hot(x_c, Vc).double()
mask_c = block_mask(G_c, BLOCK_N, BLOCK_V, EPS)


MASK_COLOURS = ListedColormap(["#dbe9f6", "#08519c"])  # False: skipped (light), True: computed (dark)


def draw_mask(ax, mask, title):
    ax.imshow(mask.cpu().numpy(), cmap=MASK_COLOURS, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel(f"vocabulary block ({BLOCK_V} tokens each)")
    ax.set_ylabel(f"row block ({BLOCK_N} rows)")
    ax.legend(handles=[Patch(color=MASK_COLOURS(1), label="computed"), Patch(color=MASK_COLOURS(0), label="skipped")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=12)


fig, ax = plt.subplots(figsize=(12, 4))
draw_mask(ax, mask_c, f"N = {Nc}, V = {Vc:,}, {BLOCK_N} x {BLOCK_V} tiles, ε = 2^-12: "
                     f"{skipped_fraction(mask_c):.0%} of tiles skipped")
fig.tight_layout()
fig.savefig(out / "block_mask.png")
plt.show()

for k in (8, 10, 12, 14, 16, 20):
    print(f"eps = 2^-{k:<2}: {skipped_fraction(block_mask(G_c, BLOCK_N, BLOCK_V, 2.0**-k)):6.1%} of tiles skipped")
results["numbers"]["tiles_skipped_unsorted"] = skipped_fraction(mask_c)

# The same data and ε, other tiles: this profile's, the T4 profile's rows, and production-sized ones.
order_c = vocabulary_order(E_c, C_c)
tile_sizes = sorted({(BLOCK_N, BLOCK_V), (32, 64), (128, 64), (128, 256)})
by_tile = {f"{bn} x {bv}": {"original order": skipped_fraction(block_mask(G_c, bn, bv, EPS)),
                            "sorted (section 8)": skipped_fraction(block_mask(G_c[:, order_c], bn, bv, EPS))}
           for bn, bv in tile_sizes}
print("\ntiles skipped at eps = 2^-12, by tile (rows x columns):")
for tile, skipped in by_tile.items():
    print(f"  {tile:>9}{' (this run)' if tile == f'{BLOCK_N} x {BLOCK_V}' else '':<11}: "
          + ", ".join(f"{k} {v:5.1%}" for k, v in skipped.items()))
results["numbers"]["tiles_skipped_by_tile"] = by_tile

# %% [markdown]
# **Explore** (interactive: run in Jupyter, Colab or Kaggle). Move the threshold: the picture and
# the fraction come from the same `block_mask`.

# %%
from ipywidgets import IntSlider


def show_filter(log2_eps=-12):
    mask = block_mask(G_c, BLOCK_N, BLOCK_V, 2.0**log2_eps)
    fig, ax = plt.subplots(figsize=(12, 4))
    draw_mask(ax, mask, f"ε = 2^{log2_eps}: {skipped_fraction(mask):.0%} of tiles skipped")
    fig.tight_layout()
    plt.show()


explore(show_filter, log2_eps=IntSlider(value=-12, min=-24, max=-2, description="log2 ε"));

# %% [markdown]
# ## 7 · The softmax sparsity curve
#
# Why is there anything to skip? Sort each row's probabilities from largest to smallest and
# plot them (the paper's Figure 3, made there with Gemma-2's real weights: about 50 entries per
# row above $2^{-12}$, under 0.02% of the vocabulary).
#
# We have no trained model here, so `helpers.compare.inputs.make_inputs(..., regime="realistic")` builds logits that behave like one:
# $z_{i,v} = b_v + \text{noise}_{i,v}$ with a Zipf bias $b_v = -\alpha \log(1 + \mathrm{rank}_v)$
# over a random order of the vocabulary (a few frequent tokens are likely in *every* row) and
# gaussian noise of standard deviation σ (each row is different), targets sampled from the
# softmax. With σ = 4, α = 2 a few dozen entries per row exceed $2^{-12}$ (the cell prints this run's
# count; it grows slowly with V) and the mean loss is 1-2 nats. For contrast, random E and C as benchmarks often use them (C scaled by
# 2/√D, logits of standard deviation 2): hundreds of significant entries, spread over the row.

# %%
section("7 · the softmax sparsity curve")
S_random = torch.softmax((torch.randn(Nc, Dc, device=device) @ (torch.randn(Vc, Dc, device=device) * 2 / Dc**0.5).T).double(), dim=1)
per_row = entries_per_row(S_c, EPS)
mean_loss = F.cross_entropy(z_c, x_c).item()
print(f"V = {Vc:,}: {per_row:.1f} entries per row above 2^-12 ({per_row / Vc:.3%} of the vocabulary), "
      f"mean loss {mean_loss:.2f} nats")
print(f"random E, C: {entries_per_row(S_random, EPS):.1f} entries per row above 2^-12")
assert 20 <= per_row <= 120 and 0.8 <= mean_loss <= 3.0
results["numbers"].update(entries_per_row=per_row, mean_loss_nats=mean_loss)


# Ranks on a log grid: the plot's x axis is logarithmic, so 300 ranks show the whole curve.
ranks = torch.unique(torch.logspace(0, math.log10(Vc), 300).round().long()).clamp(max=Vc)


def row_quantiles(S, qs=(0.1, 0.5, 0.9), rows=64):
    """Sort each row descending; at each rank in `ranks`, quantiles over the first `rows` rows."""
    at_ranks = S[:rows].float().sort(dim=1, descending=True).values[:, ranks.to(S.device) - 1]  # (rows, ranks)
    return {q: at_ranks.quantile(q, dim=0).cpu() for q in qs}


fig, ax = plt.subplots(figsize=(10, 5.5))
for S_, label, colour in ((S_c, "trained-like (realistic regime)", "C0"), (S_random, "random E, C", "C7")):
    q = row_quantiles(S_)
    ax.plot(ranks, q[0.5], color=colour, label=label)
    ax.fill_between(ranks, q[0.1], q[0.9], color=colour, alpha=0.2)
ax.axhline(EPS, color="red", linestyle="--", label="ε = 2^-12")
ax.set(xscale="log", yscale="log", ylim=(1e-12, 1.5), xlabel="rank within the row",
       ylabel="softmax probability", title="Sorted softmax: median and 10-90% of 64 rows")
ax.legend()
fig.tight_layout()
fig.savefig(out / "sparsity_curve.png")
plt.show()

# %% [markdown]
# ## 8 · Vocabulary sorting
#
# The filter skips a *tile*, and a tile needs every one of its `BLOCK_N × BLOCK_V` entries to be
# small. The ~50 large entries of each row are scattered over the vocabulary, so a tile of many
# rows often catches one. But many of them are the *same* tokens in every row (the frequent
# ones). Reorder the vocabulary so that tokens with large average logit come first, and those
# entries crowd into the first few vocabulary blocks, leaving the rest skippable.
#
# The order needs no logits: $\frac1N\sum_i z_{i,v} = \big(\tfrac1N \sum_i E_i\big)\cdot C_v$, one
# (V×D)·(D) product (`vocabulary_order`). Sorting is a permutation of C's rows: the loss does not
# change, dC comes back in sorted order and is permuted back. First the kernel, on the small head:

# %%
section("8 · vocabulary sorting")


def sort_vocabulary(E, C, x):
    """(C sorted, x renumbered, order): order[j] is the original token at sorted position j."""
    order = vocabulary_order(E, C)
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order), device=order.device)
    return C[order].contiguous(), position[x], order


C_sorted, x_sorted, order_s = sort_vocabulary(E_s, C_s, x_s)
# A row's LSE is a sum over the whole vocabulary, in any order: the forward's lse serves as it is.
lse_sorted = lse_spec(E_s, C_sorted, BLOCK_V)
close_to(lse_s, lse_sorted, "LSE unchanged by sorting")
dE_sort, dC_sort_perm, kept_sorted = backward(E_s, C_sorted, x_sorted, lse_s, eps=EPS)
dC_sort = torch.empty_like(dC_sort_perm)
dC_sort[order_s] = dC_sort_perm  # back to the original vocabulary order

record(masks_agree("sorted: the kernel's tiles vs block_mask", kept_sorted, G_s[:, order_s], BLOCK_N, BLOCK_V, EPS))
keep_sorted = expand_mask(kept_sorted, BLOCK_N, BLOCK_V, Ns, Vs)[:, torch.argsort(order_s)]  # original order
dE_sort_spec, dC_sort_spec = backward_spec(E_s, C_s, x_s, lse_s, keep=keep_sorted)
close_to(dE_sort, dE_sort_spec, "sorted + filtered kernel vs spec on the same tiles: dE", BACKWARD_BOUND)
close_to(dC_sort, dC_sort_spec, "sorted + filtered kernel vs spec on the same tiles: dC", BACKWARD_BOUND)
results["numbers"]["filter_error_sorted"] = filter_cost(dE_sort, dC_sort, G_s, keep_sorted, "filtered, sorted")

# %% [markdown]
# Read the error lines honestly. Sorting skips more tiles, so more of each row's |G| is left out (the
# next cell counts the entries and their mass). dC barely notices; dE's error grows with what is dropped,
# past what storage in the run's dtype costs. The paper reports training curves unchanged with the filter,
# and has variants that keep one gradient unfiltered (CCE-Kahan-FullC / FullE; `full_c=True` /
# `full_e=True` in `helpers.cce`). Whether it matters for a given model is a measurement.
#
# **Discuss:** the production kernel, given the same `filter_eps`, is run at the end of this section; its
# cell prints how many of its tiles it skipped beside ours. Before reading section 10: what could make a
# kernel with the same ε skip fewer tiles, or more?

# %%
print(f"kernel tiles skipped: {skipped_fraction(kept_filt):.1%} unsorted -> {skipped_fraction(kept_sorted):.1%} sorted "
      f"({int(kept_filt.sum())} -> {int(kept_sorted.sum())} of {kept_filt.numel()} tiles computed)")
for label, keep_ in (("original order", keep_s), ("sorted", keep_sorted)):
    entries = ((G_s.abs() > 0) & ~keep_).sum(dim=1).double().mean().item()
    mass = (G_s.abs() * ~keep_).sum(dim=1).mean().item()
    print(f"  {label}: per row, {entries:,.0f} of {Vs:,} entries dropped, their |G| summing to {mass:.1e} "
          f"({mass / EPS:.1f} eps; a row's |G| sums to 2 - 2 S_x)")
results["numbers"]["kernel_tiles_skipped"] = {"unsorted": skipped_fraction(kept_filt),
                                              "sorted": skipped_fraction(kept_sorted)}

# %% [markdown]
# And the picture on the larger head, before and after sorting:

# %%
mask_c_sorted = block_mask(G_c[:, vocabulary_order(E_c, C_c)], BLOCK_N, BLOCK_V, EPS)
before, after = skipped_fraction(mask_c), skipped_fraction(mask_c_sorted)
print(f"tiles skipped: {before:.1%} in the original order -> {after:.1%} sorted; "
      f"tiles computed: {int(mask_c.sum()):,} -> {int(mask_c_sorted.sum()):,} of {mask_c.numel():,}")
results["numbers"]["tiles_skipped_sorted"] = after

fig, axes = plt.subplots(2, 1, figsize=(12, 7))
draw_mask(axes[0], mask_c, f"vocabulary in original order, {BLOCK_N} x {BLOCK_V} tiles: {before:.0%} of tiles skipped")
draw_mask(axes[1], mask_c_sorted, f"sorted by average logit, {BLOCK_N} x {BLOCK_V} tiles: {after:.0%} of tiles skipped")
fig.tight_layout()
fig.savefig(out / "sorting.png")
plt.show()

# %% [markdown]
# The production kernel has both as options (`filter_eps`, `sort_vocab=True`). Its tiles have
# another size and its rule another form (section 10), so it skips other tiles, and its result differs
# from ours by the filter's approximation, not by rounding. So we compare each with float64, and count
# what each skipped. The checks: ours within 2% of float64 (what the dropped mass above allows), and
# production within 8 times the error of storing the exact gradient in the run's dtype: a margin chosen,
# not derived (its rule keeps what one skipped tile takes from a row below ε per 256 columns, section 10;
# over many skipped tiles a row can lose more).

# %%
prod_stats = {}
_, dE_prod_s, dC_prod_s = production_loss_and_grads(E_s, C_s, x_s, filter_eps=EPS, sort_vocab=True, stats=prod_stats)
prod_skipped = prod_stats.get("skipped", 0) / max(1, prod_stats.get("tiles", 0))
units = "(row, tile) pairs" if prod_stats.get("backward") == "sparse" else "tiles"  # what its stats count
print(f"skipped with filter_eps = 2^-12, sorted: ours {skipped_fraction(kept_sorted):.1%} of "
      f"{kept_sorted.numel()} tiles ({BLOCK_N} x {BLOCK_V}); production ({prod_stats.get('backward')} backward) "
      f"{prod_skipped:.1%} of {prod_stats.get('tiles', 0):,} {units}")
results["numbers"]["production_tiles_skipped_sorted"] = prod_skipped
FILTER_ERROR_BOUND = 2e-2
for name, ours, theirs, want in (("dE", dE_sort, dE_prod_s, dE_s64), ("dC", dC_sort, dC_prod_s, dC_s64)):
    errors = {"ours": relative_error(ours, want), "production": relative_error(theirs, want)}
    production_bound = 8 * storage_error[name]
    print(f"sorted + filtered {name} vs float64: ours {errors['ours']:.2e}, production {errors['production']:.2e} "
          f"({errors['production'] / storage_error[name]:.1f}x storing it in {storage_name})")
    record({"name": f"sorted + filtered {name}: ours within {FILTER_ERROR_BOUND:g} of float64, production within "
                    f"8x {storage_name} storage ({production_bound:.1e})",
            "ok": errors["ours"] < FILTER_ERROR_BOUND and errors["production"] < production_bound, **errors})

# %% [markdown]
# ## 9 · Kahan summation
#
# The kernels so far accumulate in fp32. A production kernel sometimes accumulates in the input
# dtype instead, e.g. when dE is summed across vocabulary blocks by bf16 atomic adds (Apple's
# default CCE does this; its dE is several times less accurate than the naive bf16 path's, which
# notebook 01's gate measures on a GPU; this
# package's production kernel adds into fp32 scratch instead, and offers `accumulation="kahan"`
# for the folds of dC across row chunks). Each addition rounds to 8 significant bits, and once
# the running sum is large, small terms are lost, exactly as $1 + 2^{-9}$ was above.
#
# Kahan's compensated summation carries the rounding error of each addition in a second variable
# $c$ and feeds it back into the next term:
#
# $$y = t - c, \qquad s' = s + y, \qquad c = \;?, \qquad s = s'.$$
#
# $s' - s$, computed in the low precision, is what the addition *really* added; compare it with
# what it was asked to add. Both $s$ and $c$ stay in the low-precision dtype: twice the memory of
# the accumulator, far better accuracy.
#
# ### Your turn (5): the compensation
# Fill in the line that computes the new `c` in `kahan_add`, one step of the sum: what the
# addition lost, with the sign that the next step's `y = t - c` corrects. `accumulate` runs the
# steps over the terms; tensors in bf16 round after every operation, which is the emulation
# (`.to(torch.bfloat16)` is exact in PyTorch; only the Triton *interpreter* gets bf16 wrong).

# %%
section("9 · Kahan summation")


def kahan_add(s, c, t):
    """(s + t, the new compensation c), every operation rounded to s's dtype."""
    y = t - c
    new_s = s + y
    # ---- your turn: c, what the addition lost ----
    raise NotImplementedError
    # ---- end of your turn ----
    return new_s, c


def plain_add(s, c, t):
    return s + t, c


def accumulate(terms, acc_dtype, add):
    """sum over dim 0 of terms (K, R), each addition ``add`` rounded to acc_dtype: (R,) in acc_dtype."""
    s = torch.zeros(terms.shape[1], dtype=acc_dtype, device=terms.device)
    c = torch.zeros_like(s)
    for t in terms.to(acc_dtype):
        s, c = add(s, c, t)
    return s


def exact_sum(terms, acc_dtype):  # the float64 sum of the same rounded terms
    return terms.to(acc_dtype).double().sum(dim=0)


def check_kahan_add(attempt):  # within one rounding of the exact sum, on fresh terms
    terms_ = torch.rand(1000, 8, generator=exercises.fresh()) * 0.01 + 0.1
    return check_exercise("Kahan compensation", lambda t, d: accumulate(t, d, attempt).double(), exact_sum,
                          [(terms_, torch.bfloat16)], atol=0.0, rtol=2.0**-8, diagnose=DIAGNOSES["kahan_add"])


exercises.check("kahan_add", kahan_add, check_kahan_add)

# %% [markdown]
# How the error grows with the number of terms, bf16 accumulator with and without Kahan, and an
# fp32 accumulator for reference. The terms are positive and of similar size, like the softmax
# mass summed over vocabulary blocks.

# %%
K = cfg["kahan_terms"]
terms = torch.rand(K, 64, generator=torch.Generator().manual_seed(3)) + 0.5  # (K, 64) fp32
checkpoints = [2**k for k in range(4, int(math.log2(K)) + 1)]
curves = {"bf16": [], "bf16 + Kahan": [], "fp32": []}
for k in checkpoints:
    exact = terms[:k].double().sum(dim=0)  # of the fp32 terms; a bf16 accumulator also rounds each term
    for label, acc_dtype, add in (("bf16", torch.bfloat16, plain_add), ("bf16 + Kahan", torch.bfloat16, exercises.use("kahan_add")),
                                  ("fp32", torch.float32, plain_add)):
        curves[label].append(relative_error(accumulate(terms[:k], acc_dtype, add), exact))
for label, errs in curves.items():
    print(f"{label:>13}: relative error after {K:,} terms {errs[-1]:.2e}")
assert curves["bf16 + Kahan"][-1] < curves["bf16"][-1] / 10
results["numbers"]["kahan_errors_at_K"] = {label: errs[-1] for label, errs in curves.items()}

fig, ax = plt.subplots(figsize=(13, 5.5))
for label, errs in curves.items():
    ax.plot(checkpoints, errs, marker="o", label=label)
ax.axhline(2.0**-8, color="gray", linestyle=":", label="half a bf16 step\nafter 1 (2^-8)")
ax.set(xscale="log", yscale="log", xlabel="terms summed", ylabel="relative error",
       title="Accumulating in bf16, with and without Kahan")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
fig.tight_layout()
fig.savefig(out / "kahan.png")
plt.show()

# %% [markdown]
# The plain bf16 sum stops growing near 512, where its step is 4: every term (0.5 to 1.5) is under
# half a step and rounds away. Kahan stays at one rounding of the result however many terms come.
#
# Now where it bites: dE summed over vocabulary blocks, $dE = \sum_b G_{:,b}\, C_b$. Each block's
# product is computed in fp32 and added into a running sum held in bf16 (rounding the product
# too, so even Kahan ends at about bf16's storage error; without it the error is several times
# larger).

# %%
G_scaled = G_s / Ns
block_terms = torch.stack([G_scaled[:, v0 : v0 + BLOCK_V] @ C_s[v0 : v0 + BLOCK_V].double()
                           for v0 in range(0, Vs, BLOCK_V)]).float()  # (V/BLOCK_V, Ns, Ds)
flat = block_terms.reshape(block_terms.shape[0], -1)
dE_exact = block_terms.double().sum(dim=0).reshape(-1)
for label, acc_dtype, add in (("bf16 accumulator", torch.bfloat16, plain_add),
                              ("bf16 + Kahan", torch.bfloat16, exercises.use("kahan_add")),
                              ("fp32 accumulator", torch.float32, plain_add)):
    err = relative_error(accumulate(flat, acc_dtype, add), dE_exact)
    results["numbers"][f"dE_error_{label}"] = err
    print(f"dE over {flat.shape[0]} vocabulary blocks, {label:>16}: relative error {err:.2e}")

# %% [markdown]
# The kernel: each program sums `BLOCK_R` columns of `terms` (K, R) with an accumulator in the
# low-precision dtype, Kahan or not. On a GPU that is bf16; under the CPU interpreter, whose bf16
# is broken, fp16 (same idea, 11 significant bits instead of 8). Its compensated step,
# `kahan_step`, is your `kahan_add` in Triton (`show_solution("kahan_add")` once you are done). The
# check: the kernel rounds exactly like the PyTorch emulation.

# %%
@triton.jit
def accumulate_kernel(
    terms_ptr, out_ptr,  # terms (K, R) fp32 contiguous; out (R,) in the accumulator dtype
    K, R,
    BLOCK_R: tl.constexpr, KAHAN: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = cols < R
    acc_dtype = out_ptr.dtype.element_ty
    s = tl.zeros((BLOCK_R,), dtype=acc_dtype)
    c = tl.zeros((BLOCK_R,), dtype=acc_dtype)
    for k in range(0, K):
        t = tl.load(terms_ptr + k * R + cols, mask=mask, other=0.0).to(acc_dtype)
        if KAHAN:
            s, c = kahan_step(s, c, t)  # c: what the addition lost, fed back into the next term
        else:
            s = s + t
    tl.store(out_ptr + cols, s, mask=mask)


def accumulate_triton(terms, acc_dtype, kahan):
    K, R = terms.shape
    result = torch.empty(R, dtype=acc_dtype, device=terms.device)
    accumulate_kernel[(triton.cdiv(R, 64),)](terms.contiguous(), result, K, R, BLOCK_R=64, KAHAN=kahan)
    return result


kahan_terms = terms[:512].to(device)
for kahan in (False, True):
    got = accumulate_triton(kahan_terms, low_precision, kahan).double()
    want = accumulate(kahan_terms.cpu(), low_precision, exercises.use("kahan_add") if kahan
                      else plain_add).double().to(device)
    # Same roundings in the same order: equal, up to a rare last-bit difference in a few columns.
    close_to(got, want, f"accumulate kernel ({cfg['low_precision']}, kahan={kahan}) vs emulation",
             torch.finfo(low_precision).eps / 4)
    print(f"   error against the exact sum: {relative_error(got, exact_sum(kahan_terms.cpu(), low_precision).to(device)):.2e}")

# %% [markdown]
# ## What we built, and what we left out
#
# | idea | what it buys |
# |---|---|
# | loss = LSE − indexed dot | only N numbers survive the forward |
# | online LSE over vocabulary blocks | the forward never writes a logit |
# | recompute in backward, G = S − 1 | the backward never reads one: no N × V tensor, only the gradients (these kernels return them in fp32, twice the 16-bit lower bound; production returns the input dtype) |
# | gradient filter (ε = 2⁻¹²) | skip tiles whose products round away |
# | vocabulary sorting | gather the frequent tokens so that more tiles are skippable |
# | Kahan summation | low-precision accumulation without its error |
#
# **Caveats of the teaching kernels** (the production kernels in `helpers/cce/kernels/` handle all of
# these): inputs must be contiguous; no `ignore_index`, soft cap or other reductions; no split of
# the vocabulary across programs (a GPU with few row blocks sits idle); dE and dC are returned in
# fp32; E and C are read again for every tile; only D's chunk is sized for the card (one small
# function, `teaching_block_d`), where production picks all its tiles, warps and stages by the
# card's shared memory.
#
# ## 10 · What the production kernel does differently, and why
#
# `helpers.linear_cross_entropy` runs the same algorithms. Five things differ, each for a reason
# found by measuring. The figures below come from `docs/PERFORMANCE.md` (H200 runs, bf16, recorded
# under `docs/measurements/`); the speed of each method at real heads is in the README's "which
# loss" section and notebook 03, which this notebook does not repeat, so that they cannot disagree.
#
# - **The filter bounds each row's mass in a tile, not each entry.** This notebook's kernel (and
#   the paper) skips a tile when every $|G| < \varepsilon$. The production kernel skips it only when,
#   in every row, the tile's $|G|$ entries *sum* to less than $\varepsilon$ per 256 columns
#   ($\varepsilon \cdot$ `BLOCK_V` / 256 for a tile of `BLOCK_V` columns, `helpers.cce.options.tile_eps`;
#   `row_mass_mask` is its spec). Why stricter: on a flat softmax (an untrained model, or Gemma-2's soft cap of 4 over
#   V = 151,936) every entry is about 1/V, below $2^{-12}$, so the paper's rule skips every tile but
#   the targets', and the dropped entries, each negligible, sum to the whole softmax: dE came out
#   2.3·10<sup>-2</sup> off on an H200. Bounding the row mass keeps what one skip drops below ε in
#   every row. On a peaked softmax it skips less than the paper's rule (the cell below counts both, at
#   this profile's tiles), one reason section 8's production dE can be the closer to float64.
# - **G is written per vocabulary chunk and multiplied by cuBLAS, not added with atomics.** Our
#   backward adds each tile's `Gᵀ E` into dC with `tl.atomic_add` (dE stays in registers: a program
#   owns its rows). The production "atomic" backward, which also splits the vocabulary across
#   programs, adds both products: (BLOCK_N + BLOCK_V)·D adds per tile, about 7.5·10<sup>10</sup> at
#   the Gemma-2-2B head, ~300 GB of read-modify-write through L2 for a 2.4 GB result, ~100 of its
#   128 ms. The "gemm" backward (what the default "auto" runs on a flat softmax) writes G for one vocabulary chunk at a time
#   (N × V<sub>c</sub>, in the input dtype, into rows of dC or dE it has not written yet, so a chunk
#   costs no memory) and hands the two products to cuBLAS as dense GEMMs that write each gradient
#   element once per chunk (`helpers/cce/backward/gemm.py`). On Hopper the kernel that writes G is
#   persistent: one program per multiprocessor walks its tiles in one loop, so the next tile's
#   loads run while this tile's G is formed and stored (3 ms of the Gemma-2-2B head's backward on
#   an H200).
# - **It accumulates in fp32.** dE's products add into an fp32 accumulator (a cuBLAS product with
#   fp32 output), rounded once at the end; dC is written once per chunk. Apple's CCE adds dE in
#   bf16 across ~1,000 vocabulary blocks, and its dE is several times less accurate than naive's
#   (notebook 01's gate measures it on a GPU); section 9 is why. Where dC must be folded across row chunks,
#   `accumulation="kahan"` compensates the fold.
# - **The filter saves no time in the "gemm" backward; the sparse backward makes it pay.**
#   In "gemm", a skipped tile is written as zeros, and the dense cuBLAS products multiply the
#   zeros like any other number: the filter changes the result (a little less accurate, sections 6
#   and 8), not the speed. Skipping by tile cannot pay anyway: the rows of a 128-row block do not
#   agree on which tiles matter. `backward_impl="sparse"` (the registry's `ours_sparse`) decides per
#   row, before any logit is rebuilt: the forward keeps one bit per (row, tile) whose softmax mass
#   may reach ε, the backward gathers each tile's marked rows into packs and computes only those,
#   with the vocabulary sorted so that the tiles a row needs sit together
#   (`helpers/cce/backward/sparse.py`). On realistic inputs about a tenth of the pairs are marked
#   and it is faster than the "gemm" backward at the Gemma-2-2B and Qwen3 heads, with dE as accurate
#   as "gemm"'s (the README's figures, from its H200 runs; the default, "auto", runs it there). On a
#   flat softmax (an untrained model) nothing can be skipped and it runs "gemm". On the softmax of a language model
#   trained for the purpose (`helpers.compare.trained`, the `trained` regime) more pairs are
#   marked and the gain shrinks or vanishes: how peaked a softmax is decides whether skipping pays.
# - **Its tiles fit a T4.** The launch configurations are a table keyed by shared memory per
#   block (`helpers/cce/kernels/configs.py`); the Turing tier stays within a T4's 64 KB, and a test
#   compiles every tier for its GPU on a CPU to prove the bytes. Apple's backward, compiled by a
#   current Triton, asks for about 96 KB at its default tiles and cannot launch on a T4. Our teaching
#   kernels load D in chunks sized by `teaching_block_d` for the same reason; kept whole, D = 1,024
#   asked for 128 KB compiled for a T4 (Triton holds 16-bit `tl.dot` operands as fp32 in a T4's
#   shared memory), and a pretend T4 now refuses any kernel past 64 KB, as the card does.
#
# The two filter rules side by side, on a flat softmax and on section 6's trained-like one:

# %%
section("10 · what production does differently")
EPS_ROW = tile_eps(EPS, BLOCK_V)  # the production rule's threshold for one row of a BLOCK_V-column tile
G_flat = torch.full((Nc, Vc), 1.0 / Vc, dtype=torch.float64, device=device) - F.one_hot(x_c, Vc).double()
filter_rules = {}
for label, G_ in (("flat softmax (every S = 1/V)", G_flat), ("trained-like (section 6)", G_c)):
    paper, production = block_mask(G_, BLOCK_N, BLOCK_V, EPS), row_mass_mask(G_, BLOCK_N, BLOCK_V, EPS_ROW)
    dropped = (G_.abs() * ~expand_mask(paper, BLOCK_N, BLOCK_V, Nc, Vc)).sum(dim=1).mean().item()
    filter_rules[label] = {"paper_skipped": skipped_fraction(paper), "row_mass_skipped": skipped_fraction(production),
                           "paper_dropped_mass_per_row": dropped}
    print(f"{label:>28}: the paper's rule skips {skipped_fraction(paper):5.1%} of tiles, dropping {dropped:.2g} of "
          f"each row's |G| (which sums to 2 - 2 S_x); the row-mass rule (eps x {BLOCK_V} / 256 a row) skips "
          f"{skipped_fraction(production):5.1%}")
results["numbers"]["filter_rules"] = filter_rules

# %% [markdown]
# ### Stretch: the production rule, in Triton
# For whoever is done early. Write `keep_tile_row_mass`, the production kernel's rule, for the
# backward kernel's `KEEP_TILE`: keep a tile unless, in **every** row, the tile's |G| entries sum to
# less than `eps` (the check passes the production threshold for these tiles, `EPS_ROW`). `G` is the (BLOCK_N, BLOCK_V) tile (zero outside the matrix). The check runs the
# backward kernel with your rule on section 6's data and on a flat softmax, and compares the tiles
# it computed with `row_mass_mask`.

# %%
@triton.jit
def keep_tile_row_mass(G, eps):
    """Keep the tile (True) unless every row's sum of |G| over it is below eps."""
    # ---- your turn (stretch) ----
    raise NotImplementedError
    # ---- end of your turn ----


def check_keep_tile(rule):
    """Your rule inside the backward kernel, on fresh realistic inputs and on a flat softmax (every
    logit 0, S = 1/V), against row_mass_mask; tiles within 1% of eps may fall either way."""
    seed = int(torch.randint(1 << 30, (1,), generator=exercises.fresh()))
    E_, C_, x_ = make_inputs(Ns, Vs, Ds, dtype, device, regime="realistic", seed=seed)

    def spec_and_borderline(E_):
        G_ = torch.softmax(E_.double() @ C_.double().T, dim=1) - F.one_hot(x_, Vs).double()
        surely, maybe = (row_mass_mask(G_, BLOCK_N, BLOCK_V, EPS_ROW * f).cpu() for f in (1.01, 0.99))
        return row_mass_mask(G_, BLOCK_N, BLOCK_V, EPS_ROW).cpu(), maybe & ~surely

    def kept_tiles(E_):
        lse_ = torch.logsumexp(E_.double() @ C_.double().T, dim=1).float()
        kept = backward(E_, C_, x_, lse_, eps=EPS_ROW, keep=rule)[2].cpu()
        spec, borderline = spec_and_borderline(E_)
        return torch.where(borderline, spec, kept).double()

    def diagnose(got, want):
        extra, missing = int(((got == 1) & (want == 0)).sum()), int(((got == 0) & (want == 1)).sum())
        return (f"{extra} tiles computed that the row-mass rule skips, {missing} skipped that it keeps: "
                "sum |G| along each row (axis=1) first, then ask whether any row reaches eps")

    return check_exercise("stretch: the row-mass filter rule", kept_tiles,
                          lambda E_: spec_and_borderline(E_)[0].double(), [(E_,), (torch.zeros_like(E_),)],
                          atol=0.0, rtol=0.0, diagnose=diagnose)


exercises.check("keep_tile", keep_tile_row_mass, check_keep_tile)

# %% [markdown]
# ## 11 · The payoff, measured (GPU)
#
# One forward and backward at the Qwen3 head (V = 151,936, D = 1,024), three ways: your teaching
# kernels, the naive loss (`helpers.get_method("naive")`) and the production kernel
# (`helpers.linear_cross_entropy`, the registry's `ours`), on the same random inputs, in the
# profile's dtype. N = 16,384 tokens where the card has room for the naive loss's 30 GB, 4,096 on a
# smaller card. `measure` (`helpers.compare.measure`) warms each up, takes its peak memory above
# the inputs, gradients included (`peak_memory`), and its median time (`latency`); an out-of-memory
# error (`is_out_of_memory`) is reported as such instead of stopping the notebook.
#
# The teaching kernels run with the profile's tiles and D in chunks that fit this card's shared
# memory (`teaching_block_d`; on a T4, or a pretend one, 64 KB per block). Expect them to be much
# slower than production.
#
# **Discuss before you run it:** the teaching kernels compute the same products as production.
# Why could they be tens of times slower? (Think of: how many programs a T4's 40 or an H200's 132
# multiprocessors get at N = 4,096 and BLOCK_N = 32; how often E and C are read; every row block
# adding its dC tile with atomics; no autotuning of warps and stages.)

# %%
section("11 · the payoff")
from helpers.compare.measure import loss_step, measure

PAYOFF_BLOCKS = {"block_n": BLOCK_N, "block_v": BLOCK_V}


def teaching_step(E, C, x):
    """One forward and backward with this notebook's kernels: the mean loss, then dE and dC (fp32)."""
    def step():
        lse_rows = lse(E, C, **PAYOFF_BLOCKS)
        loss = (lse_rows - indexed_dot(E, C, x, block_n=PAYOFF_BLOCKS["block_n"])).mean()
        backward(E, C, x, lse_rows, **PAYOFF_BLOCKS)
        return loss
    return step


def measure_payoff(N, V, D):
    """{way: {status, peak_gb, median_ms, error}} of one forward and backward at (N, V, D)."""
    E_p, C_p, x_p = make_inputs(N, V, D, dtype, device, regime="uniform", seed=cfg["seed"], requires_grad=True)
    steps = {"teaching kernels": teaching_step(E_p, C_p, x_p), "naive": loss_step("naive", E_p, C_p, x_p),
             "production": loss_step("ours", E_p, C_p, x_p)}
    found = {}
    for way, step in steps.items():
        try:
            m = measure(step, warmup=1, repeats=3, device=device)
        except triton.runtime.errors.OutOfResources as error:  # shared memory: a kernel's tiles too large
            found[way] = {"status": "does not fit this GPU", "peak_gb": None, "median_ms": None, "error": str(error)}
            continue
        found[way] = {"status": "out of memory" if m.status == "oom" else m.status,
                      "peak_gb": gigabytes(m.peak_bytes) if m.peak_bytes is not None else None,
                      "median_ms": m.latency.median_ms if m.latency else None, "error": m.error}
    return found


# %%
if device.type == "cuda":
    N_payoff = 16_384 if helpers.device_info(device).total_memory_bytes >= 40e9 else 4_096
    payoff = measure_payoff(N_payoff, QWEN3.V, QWEN3.D)
    results["numbers"]["payoff"] = {"N": N_payoff, "V": QWEN3.V, "D": QWEN3.D, "dtype": cfg["dtype"], "ways": payoff}
    print(f"teaching tiles {BLOCK_N} x {BLOCK_V}, D in chunks of {teaching_block_d(QWEN3.D, BLOCK_N, BLOCK_V, SHARED_MEMORY)}")
    print(f"N = {N_payoff:,}, V = {QWEN3.V:,}, D = {QWEN3.D:,}, {cfg['dtype']}; lower bound "
          f"{gigabytes(memory_footprint(N_payoff, QWEN3.V, QWEN3.D, dtype)['lower_bound']):.2f} GB")
    for way, r in payoff.items():
        ok = r["status"] == "ok"
        print(f"{way:>17}: " + (f"{r['peak_gb']:7.2f} GB {r['median_ms']:9.1f} ms" if ok else f"{r['status']}: {r['error'][:120]}"))
    teaching, naive = payoff["teaching kernels"], payoff["naive"]
    if teaching["status"] == "ok":
        naive_held = f"{naive['peak_gb']:.1f} GB" if naive["status"] == "ok" else "more than this card has"
        print(f"Your kernels held {teaching['peak_gb']:.2f} GB where the naive loss held {naive_held}.")
    # On the workshop's own platform the teaching kernels must run: a T4 (or a pretend one) included.
    record({"name": "payoff: the teaching kernels run on this GPU", "ok": teaching["status"] == "ok",
            "status": teaching["status"], "error": teaching["error"]})
else:
    print("Skipped on the CPU: the Qwen3 head's naive step alone allocates 30 GB, and the interpreter would take hours "
          "over the kernels. Run this notebook on a GPU (Colab, Kaggle) to see the payoff.")

# %%
section.stop()
results["section_seconds"] = section.seconds
print("seconds per section: " + "; ".join(f"{name} {sec:.1f}" for name, sec in section.seconds.items()))
results["seconds"] = time.perf_counter() - started
(out / "results.json").write_text(json.dumps(results, indent=2, default=float))
failed = [c["name"] for c in results["checks"] if not c["ok"]]
missing = [name for name, ok in results["exercises"].items() if not ok]
print(f"{len(results['checks']) - len(failed)}/{len(results['checks'])} checks passed, "
      f"{sum(results['exercises'].values())}/{len(results['exercises'])} exercises right, "
      f"{results['seconds']:.1f} s; results in {out / 'results.json'}")
check_rows = "\n".join(f"| {c['name']} | {'ok' if c['ok'] else 'FAIL'} |" for c in results["checks"])
payoff_line = ("" if "payoff" not in results["numbers"] else "The payoff at the Qwen3 head, N = {N:,}: ".format(
    **results["numbers"]["payoff"]) + "; ".join(
    f"{way} {r['peak_gb']:.2f} GB, {r['median_ms']:.0f} ms" if r["status"] == "ok" else f"{way} {r['status']}"
    for way, r in results["numbers"]["payoff"]["ways"].items()) + ".")
write_report_fragment(out, f"""
{len(results['checks']) - len(failed)} of {len(results['checks'])} checks passed (teaching kernels against their
specs and the production kernels); {sum(results['exercises'].values())} of {len(results['exercises'])} exercises
right{" with the worked solutions in place (SOLUTIONS = True)" if SOLUTIONS else ""}; {results['seconds']:.0f} s.
Seconds per section: {"; ".join(f"{name} {sec:.1f}" for name, sec in section.seconds.items())}.
{payoff_line}

| check | result |
|---|---|
{check_rows}

![The memory arithmetic](memory.png)
![The filter's block mask](block_mask.png)
![Softmax sparsity](sparsity_curve.png)
![Vocabulary sorting](sorting.png)
![Kahan summation](kahan.png)
""", headline=f"{len(results['checks']) - len(failed)} of {len(results['checks'])} kernel checks pass; "
    f"{sum(results['exercises'].values())} of {len(results['exercises'])} exercises right" + (
    f"; at the Qwen3 head the teaching kernels held {payoff['teaching kernels']['peak_gb']:.2f} GB"
    if "payoff" in results["numbers"] and payoff["teaching kernels"]["status"] == "ok" else ""), smoke=P.smoke)
assert not failed, f"checks failed: {failed}"
if SOLUTIONS:  # an attendee's open gaps are their work in progress, not a fault of the notebook
    assert not missing, f"worked solutions not right: {missing}"
