"""Notebook 05's pieces: a Hugging Face causal LM trained with each loss, how many tokens fit, what
one training step costs, and whether the losses train alike.

The model is a Qwen3 causal LM built from a config (random init, no download): the Qwen3-0.6B
shape on a GPU (28 layers, hidden 1,024, vocabulary 151,936, tied embeddings), a tiny one on the
CPU. Each arm changes only how the loss is computed (``ARMS``): transformers' default (logits, then
``ForCausalLMLoss``), Liger's patch (``apply_liger_kernel_to_qwen3``, its fused loss only), ours
through ``helpers.hf.patch``, and Apple's kernel through the same patch (so only the kernel
differs). A step is forward with labels, backward, an optimizer step, with gradient checkpointing;
``precision`` says how: "bf16" (weights in bf16), "fp16" (fp32 weights, fp16 autocast and a
``GradScaler``: what a T4 runs) or "fp32".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from helpers import hf
from helpers.compare.heads import QWEN3
from helpers.compare.measure import is_out_of_memory, measure, memory_timeline, release_memory
from helpers.compare.methods import METHODS, get_method

QWEN3_SHAPES = {
    # Qwen3-0.6B: the seed article's model.
    "0.6b": dict(hidden_size=QWEN3.D, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=QWEN3.V),
    # The same architecture, small enough for the Triton interpreter.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=512),
}
PRECISIONS = ("bf16", "fp16", "fp32")


def build_model(shape: str, device, precision: str, seed: int = 0, max_positions: int = 4096):
    """A randomly initialised ``Qwen3ForCausalLM`` of ``shape`` (``QWEN3_SHAPES``), gradient
    checkpointing on, in train mode; weights in bf16 for "bf16", else fp32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    config = Qwen3Config(**QWEN3_SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=max_positions,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    with warnings.catch_warnings():  # transformers 5.2x renames it; both versions are supported
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def compute_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


# ---------------------------------------------------------------------------------------------
# The arms: how the loss is computed
# ---------------------------------------------------------------------------------------------


def _patch_with(method: str) -> Callable:
    """hf.patch with the registry's ``method`` as the loss: what it can take (a bias) is the registry
    entry's to say (``Method.supports_bias``), and hf runs every loss it calls with autocast off."""
    return lambda model: hf.patch(model, loss=get_method(method))


def _apply_liger(model):
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3

    apply_liger_kernel_to_qwen3(model=model, fused_linear_cross_entropy=True, rope=False, rms_norm=False,
                                swiglu=False)


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    method: str | None  # the registry method whose kernel computes the loss (None: the logits path)
    apply: Callable  # (model) -> None
    remove: Callable  # (model) -> None

    def why_unavailable(self, device, dtype) -> str | None:
        return get_method(self.method).why_unavailable(device, dtype) if self.method else None

    @property
    def is_ours(self) -> bool:
        """Whether this arm's loss is this package's kernel: its failure is our fault, not a finding."""
        return self.method is not None and get_method(self.method).kind == "ours"


ARMS = {
    "hf": Arm("hf", "transformers' default", None, lambda m: None, lambda m: None),
    "liger": Arm("liger", METHODS["liger"].label, "liger", _apply_liger, lambda m: m.__dict__.pop("forward", None)),
    "ours": Arm("ours", METHODS["ours"].label, "ours", hf.patch, hf.unpatch),
    "apple_cce": Arm("apple_cce", METHODS["apple_cce"].label, "apple_cce", _patch_with("apple_cce"), hf.unpatch),
    # Ours trading memory for speed (``memory_budget``): a fixed 1 GiB, and "auto" (a share of what is
    # free when the loss runs), which must not shrink the largest micro-batch that fits.
    "ours_1g": Arm("ours_1g", METHODS["ours_budget_1g"].label, "ours_budget_1g",
                   lambda m: hf.patch(m, memory_budget=2**30), hf.unpatch),
    "ours_auto": Arm("ours_auto", METHODS["ours_budget_auto"].label, "ours_budget_auto",
                     lambda m: hf.patch(m, memory_budget="auto"), hf.unpatch),
}
# Not an arm of the comparison: the gradient check's yardstick. It goes through the same patch as
# ours and Apple's, so it differs from them only in the loss arithmetic (fp32 logits; it
# materialises them: only for a check batch), whatever precision the model's body runs in.
EXACT = Arm("exact", "exact (fp32 logits, same patch)", "exact", _patch_with("exact"), hf.unpatch)


# ---------------------------------------------------------------------------------------------
# Batches and steps
# ---------------------------------------------------------------------------------------------


def batch(ids: torch.Tensor, tokens: int, seq_len: int, generator: torch.Generator, device):
    """(input_ids, labels), (tokens / seq_len, seq_len): windows of the corpus at random places;
    labels are the inputs (transformers shifts them)."""
    seq_len = min(seq_len, tokens)
    rows = max(1, tokens // seq_len)
    starts = torch.randint(0, ids.numel() - seq_len, (rows,), generator=generator)
    windows = torch.stack([ids[s:s + seq_len] for s in starts.tolist()]).to(device)
    return windows, windows


class Trainer:
    """One model, one optimizer (plain SGD: no state, so memory above the weights is the step's
    own), and the precision's autocast and scaler."""

    def __init__(self, model, precision: str, lr: float = 1e-2):
        self.model, self.precision = model, precision
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "fp16")

    def step(self, input_ids, labels) -> torch.Tensor:
        autocast = torch.autocast(self.device.type, dtype=torch.float16, enabled=self.precision == "fp16")
        with autocast:
            loss = self.model(input_ids=input_ids, labels=labels).loss
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def measure_step(trainer: Trainer, arm: Arm, ids, tokens: int, seq_len: int, *, warmup=1, repeats=3,
                 seed=0, budget_bytes: int | None = None) -> dict:
    """One arm at one micro-batch size: {"status": "ok" / "oom", "peak_bytes" (above what was
    allocated before the step: the weights), "ms", "tokens_per_s"}; an out-of-memory is a result.
    ``budget_bytes``: the CPU's simulated card (``helpers.compare.measure.peak_memory``)."""
    g = torch.Generator().manual_seed(seed)
    arm.apply(trainer.model)
    try:
        inputs = batch(ids, tokens, seq_len, g, trainer.device)
        m = measure(lambda: trainer.step(*inputs), warmup=warmup, repeats=repeats, device=trainer.device,
                    budget_bytes=budget_bytes)
    except Exception as error:  # noqa: BLE001  (an OOM building the batch is an OOM too)
        if not is_out_of_memory(error):
            raise
        m = None
    finally:
        arm.remove(trainer.model)
        trainer.optimizer.zero_grad(set_to_none=True)
    release_memory(trainer.device)
    if m is None or m.status == "oom":
        return {"arm": arm.name, "tokens": tokens, "status": "oom"}
    ms = m.latency.median_ms
    return {"arm": arm.name, "tokens": tokens, "status": "ok", "peak_bytes": m.peak_bytes, "ms": ms,
            "tokens_per_s": tokens / (ms / 1e3)}


def largest_fit(fits: Callable[[int], bool], start: int, limit: int, step: int) -> tuple[int | None, list[int]]:
    """The largest multiple of ``step`` in [start, limit] for which ``fits`` is true, and every size
    tried: doubling from ``start`` until the first that does not fit, then bisecting between the
    last that fit and it. None when not even ``start`` fits."""
    tried, good, bad = [], None, None
    n = start
    while n <= limit:
        tried.append(n)
        if fits(n):
            good, n = n, n * 2
        else:
            bad = n
            break
    if good is None:
        return None, tried
    if bad is None:
        return good, tried
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if middle in (good, bad):
            break
        tried.append(middle)
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, tried


def largest_micro_batch(trainer: Trainer, arm: Arm, ids, seq_len: int, start: int, limit: int, step: int, *,
                        budget_bytes: int | None = None) -> tuple[int | None, list[int]]:
    """``largest_fit`` of one arm's whole training step (``measure_step``, one timed repeat): the
    largest micro-batch in tokens and every size tried. The search's closure lives and dies here: one
    kept by the caller (a notebook's global, say) would keep ``trainer``'s model on the card after the
    caller deleted its own names for it."""
    def fits(tokens: int) -> bool:
        r = measure_step(trainer, arm, ids, tokens, seq_len, warmup=1, repeats=1, budget_bytes=budget_bytes)
        return r["status"] == "ok"

    return largest_fit(fits, start, limit, step)


def step_timeline(trainer: Trainer, arm: Arm, ids, tokens: int, seq_len: int, seed=0) -> list[int] | None:
    """Bytes held above the step's start after each allocation and free of one training step;
    None when the step runs out of memory (a cache fragmented by earlier steps can do that at a
    size that fitted before)."""
    g = torch.Generator().manual_seed(seed)
    arm.apply(trainer.model)
    timeline = None
    try:
        inputs = batch(ids, tokens, seq_len, g, trainer.device)
        trainer.step(*inputs)  # warm-up: one-time workspaces are not the step's
        _, timeline = memory_timeline(lambda: trainer.step(*inputs), device=trainer.device)
    except Exception as error:  # noqa: BLE001  (only an OOM is a result)
        if not is_out_of_memory(error):
            raise
    finally:
        arm.remove(trainer.model)
        trainer.optimizer.zero_grad(set_to_none=True)
    release_memory(trainer.device)
    return timeline


def train_curve(shape: str, arm: Arm, ids, *, tokens: int, seq_len: int, steps: int, precision: str,
                device, seed: int = 0, lr: float = 1e-2) -> list[float] | None:
    """The loss of each of ``steps`` training steps from the same initial weights and batches for
    every arm with the same ``seed``; None when a step runs out of memory."""
    model = build_model(shape, device, precision, seed=seed)
    trainer = Trainer(model, precision, lr=lr)
    arm.apply(model)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    try:
        for _ in range(steps):
            losses.append(trainer.step(*batch(ids, tokens, seq_len, g, device)))
    except Exception as error:  # noqa: BLE001  (only an OOM is a result)
        if not is_out_of_memory(error):
            raise
        losses = None
    finally:
        arm.remove(model)
    result = None if losses is None else [float(v) for v in losses]
    del model, trainer, losses
    release_memory(device)
    return result


def max_relative_gap(a: list[float], b: list[float]) -> float:
    """max over steps of |a - b| / |b| (inf where a diverged)."""
    if not all(math.isfinite(v) for v in a):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def loss_and_grads(model, arm: Arm, input_ids, labels, precision: str):
    """(loss, {name: grad}) of one forward and backward under ``arm``, no optimizer step."""
    arm.apply(model)
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(input_ids.device.type, dtype=torch.float16, enabled=precision == "fp16"):
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        arm.remove(model)
        model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


__all__ = ["QWEN3_SHAPES", "ARMS", "EXACT", "Arm", "Trainer", "build_model", "batch", "measure_step", "largest_fit",
           "largest_micro_batch", "step_timeline", "train_curve", "max_relative_gap", "loss_and_grads", "compute_dtype"]
