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
# # 06 · RL and distillation without logits
#
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/06_rl_and_distillation.ipynb) [![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)](https://kaggle.com/kernels/welcome?src=https://github.com/mecs-workbench/memory-efficient-cross-entropy/blob/main/notebooks/06_rl_and_distillation.ipynb)
#
# A reinforcement-learning trainer (GRPO, PPO, DAPO) does not train on a cross-entropy loss, but
# its step still needs one number per completion token from the whole vocabulary: the token's
# log-probability under the policy. Many trainers also need the entropy of each token's softmax.
# The naive way to get them builds the (N, V) logits, their log-softmax and their softmax, then
# keeps them for the backward pass. At the Qwen3-0.6B head and the seed article's 16k tokens, that
# is more memory than a free T4 has.
#
# Our `linear_cross_entropy_outputs` gives both quantities per token, differentiable, without the
# logits. `helpers.lab.rl.grpo_loss` puts them into a GRPO/PPO clipped loss. This notebook:
#
# - checks that loss against a float64 reference built on the full logits (values and gradients);
# - does the memory arithmetic at the Qwen3-0.6B head (V = 151,936, D = 1,024) at 16,384 tokens,
#   for the naive path and for ours;
# - trains a tiny policy with GRPO on a task whose reward a program checks, and plots the reward;
# - measures one GRPO step through the policy head (forward and backward: time and peak memory),
#   ours against the naive path. On a GPU this runs at the Qwen3-0.6B head and 16k tokens; a path
#   that runs out of memory is recorded as a finding;
# - then distillation: `helpers.cce.linear_kl_div`, the forward or reverse KL or the JSD between a
#   student's and a teacher's softmax from their hidden states and heads, checked against float64,
#   a tiny student learning its teacher, and one step against the naive path and Liger-Kernel's
#   fused linear JSD.
#
# Expected run time: about 20 seconds on a CPU (tiny shapes, a smoke run). On an H200 its quick run
# took 34 s (bf16) and 68 s with an L4's tiles (docs/measurements/h200-2026-12-02d, -03f); a T4 is
# slower (not measured there): expect a few minutes.

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
quick = False  # True: fewer GRPO steps and timed repeats
output_dir = "results/06_rl_and_distillation"

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import helpers
from helpers.compare import measure, theory
from IPython.display import Markdown, display

from helpers.compare.heads import QWEN3
from helpers.compare.units import format_bytes, memory_unit, timed_calls
from helpers.lab import distill, rl
from helpers.lab.plots import mark_smoke
from helpers.lab.profiles import SMOKE_NOTE, get_profile
from helpers.lab.training import write_json
from helpers.suite.report import write_report_fragment

started = time.perf_counter()
P = get_profile(profile, quick=quick)
S = P.section("06_rl_and_distillation")
device = P.torch_device
dtype = getattr(torch, S["dtype"])
info = helpers.device_info(device)
out = Path(output_dir)
out.mkdir(parents=True, exist_ok=True)
if device.type == "cuda":  # past the cap an allocation raises a catchable OutOfMemoryError
    cap = measure.apply_memory_cap(0.9, device=device)
else:
    cap = measure.apply_memory_cap(None, cpu_budget_bytes=S["cpu_budget_bytes"], device=device)
problems, findings = [], []  # our faults (the notebook raises at the end) and peers' (reported)


def save(fig, name):
    """Save a figure into the results, stamped as a smoke run where it is one."""
    if P.smoke:
        mark_smoke(fig)
    fig.savefig(out / name, dpi=120)


print(f"profile {P.name}: {info.describe()}; head step in {S['dtype']}; {cap.describe()}")
if P.smoke:
    print(SMOKE_NOTE)

# %% [markdown]
# ## What an RL step needs from the head
#
# A GRPO step samples a group of G completions for each prompt from the sampling policy
# π<sub>old</sub> at a temperature τ. A program scores each completion with a reward r<sub>i</sub>,
# and the advantage is the reward normalised within its group:
# A<sub>i</sub> = (r<sub>i</sub> − mean(r)) / std(r). The trainer then takes gradient steps on a
# clipped surrogate, summed over the completion tokens t:
#
# $$\ell_t = -\min\big(\rho_t A_i,\ \mathrm{clip}(\rho_t, 1-\epsilon_\text{low}, 1+\epsilon_\text{high}) A_i\big)
#   + \beta_\text{KL}\,\big(e^{\log\pi_\text{ref} - \log\pi} - (\log\pi_\text{ref} - \log\pi) - 1\big)
#   - \beta_H\, H_t, \qquad \rho_t = e^{\log\pi(x_t) - \log\pi_\text{old}(x_t)}$$
#
# Every term needs log π(x<sub>t</sub>) = z<sub>x<sub>t</sub></sub> − lse(z), the log-softmax of
# the tempered logits z = E C<sup>T</sup> / τ at the sampled token, with its gradient. The ratio
# needs it against the sampling policy, and the KL penalty (the k3 estimator, as in GRPO) needs it
# against a frozen reference policy. The entropy bonus needs H<sub>t</sub> = −Σ<sub>v</sub>
# p<sub>v</sub> log p<sub>v</sub> over the whole vocabulary, also with its gradient; trainers that
# do not train on it still log it, to watch for entropy collapse. All of this is one pass over the
# logits, tile by tile, as the loss's pass is (notebook 04): `linear_cross_entropy_outputs`
# returns (logprob, entropy, correct) per token, and its backward rebuilds the logits as the loss's
# backward does. The objective above is then O(N) arithmetic (`helpers.lab.rl.policy_objective`).
#
# `grpo_loss` aggregates the tokens in one of three ways. "token" is TRL's `bnpo` and verl's
# `token-mean`. "sequence" is TRL's `grpo`, the paper's 1/|o<sub>i</sub>|. "constant" is TRL's
# `dr_grpo` (Dr. GRPO). The module's docstring gives each normaliser.

# %% [markdown]
# ## The same loss, without the logits
#
# Before anything is measured: on an irregular shape, ours against the same loss computed in
# float64 from the full logits, written as TRL writes it (`rl.logits_grpo_loss`). The inputs have
# ragged completion masks, ratios on both sides of the clip range, the KL and the entropy bonus, and
# τ = 0.7. The naive path in the profile's dtype (logits in the dtype, then fp32) is the yardstick,
# as in notebook 01's gate: ours passes where each error is within max(the dtype's floor, 2 × naive's).

# %%
# Liger as TRL calls it; its tuned settings (rl.PATHS["liger_tuned"]) are timed by scripts/gpu/rl_step.py.
STEP_PATHS = ("ours", "naive", "liger")
check_inputs = rl.step_inputs(**S["check"], dtype=dtype, device=device)
check = rl.check_against_float64(check_inputs, paths=[p for p in STEP_PATHS if rl.path_reason(p) is None])
print(f"B, T, V, D = {tuple(S['check'].values())}, {check['dtype']}; options {rl.STEP_OPTIONS} "
      f"(less, per path: { {p: o for p, o in rl.PATH_OPTIONS.items() if p in STEP_PATHS} })")
print(f"{'':<16}" + "".join(f"{q:>12}" for q in check["bounds"]["ours"]))
for path, errors in check["errors"].items():
    for row, values in ((path, errors), ("  its bound", check["bounds"][path])):
        print(f"{row:<16}" + "".join(f"{values[q]:>12.1e}" if q in values else f"{'—':>12}" for q in check["bounds"]["ours"]))
print("ours is within every bound" if check["ok"] else "ours is OFF the float64 reference")
if not check["ok"]:
    problems.append(f"ours is off the float64 reference in {check['dtype']}: {check['errors']['ours']} "
                    f"against bounds {check['bounds']['ours']}")
for path, error in check["failed"].items():
    print(f"{path:<16}failed: {error}")
peers_off = [path for path, within in check["within"].items()
             if not within and path != "ours" and path not in check["failed"]]
findings += [f"{path} is off the float64 reference in {check['dtype']}: {check['errors'][path]} against bounds "
             f"{check['bounds'][path]}" for path in peers_off]
findings += [f"{path} failed on the gate's inputs in {check['dtype']}: {error}" for path, error in check["failed"].items()]

# %% [markdown]
# ## The memory arithmetic at the Qwen3-0.6B head, 16k tokens
#
# N = 16,384 completion tokens and V = 151,936 make N·V = 2.49·10<sup>9</sup> logits. One (N, V)
# tensor takes 4.98 GB in bf16 and 9.96 GB in fp32. The naive path (`rl.logits_grpo_loss` with
# no dtype, written as trainers write it) computes the logits in the inputs' dtype and casts them to
# fp32, where it divides by τ. When its forward ends it holds four fp32 (N, V) tensors:
#
# - the tempered logits;
# - their log-softmax, saved for the backward;
# - the softmax p = exp(log-softmax), saved for the entropy's backward;
# - p · log p, before the entropy's sum.
#
# That is 39.8 GB, and the backward adds gradients of the same size. Below, the bytes per logit
# are measured on this device at the check's shape, then multiplied out.
#
# Ours holds a few numbers per token (log-probability, entropy, lse: 12 bytes, 0.2 MB at 16k), and
# in the backward the loss's G chunks: the formula notebook 02 checks against measurements
# (`ours_peak_bytes`), which includes dE and dC themselves (0.35 GB in bf16 at this head).

# %%
N16k = 16_384
_, naive_check_peak = measure.peak_memory(rl.head_step("naive", check_inputs), device=device)
check_logits = check_inputs.x.numel() * S["check"]["V"]
bytes_per_logit = naive_check_peak / check_logits
if device.type == "cuda":
    gpu_dtype, capability, where = dtype, info.capability, f"this {info.name}"
else:  # the GPU a CPU run stands for: a T4 for the fp16 profile, else an H200 in bf16
    gpu_dtype, capability = (torch.float16, (7, 5)) if dtype == torch.float16 else (torch.bfloat16, (9, 0))
    where = "a T4 (fp16)" if dtype == torch.float16 else "an H200 (bf16)"
arithmetic = {
    "tokens": N16k, "V": QWEN3.V, "D": QWEN3.D,
    "fp32_logits_bytes": 4 * N16k * QWEN3.V,
    "naive_bytes_per_logit": bytes_per_logit,
    "naive_peak_bytes": bytes_per_logit * N16k * QWEN3.V,
    "ours_peak_bytes": theory.predicted_peak_bytes("ours", N16k, QWEN3.V, QWEN3.D, gpu_dtype, capability)
    + 12 * N16k,
    "ours_predicted_for": where,
}
print(f"naive, measured here at {check_inputs.x.numel():,} tokens x V = {S['check']['V']:,}: "
      f"{format_bytes(naive_check_peak)} above the inputs, {bytes_per_logit:.1f} bytes per logit "
      f"({bytes_per_logit / 4:.1f} fp32 copies of the logits)")
print(f"at the Qwen3-0.6B head, {N16k:,} tokens: one fp32 (N, V) tensor {format_bytes(arithmetic['fp32_logits_bytes'])}; "
      f"naive {format_bytes(arithmetic['naive_peak_bytes'])}; ours {format_bytes(arithmetic['ours_peak_bytes'])} "
      f"(the formula for {where}), {arithmetic['naive_peak_bytes'] / arithmetic['ours_peak_bytes']:.0f}x less")

# %% [markdown]
# ## GRPO trains a tiny policy
#
# The task is counting up. Each prompt is one token p (never token 0, the end-of-sequence token
# EOS), and the completion should be p+1, p+2, and so on, wrapping from V−1 back to 1. The reward
# is the fraction of the T positions that hold the right token; a completion that emits EOS stops
# there, and the rest is padding that the completion mask drops. A random policy scores about
# 1/V per token. The policy (`rl.TinyPolicy`) is an embedding of the previous token and the
# position, a small MLP, and a head C. The sampler sees a few rows of logits at a time, as an
# inference engine does. The trainer sees only hidden states and C, through `grpo_loss`.
#
# Each step samples a group of completions per prompt and normalises the rewards within each group.
# It then takes two gradient steps on the batch (TRL's `num_iterations`), so the second step's
# ratio against the sampling policy is not 1 and the clip acts. The loss also carries a small KL to
# the initial policy and an entropy bonus. The policy trains in fp32 on every profile: the head step
# below is the test at scale.

# %%
G = S["grpo"]
torch.manual_seed(G["seed"])
policy = rl.TinyPolicy(G["V"], G["D"], G["T"]).to(device)
grpo_started = time.perf_counter()
curves = rl.train_grpo(policy, steps=G["steps"], prompts_per_step=G["prompts_per_step"], group_size=G["group_size"],
                       T=G["T"], lr=G["lr"], seed=G["seed"], iterations=G["iterations"], kl_coef=G["kl_coef"],
                       entropy_coef=G["entropy_coef"], configs=G.get("configs"))
grpo_seconds = time.perf_counter() - grpo_started
reward = curves["reward"]
first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
print(f"{G['steps']} steps of {G['prompts_per_step']} prompts x {G['group_size']} completions x {G['T']} tokens "
      f"(V = {G['V']}, D = {G['D']}) in {grpo_seconds:.1f} s: mean reward {first:.2f} (first 3 steps) -> "
      f"{last:.2f} (last 3); chance is {1 / G['V']:.2f}")
if not last > first + 0.1:
    problems.append(f"GRPO did not raise the reward: {first:.3f} in the first 3 steps, {last:.3f} in the last 3")

fig, (ax_reward, ax_entropy) = plt.subplots(1, 2, figsize=(10, 3.6))
steps = range(1, len(reward) + 1)
ax_reward.plot(steps, reward, marker="o", label="mean reward of the sampled group")
ax_reward.axhline(1 / G["V"], color="gray", linestyle=":", label="chance (1/V a token)")
ax_reward.set(xlabel="GRPO step", ylabel="reward", title="Counting up: reward", ylim=(0, 1))
ax_reward.legend(loc="upper left")
ax_entropy.plot(steps, curves["entropy"], label="entropy (nats a token)")
ax_entropy.plot(steps, curves["kl"], label="KL to the initial policy (k3)")
ax_entropy.plot(steps, curves["clipped"], label="fraction of tokens clipped")
ax_entropy.set(xlabel="GRPO step", title="What the trainer logs (last iteration of each step)")
ax_entropy.legend()
fig.tight_layout()
save(fig, "grpo_reward.png")

# %% [markdown]
# ## One GRPO step through the policy head: ours against the naive path and Liger's
#
# This is what a trainer's step costs at the head, in the profile's dtype: the GRPO loss of the
# completions' hidden states (the options above: τ = 0.7, the clip, the KL and the entropy bonus),
# then dE and dC. The peak is the memory held above the inputs, gradients included; the time is
# the median of the repeats after warm-up. On a GPU the shape is the Qwen3-0.6B head at 16,384
# tokens (16 completions of 1,024). A path that runs out of memory is a finding about that path
# (the naive one on a 16 GB card), and the notebook goes on. On a CPU the head is tiny, and a
# simulated card of `cpu_budget_bytes` puts the naive path over its wall. The fused peer: Liger-Kernel's
# `LigerFusedLinearGRPOLoss` (`rl.liger_grpo_loss`: rows through the head a chunk at a time, in PyTorch),
# on the same objective but for the entropy bonus, which it lacks: its step runs without it (a little
# less work than ours), and its check above is against the float64 loss without it.

# %%
H = S["head"]
tokens = H["B"] * H["T"]
head_inputs = rl.step_inputs(**H, dtype=dtype, device=device)
head = {}
for path in STEP_PATHS:
    if reason := rl.path_reason(path):
        head[path] = {"status": "not run", "peak_bytes": None, "ms": None, "error": reason}
        print(f"{path:<6} not run: {reason}")
        continue
    m = measure.measure(rl.head_step(path, head_inputs), warmup=S["warmup"], repeats=S["repeats"], device=device,
                        budget_bytes=cap.budget_bytes)
    head[path] = {"status": m.status, "peak_bytes": m.peak_bytes,
                  "ms": m.latency.median_ms if m.latency else None, "error": m.error}
    shown = (f"{format_bytes(m.peak_bytes)} above the inputs, {m.latency.median_ms:,.1f} ms" if m.status == "ok"
             else f"{m.status} ({m.error})")
    print(f"{path:<6} {tokens:,} tokens, V = {H['V']:,}, D = {H['D']:,}, {S['dtype']}: {shown}")
del head_inputs
measure.release_memory(device)
if head["ours"]["status"] != "ok":
    problems.append(f"ours ran out of memory in the head step at {tokens:,} tokens: {head['ours']['error']}")
for path, what in (("naive", "the naive path (full logits)"), ("liger", "Liger's fused GRPO loss")):
    if head[path]["status"] == "oom":  # the error says by how much (a simulated cap's, the peak it measured)
        findings.append(f"{what} runs out of memory at {tokens:,} tokens, V = {H['V']:,} "
                        f"({cap.describe().split(';')[0]}): {(head[path]['error'] or '')[:160]}")
    elif head[path]["status"] not in ("ok", "not run"):
        findings.append(f"{what} failed at {tokens:,} tokens: {head[path]['error']}")
print("\n".join(f"finding: {f}" for f in findings))

room = cap.room_for(theory.input_bytes(tokens, H["V"], H["D"], dtype))  # the wall above the inputs, if any
peaks = [r["peak_bytes"] for r in head.values() if r["status"] == "ok"] + ([room] if room else [])
unit, scale = memory_unit(max(peaks, default=0))
fig, ax = plt.subplots(figsize=(8, 3))
labels = {"ours": "ours (no logits)", "naive": "naive (full logits)", "liger": "Liger (rows in chunks)"}
for i, (path, r) in enumerate(head.items()):
    if r["status"] == "ok":
        ax.barh(i, r["peak_bytes"] / scale, color=f"C{i}")
        ax.text(r["peak_bytes"] / scale, i, f" {format_bytes(r['peak_bytes'])}, {r['ms']:,.0f} ms", va="center")
    else:
        shown = "out of memory" if r["status"] == "oom" else r["status"]
        ax.text(0, i, f"  {shown}", va="center", color="firebrick", weight="bold")
if room:
    ax.axvline(room / scale, color="firebrick", linestyle="--", label=f"the cap above the inputs: {format_bytes(room)}")
    ax.legend(loc="center right")
ax.set_yticks(range(len(head)), [labels[p] for p in head])
ax.set(xlabel=f"peak {unit} above the inputs", title=f"One GRPO step through the head: {tokens:,} tokens, "
       f"V = {H['V']:,}, D = {H['D']:,}, {S['dtype']}")
ax.set_xlim(0, 1.5 * max(peaks, default=1) / scale)
ax.set_ylim(len(head) - 0.5, -0.5)  # every row, drawn or not, first at the top
fig.tight_layout()
save(fig, "head_step.png")

# %% [markdown]
# ## Distillation without either model's logits
#
# Distilling a teacher into a student scores the student's softmax q against the teacher's p at
# every token: the forward KL(p ‖ q) (Hinton's distillation, `F.kl_div(log q, log p)`), the reverse
# KL(q ‖ p), or the generalized Jensen-Shannon divergence β KL(p ‖ M) + (1 − β) KL(q ‖ M) with
# M = β p + (1 − β) q (Liger-Kernel's). Both softmaxes come from linear heads on hidden states, the
# student's (E<sub>s</sub>, C<sub>s</sub>) and the teacher's (E<sub>t</sub>, C<sub>t</sub>), which
# may differ in width. The naive path forms both heads' logits: at a Qwen3-0.6B student and a teacher
# twice as wide over 16,384 tokens, each is an (N, V) tensor of 9.96 GB in fp32, and the two
# log-softmaxes and the student's gradient are three more.
#
# `helpers.cce.linear_kl_div` walks both heads' logits tile by tile: per token it keeps both lse's and
# one cross sum (the JSD takes a second pass), and its backward rebuilds the tiles for the gradient
# G = ∂KL/∂s (for the forward KL, q − p), then dE<sub>s</sub> = G C<sub>s</sub> and
# dC<sub>s</sub> = G<sup>T</sup> E<sub>s</sub> as the loss's backward makes them. The teacher is a
# constant: no gradient reaches it. First the check against float64 on full logits, every kind.

# %%
Dd = S["distill"]
check_heads = distill.heads(*Dd["check"], dtype=dtype, device=device)
distill_checks = {kind: distill.check_against_float64(check_heads, kind) for kind in distill.KINDS}
print(f"N, V, D_s, D_t = {tuple(Dd['check'])}, {S['dtype']}, temperature 0.7; relative errors (ours / naive, bound)")
for kind, c in distill_checks.items():
    cells = "  ".join(f"{q} {c['errors']['ours'][q]:.1e} / {c['errors']['naive'][q]:.1e} ({c['bounds'][q]:.0e})"
                      for q in c["bounds"])
    print(f"{kind:<8} {cells}  {'ok' if c['ok'] else 'OFF'}")
    if not c["ok"]:
        problems.append(f"linear_kl_div ({kind}) is off the float64 reference in {c['dtype']}: {c['errors']['ours']}")
del check_heads

# %% [markdown]
# A tiny distillation: a fixed teacher head over random features, and a student that maps the
# features to its own, narrower width before its head, trained with Adam on the forward KL and, from
# the same start, on the reverse KL. Each step draws fresh features, so the curve is the divergence on
# data the student has not seen.

# %%
T = Dd["train"]
distill_curves = {kind: distill.distill_student(T["V"], T["D_s"], T["D_t"], steps=T["steps"], tokens=T["tokens"],
                                                lr=T["lr"], kind=kind, seed=T["seed"], device=device,
                                                configs=T.get("configs"))
                  for kind in ("forward", "reverse")}
for kind, curve in distill_curves.items():
    print(f"{kind} KL: {curve[0]:.3f} -> {curve[-1]:.3f} nats a token in {len(curve)} steps")
    if not curve[-1] < 0.5 * curve[0]:
        problems.append(f"distillation on the {kind} KL did not halve the divergence: {curve[0]:.3f} -> {curve[-1]:.3f}")
fig, ax = plt.subplots(figsize=(6, 3.4))
for kind, curve in distill_curves.items():
    ax.plot(range(1, len(curve) + 1), curve, label=f"{kind} KL")
ax.set(xlabel="step", ylabel="divergence, nats a token", yscale="log",
       title=f"A student learns its teacher (V = {T['V']}, D_s = {T['D_s']}, D_t = {T['D_t']})")
ax.legend()
fig.tight_layout()
save(fig, "distill_curve.png")

# %% [markdown]
# One distillation step through both heads: the divergence, then dE<sub>s</sub> and dC<sub>s</sub>,
# ours against the naive path and Liger-Kernel's `LigerFusedLinearJSD` (its β = 0 is the
# forward KL, 0.5 the JSD: the same divergence, the same tokens, the same mean). Liger cuts the rows
# into chunks and holds fp32 buffers of a chunk's logits; ours holds a few numbers per token and
# recomputes the tiles in its backward (more arithmetic: the module doc of `helpers.cce.distill`
# counts it). On a GPU the shape is the Qwen3-0.6B student at 16,384 tokens with a teacher of width
# 2,048; a path that runs out of memory is a finding.

# %%
Hd = Dd["head"]
step_heads = distill.heads(*Hd["shape"], dtype=dtype, device=device, seed=1)
distill_step = {}
for kind in Hd["kinds"]:
    for path in distill.PATHS:
        reason = distill.liger_reason(device, dtype) if path == "liger" else None
        if reason:
            distill_step[(kind, path)] = {"status": "not run", "error": reason}
            continue
        m = measure.measure(distill.step(path, step_heads, kind, Hd.get("configs")), warmup=S["warmup"],
                            repeats=S["repeats"],
                            device=device, budget_bytes=cap.budget_bytes)
        distill_step[(kind, path)] = {"status": m.status, "peak_bytes": m.peak_bytes, "error": m.error,
                                      "ms": m.latency.median_ms if m.latency else None}
        if m.status != "ok" and path == "ours":
            problems.append(f"linear_kl_div ({kind}) failed in the step at {Hd['shape']}: {m.error}")
        elif m.status != "ok":
            findings.append(f"distillation, {path} ({kind}) at N, V, D_s, D_t = {tuple(Hd['shape'])}: {m.status}")
del step_heads
measure.release_memory(device)


def distill_cell(r):
    if r["status"] == "ok":
        return f"{format_bytes(r['peak_bytes'])}, {r['ms']:,.1f} ms"
    return "out of memory" if r["status"] == "oom" else f"{r['status']}: {r['error']}"


distill_table = ("| kind | " + " | ".join(distill.PATHS) + " |\n|---|" + "---:|" * len(distill.PATHS) + "\n"
                 + "\n".join(f"| {kind} | " + " | ".join(distill_cell(distill_step[(kind, p)]) for p in distill.PATHS)
                             + " |" for kind in Hd["kinds"]))
display(Markdown(f"N, V, D_s, D_t = {tuple(Hd['shape'])}, {S['dtype']}: peak above the inputs, time "
                 f"({timed_calls([S['repeats']])})\n\n"
                 + distill_table))

# %% [markdown]
# ## Results

# %%
liger_check = f" Liger failed on the gate's inputs: {check['failed']['liger']}." if "liger" in check["failed"] else "" if "liger" not in check["errors"] else (
    f" Liger, against the same loss without the entropy bonus: {'within' if check['within']['liger'] else '**outside**'}"
    f" its bounds (dE {check['errors']['liger']['dE']:.1e}, dC {check['errors']['liger']['dC']:.1e}).")


def step_cell(r):
    if r["status"] == "ok":
        return f"{format_bytes(r['peak_bytes'])}, {r['ms']:,.0f} ms"
    return "out of memory" if r["status"] == "oom" else f"{r['status']}: {r['error']}"


headline = (f"a GRPO step through a {H['V']:,} x {H['D']:,} head at {tokens:,} tokens, {S['dtype']}: ours "
            f"{step_cell(head['ours'])}; naive {step_cell(head['naive'])}; Liger {step_cell(head['liger'])}; "
            "the tiny policy's reward "
            f"{first:.2f} -> {last:.2f}")
results = {
    "profile": P.name, "device": info.as_dict(), "dtype": S["dtype"], "options": rl.STEP_OPTIONS,
    "check": {"shape": S["check"], **check}, "arithmetic": arithmetic,
    "grpo": {"settings": G, "curves": curves, "seconds": grpo_seconds},
    "head_step": {"shape": H, "tokens": tokens, "paths": head},
    "distill": {"check": distill_checks, "curves": distill_curves, "step_shape": Hd["shape"],
                "step": {f"{kind}/{path}": r for (kind, path), r in distill_step.items()}},
    "findings": findings, "problems": problems,
    "seconds": time.perf_counter() - started,
}
write_json(out / "results.json", results)
write_report_fragment(out, f"""
| one GRPO step, {tokens:,} tokens, V = {H['V']:,}, D = {H['D']:,}, {S['dtype']} | peak above the inputs, time |
|---|---:|
| ours (`helpers.lab.rl.grpo_loss`) | {step_cell(head['ours'])} |
| naive (full logits, log-softmax, softmax) | {step_cell(head['naive'])} |
| Liger-Kernel's `LigerFusedLinearGRPOLoss` (no entropy bonus) | {step_cell(head['liger'])} |

- Against float64 on full logits ({check['dtype']}): ours {'within' if check['ok'] else '**outside**'} the gate's
  bounds (dE {check['errors']['ours']['dE']:.1e}, dC {check['errors']['ours']['dC']:.1e}; naive's
  {check['errors']['naive']['dE']:.1e}, {check['errors']['naive']['dC']:.1e}).{liger_check}
- At the Qwen3-0.6B head and 16,384 tokens: naive {format_bytes(arithmetic['naive_peak_bytes'])}
  ({arithmetic['naive_bytes_per_logit']:.0f} bytes a logit, measured here in {S['dtype']}), ours
  {format_bytes(arithmetic['ours_peak_bytes'])} (the formula, for {where}{'' if device.type == 'cuda' else ': the GPU this CPU run stands for'}).
- GRPO on the count-up task: mean reward {first:.2f} -> {last:.2f} in {G['steps']} steps (chance {1 / G['V']:.2f}).
{chr(10).join('- Finding: ' + f for f in findings)}

![GRPO reward](grpo_reward.png)
![One step through the head](head_step.png)

### Distillation, N, V, D_s, D_t = {tuple(Hd['shape'])}, {S['dtype']}: peak above the inputs, time ({timed_calls([S['repeats']])})

{distill_table}

- Against float64 on full logits: {", ".join(f"{k} {'within' if c['ok'] else '**outside**'} the bounds" for k, c in distill_checks.items())}.
- A tiny student: forward KL {distill_curves['forward'][0]:.2f} -> {distill_curves['forward'][-1]:.2f}, reverse
  {distill_curves['reverse'][0]:.2f} -> {distill_curves['reverse'][-1]:.2f} nats a token.

![Distillation curve](distill_curve.png)
""", headline=headline, smoke=P.smoke)
plt.close("all")
print(headline)
print(f"results in {out} ({results['seconds']:.0f} s)")
if problems:
    raise AssertionError("\n".join(problems))
