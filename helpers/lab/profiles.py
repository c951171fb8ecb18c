"""The one table of run profiles every notebook reads its sizes from.

A notebook takes two parameters, ``profile`` ("auto" by default, so Kaggle's "Run all" gets the
full run for the GPU it finds) and ``quick`` (False), and reads its own section of the chosen profile:

    P = get_profile(profile, quick=quick)
    P.section("02_memory_sweep")["N"]

A section may hold a ``"quick"`` dict: what a short run changes (merged over the section, a level
deep, when ``quick`` is asked for). "auto" on a CPU-only Kaggle or Colab session is refused with
what to switch on: the smoke profile there is a choice, not a fallback.

What the hardware is (and the pretend card: a T4, an A100, an L4 on a bigger GPU) is
``helpers.cce.device``'s business; "auto" asks it, and a profile got while pretending names the
card in its description (``get_profile``).

The runner (``python -m helpers run``) passes the same name to every notebook, so one word decides
the whole suite's sizes. Sections are plain dicts so that each notebook owns its own keys.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass, field, replace

import torch

from helpers.cce.device import CardSpec, device_info, pretended_card
from helpers.cce.kernels.configs import tier_for_card
from helpers.compare.heads import QWEN3


SMOKE_NOTE = "Smoke run on a CPU (tiny shapes): checks the pipeline, supports no conclusion."


@dataclass(frozen=True)
class Profile:
    """A named run size. ``sections`` maps a notebook's key to that notebook's settings."""

    name: str
    description: str
    device: str  # "cpu" or "cuda"
    dtypes: tuple[str, ...]  # the dtypes the suite exercises under this profile
    sections: dict[str, dict] = field(default_factory=dict)

    def section(self, key: str) -> dict:
        """The notebook ``key``'s settings (without its ``"quick"`` overrides)."""
        if key not in self.sections:
            raise KeyError(f"profile {self.name!r} has no section {key!r}; it has {list(self.sections)}")
        return {k: v for k, v in self.sections[key].items() if k != "quick"}

    def quick(self) -> Profile:
        """This profile with every section's ``"quick"`` overrides applied: a short run."""
        sections = {}
        for key, section in self.sections.items():
            merged = copy.deepcopy(section)
            for name, value in merged.pop("quick", {}).items():
                if isinstance(value, dict) and isinstance(merged.get(name), dict):
                    merged[name] = {**merged[name], **value}
                else:
                    merged[name] = value
            sections[key] = merged
        return replace(self, name=f"{self.name}-quick", description=f"{self.description} (quick: a short run)",
                       sections=sections)

    @property
    def smoke(self) -> bool:
        """A CPU profile: tiny shapes that check the pipeline and support no conclusion (figures,
        verdicts and the report say so: ``SMOKE_NOTE``)."""
        return self.device == "cpu"

    @property
    def torch_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(getattr(torch, d) for d in self.dtypes)

    @property
    def torch_device(self) -> torch.device:
        """The device the profile runs on; a GPU profile where torch sees none is refused here."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"profile {self.name!r} needs a CUDA GPU and none was found; use profile='cpu'")
        return torch.device(self.device)


# Gate shapes: N, V, D deliberately not multiples of any block size (odd, prime-ish), one case with
# a tall vocabulary so several vocabulary blocks are merged, one with N smaller than a block.
# The interpreter runs Triton programs one by one in numpy, so CPU shapes stay tiny.
_GATE_SMALL = [(37, 257, 24), (53, 1031, 40), (5, 2053, 24)]
_GATE_GPU = [(257, 5003, 136), (2048, QWEN3.V, QWEN3.D)]  # the second: the Qwen3 head, 2,048 tokens
_GATE_GPU_QUICK = [(257, 5003, 136), (512, QWEN3.V, QWEN3.D)]  # the Qwen3 head at a quarter of the tokens
# One more case, realistic targets (frequent tokens the target of many rows: what a gradient summed
# in 16 bits over chunks of rows gets wrong, and uniform targets hide; helpers.compare.gate.gate_cases),
# at the Qwen3 head: 4,096 tokens where naive must fit a T4 (its fp32 logits, 2.5 GB) or a run is
# short, 8,192 on a bigger GPU. On the CPU a tiny head with the same shape of softmax.
_GATE_REALISTIC_SMALL = [(64, 521, 16)]
_GATE_REALISTIC_T4 = [(4096, QWEN3.V, QWEN3.D)]
_GATE_REALISTIC_GPU = [(8192, QWEN3.V, QWEN3.D)]

# The memory sweep's quick gate on a GPU (the full gate is notebook 01's).
_SWEEP_GATE_GPU = [(257, 5003, 136), (1031, 32011, 520)]

# Notebook 02 as a T4 runs it: the seed article's sweep, the Qwen3-0.6B head in fp16 at its six token
# counts. The t4 profile's own sweep, and on a bigger GPU the second, pretend-T4 sweep. A short run
# keeps 8,192 (naive's wall) and 16,384 (the article's micro-batch, which the report reads).
_SWEEP_T4 = {
    "dtype": "float16", "N": [1_024, 2_048, 4_096, 8_192, 16_384, 32_768],
    "warmup": 1, "repeats": 5, "gate_shapes": _SWEEP_GATE_GPU, "gate_realistic": _GATE_REALISTIC_T4, "seed": 0,
    "tradeoff": {"N": [16_384]},  # ours under memory budgets against the others' points
}
_SWEEP_T4_QUICK = {"N": [1_024, 4_096, 8_192, 16_384], "repeats": 3}

# Notebook 03 on a GPU, T4 or bigger: the same sizes, only the dtype and its bound differ. "naive"
# (logits in the compute dtype) is the fine-tuning verdict's yardstick; Liger is the pretraining
# control without a filter; Apple CCE runs as it ships, with its filter off, and as its paper
# recommends for pretraining (Kahan-FullC), where the installed version offers that.
_CONVERGENCE_GPU_SIZES = {
    "finetune": {
        "methods": ["exact", "naive", "ours", "ours_nofilter", "liger", "apple_cce", "chunked"],
        "task": {"V": 32768, "D": 256, "d_features": 256, "rows": 16384, "batch": 4096},
        "train": {"steps": 300, "lr": 3e-3, "seed": 0},
    },
    "pretrain": {
        "methods": ["exact", "ours", "ours_nofilter", "liger", "apple_cce", "apple_cce_nofilter",
                    "apple_cce_kahan_full_c"],
        "corpus": {"vocab_size": 32768, "max_files": None},
        "task": {"D": 256, "context": 8, "d_embed": 64, "d_hidden": 1024, "batch": 4096, "curve_tokens": 32768},
        "train": {"steps": 1000, "warmup": 50, "lr": 2e-3, "eval_every": 50},
        "seeds": [0, 1, 2],
    },
    # The speed table: every arm's training step timed apart, after the same untimed warm-up
    # (compilation, autotuning), the median of "repeats" steps; "loss_calls" back-to-back loss
    # calls give its host and device time per call (helpers.lab.step_time).
    "timing": {"warmup": 3, "repeats": 10, "loss_calls": 5},
    # A short run: a third of the steps in both parts; the same arms, sizes and seeds (three, for
    # a paired interval narrower than two seeds give). "train" is replaced whole, so it is whole.
    "quick": {
        "finetune": {"train": {"steps": 100, "lr": 3e-3, "seed": 0}},
        "pretrain": {"train": {"steps": 300, "warmup": 30, "lr": 2e-3, "eval_every": 25}},
    },
}

# Notebook 05 on a GPU: the Qwen3-0.6B shape in sequences of 2,048 tokens; micro-batches searched
# from one sequence up (doubling, then bisected to 4 sequences); the training comparison at 4,096
# tokens a step.
_FITS_GPU = {
    "shape": "0.6b", "seq_len": 2048, "fit_start": 2048, "fit_limit": 262_144, "fit_step": 8192,
    "article_tokens": 16_384, "curve": {"tokens": 4096, "steps": 20, "seed": 0}, "check_tokens": 2048,
    "repeats": 2,
    # A short run: a coarser search, fewer steps (the gradient check is the same).
    "quick": {"fit_step": 32_768, "curve": {"steps": 8}, "repeats": 1},
}

# Notebook 06 on a GPU: ours against float64 on an irregular shape; the policy head's step at the
# seed article's 16,384 tokens (16 completions of 1,024) at the Qwen3-0.6B head; a small GRPO run on the
# count-up task (helpers.lab.rl), whose policy is tiny on every profile (the head step is the scale test).
_RL_GPU = {
    "check": {"B": 8, "T": 129, "V": 5003, "D": 136},
    # Distillation: (N, V, D_s, D_t) of the float64 check, and of the step (a Qwen3-0.6B student, a
    # teacher of Qwen3-1.7B's width); the tiny student's run.
    "distill": {"check": (1000, 3001, 256, 512),
                "head": {"shape": (16_384, QWEN3.V, QWEN3.D, 2_048), "kinds": ["forward", "jsd"]},
                "train": {"V": 256, "D_s": 32, "D_t": 64, "steps": 60, "tokens": 512, "lr": 2e-2, "seed": 0}},
    "head": {"B": 16, "T": 1024, "V": QWEN3.V, "D": QWEN3.D},
    "warmup": 2, "repeats": 5,
    "grpo": {"V": 64, "D": 64, "T": 8, "prompts_per_step": 16, "group_size": 8, "steps": 60, "lr": 1e-2,
             "iterations": 2, "kl_coef": 0.01, "entropy_coef": 0.001, "seed": 0},
    # A short run: fewer GRPO steps and timed repeats (the same shapes).
    "quick": {"repeats": 2, "grpo": {"steps": 30}},
}

# Notebook 07: the vocabulary-parallel loss on two ranks. "check_shapes": (N, V, D) of the checks
# against the single-device loss and float64 (the first irregular: V odd, no world size divides it;
# the second the Qwen3 head); "sizes": tokens N per rank timed at the Qwen3 head, past "budget_s"
# seconds skipped. Where this machine has fewer GPUs than "world" the ranks share its GPU(s) over
# gloo for the checks, and nothing is timed.
_VP_CPU_CHECK = {"dtype": "float32", "check_shapes": [(37, 593, 16)]}
_VP_GPU = {
    "world": 2, "check_shapes": [(1031, 5003, 136), (2048, QWEN3.V, QWEN3.D)],
    "V": QWEN3.V, "D": QWEN3.D, "sizes": [16_384, 32_768, 65_536, 131_072],
    "calls": {"warmup": 2, "repeats": 7}, "budget_s": 480,
    # A short run: the smallest and the middle size, fewer timed calls (the same checks).
    "quick": {"sizes": [16_384, 65_536], "calls": {"warmup": 1, "repeats": 3}},
}

PROFILES: dict[str, Profile] = {
    "cpu": Profile(
        name="cpu",
        description="CPU smoke run: tiny shapes, Triton kernels under the interpreter (the suite's runner gives "
        "them the Turing tier's tiles), fp32 and fp16",
        device="cpu",
        dtypes=("float32", "float16"),  # the Triton interpreter computes bf16 wrongly
        sections={
            # Memory sweep smoke run: the Triton kernels (Liger, ours) run under the interpreter at
            # about a second per call even here, so a tiny head, four token counts, no warm-up (the
            # gate has compiled torch.compile's graph) and one timed call; a simulated 0.3 MB card
            # puts the OOM wall inside the sweep (naive and chunked at N = 128). "t4_sweep": the
            # second, pretend-T4 pass a big GPU runs, here in fp16 at two token counts with the T4's
            # kernel configurations (a CPU has no T4 memory to pretend): it checks that pass's pipeline.
            "02_memory_sweep": {
                "dtype": "float32", "V": 257, "D": 32, "N": [16, 32, 64, 128],
                "warmup": 0, "repeats": 1, "gate_shapes": [(37, 257, 24), (53, 509, 40)],
                "gate_realistic": _GATE_REALISTIC_SMALL, "cpu_budget_bytes": 300_000, "seed": 0,
                "t4_sweep": {"dtype": "float16", "N": [16, 128], "warmup": 0, "repeats": 1,
                             "gate_shapes": [(37, 257, 24)], "cpu_budget_bytes": 300_000, "seed": 0},
                # The budgets' curve at one N: its pipeline (at V = 257 every budget holds all the logits).
                "tradeoff": {"N": [64]},
            },
            # (N, V, D) shapes: "shape" for the kernel checks (deliberately ragged), "sparse" for
            # the filter and sorting, "curve" for the sparsity curve (plain torch, no kernel).
            "04_kernel_walkthrough": {
                "dtype": "float32", "low_precision": "float16",
                "shape": (61, 1000, 40), "sparse": (32, 8192, 32), "curve": (256, 32768, 64),
                "BLOCK_N": 16, "BLOCK_V": 64, "kahan_terms": 2048, "seed": 0,
            },
            "01_correctness": {"shapes": _GATE_SMALL, "realistic": _GATE_REALISTIC_SMALL, "seed": 0},
            # A tiny Qwen3 on the CPU (its 512-entry vocabulary makes the logits small next to the
            # activations: the smoke run checks the pipeline, not the picture); a simulated 1.3 MB
            # card puts a wall inside the search.
            "05_fits": {
                "shape": "tiny", "precision": "fp32", "seq_len": 32, "fit_start": 32, "fit_limit": 128, "fit_step": 32,
                "article_tokens": 64, "curve": {"tokens": 64, "steps": 3, "seed": 0}, "check_tokens": 64,
                "repeats": 1, "cpu_budget_bytes": 1_300_000,
                # Not ours' budget arms: on the CPU "auto" is "min", and 1 GiB holds every tiny logit.
                "arms": ["hf", "liger", "ours", "apple_cce"],
            },
            # Smoke run: a tiny head (naive's step, 0.65 MB, over a simulated 0.3 MB card, so the
            # notebook's out-of-memory finding runs too; ours' takes ~3 s under the interpreter) and
            # 12 GRPO steps of 160 tokens: the reward rises from chance (1/16 a token) to about 0.5.
            # The GRPO run takes the Turing tier's tiles: fewer, larger programs under the
            # interpreter, ~0.3 s a step instead of ~1 s with the interpreter's own small tiles.
            "06_rl_and_distillation": {
                "dtype": "float32",
                "check": {"B": 5, "T": 7, "V": 257, "D": 24},
                "head": {"B": 2, "T": 32, "V": 509, "D": 32},
                "warmup": 0, "repeats": 1, "cpu_budget_bytes": 300_000,
                "grpo": {"V": 16, "D": 16, "T": 5, "prompts_per_step": 4, "group_size": 8, "steps": 12, "lr": 4e-2,
                         "iterations": 2, "kl_coef": 0.01, "entropy_coef": 0.001, "seed": 0, "configs": "turing-64k"},
                # The Turing tier's larger tiles: fewer programs for the interpreter (as "grpo").
                "distill": {"check": (37, 257, 24, 40),
                            "head": {"shape": (64, 509, 32, 48), "kinds": ["forward"], "configs": "turing-64k"},
                            "train": {"V": 64, "D_s": 16, "D_t": 32, "steps": 25, "tokens": 64, "lr": 5e-2,
                                      "seed": 0, "configs": "turing-64k"}},
            },
            # Two gloo processes at a tiny head (V = 593, odd, D = 16): the checks, then three token
            # counts timed once each (about 12 s under the interpreter, where times mean nothing).
            "07_vocab_parallel": {
                **_VP_CPU_CHECK, "world": 2, "V": 593, "D": 16, "sizes": [16, 32, 64],
                "calls": {"warmup": 0, "repeats": 1}, "budget_s": None,
            },
            "03_convergence": {
                # Smoke run: under the Triton interpreter a step of ours takes ~0.4 s even at V = 256,
                # and of Liger's in fp16 ~0.5 s, so pretraining takes 4 steps: enough to run every
                # piece (evaluation, comparisons, figures), not to show anything.
                # tolerance_floor: the fine-tuning bound where the naive yardstick drifts less.
                "compute_dtype": "float32", "tolerance_floor": 1e-4,
                "finetune": {
                    "methods": ["exact", "naive", "ours", "ours_nofilter", "liger", "apple_cce", "chunked"],
                    "task": {"V": 256, "D": 16, "d_features": 16, "rows": 512, "batch": 16},
                    "train": {"steps": 12, "lr": 1e-2, "seed": 0},
                },
                # ours_nofilter trains only in the fine-tuning part here: at V = 256 the filter skips
                # nothing (and in fp32 it is off), so in pretraining it would repeat ours, at ~0.3 s a step.
                "pretrain": {
                    "methods": ["exact", "ours", "liger", "apple_cce", "apple_cce_nofilter", "apple_cce_kahan_full_c"],
                    "corpus": {"vocab_size": 256, "max_files": 60},
                    "task": {"D": 16, "context": 4, "d_embed": 16, "d_hidden": 64, "batch": 32, "curve_tokens": 2048},
                    "train": {"steps": 4, "warmup": 1, "lr": 3e-3, "eval_every": 2},
                    "seeds": [0, 1],
                },
                # Under the interpreter nothing compiles and a step of ours takes ~0.1 s, Liger's ~0.4:
                # one warm-up, three steps and one loss call check the pipeline and keep the run short.
                "timing": {"warmup": 1, "repeats": 3, "loss_calls": 1},
            },
        },
    ),
    "t4": Profile(
        name="t4",
        description="Turing-class GPU (T4, 16 GB, sm_75): fp16 and fp32, no bf16 tensor cores",
        device="cuda",
        dtypes=("float32", "float16"),
        sections={
            # The seed article's sweep (a T4 needs no second, pretend-T4 one).
            "02_memory_sweep": {**_SWEEP_T4, "V": QWEN3.V, "D": QWEN3.D, "t4_sweep": None, "quick": _SWEEP_T4_QUICK},
            "04_kernel_walkthrough": {
                "dtype": "float16", "low_precision": "float16",
                "shape": (1031, 32011, 120), "sparse": (2048, 32768, 128), "curve": (512, QWEN3.V, 64),
                "BLOCK_N": 32, "BLOCK_V": 64, "kahan_terms": 8192, "seed": 0,
            },
            "01_correctness": {"shapes": _GATE_GPU, "realistic": _GATE_REALISTIC_T4, "seed": 0,
                               "quick": {"shapes": _GATE_GPU_QUICK}},
            "05_fits": {**_FITS_GPU, "precision": "fp16"},
            "06_rl_and_distillation": {**_RL_GPU, "dtype": "float16"},
            # Per GPU a T4 (Kaggle's "GPU T4 x2"): fp16, the float64 check at 1,024 tokens of the head
            # (a T4's float64 is 1/32 of its fp32).
            "07_vocab_parallel": {**_VP_GPU, "dtype": "float16",
                                  "check_shapes": [(1031, 5003, 136), (1024, QWEN3.V, QWEN3.D)]},
            # Sized for ~10 minutes on a T4; the gpu profile runs the same sizes in bf16.
            "03_convergence": {**_CONVERGENCE_GPU_SIZES, "compute_dtype": "float16", "tolerance_floor": 1e-3},
        },
    ),
    "gpu": Profile(
        name="gpu",
        description="Ampere or newer GPU: bf16, fp16 and fp32 at full sizes",
        device="cuda",
        dtypes=("float32", "float16", "bfloat16"),
        sections={
            # The article's sweep carried on to 131,072 tokens (sizes that cannot fit are dropped),
            # then the article's own as a pretend T4 (a second figure).
            "02_memory_sweep": {
                "dtype": "bfloat16", "V": QWEN3.V, "D": QWEN3.D,
                "N": [1_024, 2_048, 4_096, 8_192, 16_384, 32_768, 65_536, 131_072],
                "warmup": 2, "repeats": 7, "gate_shapes": _SWEEP_GATE_GPU, "gate_realistic": _GATE_REALISTIC_T4,
                "seed": 0, "t4_sweep": _SWEEP_T4,
                "tradeoff": {"N": [16_384, 65_536]},
                "quick": {"N": [1_024, 4_096, 16_384, 65_536], "repeats": 3, "t4_sweep": _SWEEP_T4_QUICK},
            },
            "04_kernel_walkthrough": {
                "dtype": "bfloat16", "low_precision": "bfloat16",
                "shape": (1031, 32011, 120), "sparse": (2048, 65536, 128), "curve": (512, QWEN3.V, 64),
                "BLOCK_N": 64, "BLOCK_V": 64, "kahan_terms": 8192, "seed": 0,
            },
            "01_correctness": {"shapes": _GATE_GPU, "realistic": _GATE_REALISTIC_GPU, "seed": 0,
                               "quick": {"shapes": _GATE_GPU_QUICK, "realistic": _GATE_REALISTIC_T4}},
            "05_fits": {**_FITS_GPU, "precision": "bf16"},
            "03_convergence": {**_CONVERGENCE_GPU_SIZES, "compute_dtype": "bfloat16", "tolerance_floor": 4e-3},
            "06_rl_and_distillation": {**_RL_GPU, "dtype": "bfloat16"},
            "07_vocab_parallel": {**_VP_GPU, "dtype": "bfloat16"},
        },
    ),
}


def _in_fp16(cpu: Profile) -> Profile:
    """The CPU smoke sizes in the T4's dtype: every notebook's fp16 path under the interpreter."""
    sections = copy.deepcopy(cpu.sections)
    sections["02_memory_sweep"].update(dtype="float16", t4_sweep=None)  # already the T4's path
    sections["03_convergence"].update(compute_dtype="float16", tolerance_floor=1e-3)
    sections["04_kernel_walkthrough"]["dtype"] = "float16"
    sections["05_fits"]["precision"] = "fp16"
    sections["06_rl_and_distillation"]["dtype"] = "float16"
    sections["07_vocab_parallel"]["dtype"] = "float16"
    return replace(
        cpu, name="cpu-t4", dtypes=("float16",), sections=sections,
        description="CPU smoke run of the T4's path: the cpu sizes in fp16, Turing-tier kernel configurations "
        "under the interpreter",
    )


PROFILES["cpu-t4"] = _in_fp16(PROFILES["cpu"])


def detect_platform(environ, modules):
    """'kaggle', 'colab' or 'local', from the environment variables and the imported modules."""
    if "KAGGLE_KERNEL_RUN_TYPE" in environ:  # "Interactive" in the editor, "Batch" in Save & Run All
        return "kaggle"
    if "google.colab" in modules:
        return "colab"
    return "local"


def profile_for_card(card: CardSpec, on_gpu: bool = True) -> str:
    """The profile a card runs: "gpu" with bf16 tensor cores (an A100, an L4), "t4" without (the
    T4's fp16 path); on the CPU, under the card's pretence, "cpu" or the T4's fp16 smoke "cpu-t4"."""
    if on_gpu:
        return "gpu" if card.bf16 else "t4"
    return "cpu" if card.bf16 else "cpu-t4"


def detect_profile_name(device: torch.device | str | None = None) -> str:
    """The profile "auto" runs here: "gpu" on Ampere or newer (a pretend A100 or L4 too), "t4" on a
    T4 (or a pretend one), "cpu" on the CPU ("cpu-t4" under a pretend T4)."""
    info = device_info(device)
    if not info.is_cuda:
        card = pretended_card()
        return profile_for_card(card, on_gpu=False) if card else "cpu"
    return "gpu" if info.has_bf16_matmul else "t4"


def get_profile(name: str = "auto", quick: bool = False) -> Profile:
    """The profile called ``name`` ("auto": the one for the hardware found), shortened by its
    sections' ``"quick"`` overrides when ``quick``. On a Kaggle or Colab session without a GPU,
    "auto" raises, saying how to turn one on (or to ask for "cpu" by name). Under a pretend card
    its description says which card, and what of it is pretended."""
    if name == "auto":
        name = detect_profile_name()
        if name.startswith("cpu"):
            _refuse_a_hosted_cpu_session()
    if name not in PROFILES:
        raise ValueError(f"profile must be 'auto' or one of {sorted(PROFILES)}, got {name!r}")
    profile = PROFILES[name].quick() if quick else PROFILES[name]
    card = pretended_card()
    if card is None:
        return profile
    tier = tier_for_card(card).name
    if profile.device == "cpu":
        pretended = f"its configuration tier, {tier}, under the interpreter"
    else:
        pretended = (f"{card.a_label}'s memory, shared memory per block, sm_{card.capability[0]}{card.capability[1]} "
                     f"and configuration tier {tier}; this GPU's speed")
    return replace(profile, description=f"{profile.description}; as a pretend {card.label} ({pretended})")


def _refuse_a_hosted_cpu_session() -> None:
    where = detect_platform(os.environ, sys.modules)
    if where == "local":
        return
    how = {"kaggle": "Settings > Accelerator > GPU T4 x2", "colab": "Runtime > Change runtime type > T4 GPU"}[where]
    raise RuntimeError(
        f"No GPU in this {where.title()} session, so profile='auto' would only run the CPU smoke profile (tiny "
        f"shapes that support no conclusion). Turn a GPU on ({how}), then restart and run all; or set "
        "profile = \"cpu\" in the parameters cell to run the smoke profile on purpose."
    )
