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
# # 01 · The correctness gate
#
# A language model's loss is `mean_i( LSE_i − z_{i, x_i} )` over the logits `z = E Cᵀ` (N tokens ×
# V vocabulary). Written naively, that `z` is an N×V matrix: at the Qwen3 head (V = 151,936) and a
# 16,384-token micro-batch it is **9.96 GB in fp32**, alive for one step and then thrown away. The
# methods in this suite (Liger's fused kernel, Apple's Cut Cross-Entropy, PyTorch's chunked
# `linear_cross_entropy`, ours) never build it.
#
# **Why this notebook comes first.** A loss that is fast but wrong does not crash. It returns a
# plausible number, the optimizer takes a plausible step, and the error surfaces weeks later as a
# gap nobody can explain. A slow loss costs hours; a wrong one costs the run. So every method is
# checked here, on the loss and on both gradients `dE` and `dC`, against a float64 reference, before
# any other notebook is allowed to measure it.

# %% tags=["parameters"]
profile = "auto"  # "auto" picks the full run for the GPU found; "cpu", "t4" or "gpu" to choose
output_dir = "results/01_correctness"
methods = None  # None: every registered method
fail_on_peers = False  # True: a failing peer (Liger, Apple CCE, torch LCE) also stops the run

# %%
from pathlib import Path

import torch
from IPython.display import Markdown, display

import helpers
import helpers.report
from helpers.gate import FLOOR, SLACK, gate_cases, run_gate

P = helpers.get_profile(profile)
settings = P.section("01_correctness")
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
device = helpers.profiles.default_device() if P.device == "cuda" else torch.device("cpu")
print(f"profile {P.name}: {P.description}")
print(f"device: {helpers.device_info(device).describe()}")

# %% [markdown]
# ## The methods, and where each can run
#
# One registry holds every method behind one signature,
# `method(E, C, x, *, ignore_index=-100, reduction="mean", softcap=None)`. A method that cannot run
# here says why; it is listed, never silently dropped.

# %%
names = methods or list(helpers.METHODS)
rows = ["| method | kind | what it is | " + " | ".join(P.dtypes) + " |", "|---|---|---|" + "---|" * len(P.dtypes)]
for name in names:
    m = helpers.get_method(name)
    cells = [m.why_unavailable(device, dt) or "runs" for dt in P.torch_dtypes]
    rows.append(f"| **{name}** | {m.kind} | {m.summary} | " + " | ".join(cells) + " |")
display(Markdown("\n".join(rows)))

# %% [markdown]
# ## The reference
#
# The specification lives in `helpers.reference`: exactly `torch.nn.functional.cross_entropy` on the
# (soft-capped) fp32 logits, for every reduction, with ignored targets, and with *every* target
# ignored (a mean over nothing is NaN in torch, with zero gradients; so it is here). The reference
# computes that in **float64** from the very same low-precision inputs, upcast exactly, so the only
# error left in a method's answer is its own arithmetic.
#
# A small example: the naive path against the reference on one irregular shape.

# %%
N, V, D = settings["shapes"][0]
case = gate_cases([(N, V, D)])[1]  # sum reduction, some targets ignored
E, C, x, grad_output = helpers.gate.make_inputs(case, P.torch_dtypes[-1], device, seed=0)
loss64, dE64, dC64 = helpers.reference_loss_and_grads(E, C, x, grad_output, reduction=case.reduction)
loss, dE, dC = helpers.gate.run_method("naive", E, C, x, grad_output, case)
print(f"{case.name} in {E.dtype}:")
for q, a, r in zip(("loss", "dE", "dC"), (loss, dE, dC), (loss64, dE64, dC64)):
    print(f"  {q:>4}: relative error {helpers.gate.relative_error(a, r):.2e}")

# %% [markdown]
# ## The bounds
#
# Each quantity's relative L2 error, `‖a − r‖ / ‖r‖`, must stay under
# `max(floor[dtype], 2 × naive's error on the same inputs)`. The naive path is the fair yardstick of
# what a dtype allows; the floor keeps the bound honest where naive happens to be nearly exact. All
# floors are under 1%, so a gradient scaled by 1.01 or a forgotten soft cap fails in every dtype
# (the test suite proves the gate catches both).

# %%
display(Markdown(
    "| dtype | loss floor | dE floor | dC floor |\n|---|---:|---:|---:|\n"
    + "\n".join(f"| {str(d).replace('torch.', '')} | {f['loss']:.0e} | {f['dE']:.0e} | {f['dC']:.0e} |"
                for d, f in FLOOR.items())
    + f"\n\nSlack against naive: ×{SLACK:g}."
))

# %% [markdown]
# ## Run the gate
#
# Cases: irregular shapes (N, V, D multiples of no block size), the three reductions, some targets
# ignored, the soft cap, and the all-ignored corner; in every dtype the profile names.

# %%
cases = gate_cases(settings["shapes"])
print(f"{len(cases)} cases × {len(P.dtypes)} dtypes × {len(names)} methods")
report = run_gate(names, P.torch_dtypes, cases, device=device, seed=settings["seed"],
                  raise_on_failure=False, progress=True)
gate_json = report.to_json(out / "gate.json")
display(Markdown(report.markdown()))

# %% [markdown]
# ### When the yardstick itself is over the floor
#
# On a GPU, fp16's naive path misses the fp16 floor on dE at a large vocabulary with a mean
# reduction. That is fp16, not a bug: the gradient of a mean loss with respect to one logit is
# `(softmax − onehot) / N`, and with a near-uniform softmax over V entries that is about `1/(N·V)`,
# below fp16's smallest positive number, so it rounds to zero before the matmul that forms dE. The
# gate marks such rows "over floor" for naive and keeps judging the others against it; a method that
# forms its gradients in fp32 (the chunked one, ours) stays well inside the floor.

# %%
smallest_fp16 = 2.0 ** -24  # smallest positive (subnormal) fp16
for n, v in [(2048, 151_936), (16_384, 151_936)]:
    g = 1 / (n * v)
    print(f"N={n:>6}, V={v}: typical |dL/dz| = 1/(N·V) = {g:.1e}  ->  in fp16: {torch.tensor(g).half().item():.1e}"
          f"  (smallest fp16: {smallest_fp16:.1e})")

# %% [markdown]
# ## The picture
#
# Each bar is a method's worst error over all cases, divided by its bound: below the dashed line
# passes. The gap between a bar and the line is the margin a method has.

# %%
fig = report.plot(out / "gate.png")
helpers.report.write_report_fragment(out, report.markdown() + "\n\n![Worst error over bound, per method and dtype](gate.png)")

# %% [markdown]
# ## The verdict
#
# A failing method of ours or a baseline stops the suite here. A failing peer is reported loudly,
# recorded in `gate.json`, and left out of every later measurement (set `fail_on_peers = True` to
# stop on it too).

# %%
print(f"results: {gate_json}")
failing = report.failing_methods()
peers = {n for n in failing if helpers.get_method(n).kind == "peer"}
if failing:
    print(report.failure_message())
if peers and not fail_on_peers:
    print(f"\nPEERS FAILING THE GATE (excluded from later notebooks): {', '.join(sorted(peers))}")
report.raise_if_failed(None if fail_on_peers else failing - peers)
passed = [n for n in names if report.passed(n)]
print(f"\nGATE PASSED for: {', '.join(passed)}")
