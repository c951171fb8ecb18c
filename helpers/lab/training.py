"""Convergence A/B: train the same model on the same data from the same seed, changing only the loss.

A loss that is fast but subtly wrong corrupts every optimizer step, and a gradient check on one
batch cannot see an error that only matters summed over thousands of steps (a gradient that is
dropped when it is small, say). So notebook 03 trains, and compares curves. This module holds the
training; what the runs say (diagnostics, statistics, sentences) is ``helpers.lab.convergence``'s.

- The losses the arms train with are methods of the registry (``helpers.compare.methods``), by
  name: ``exact`` is the yardstick (fp32 logits from the same low-precision E and C every arm
  gets), ``ours`` and ``ours_nofilter`` our kernel with the filter on and off, and the peers. A
  method that cannot run says why (``why_unavailable``); none is skipped or swapped silently.
- Two tasks. ``FineTuneTask``: the article's fine-tuning A/B, the last layer and lm_head trained
  on fixed synthetic features (nearly convex: arms drift apart by error more than by chaos).
  ``CorpusLMTask``: a small language model trained from scratch on ``helpers.compare.corpus``.
- ``train``: the one training loop. Seeded (same seed, same losses, bit for bit on a CPU), mixed
  precision with fp32 master weights, and it records what the rare-token diagnostic needs. Step
  times are ``helpers.lab.step_time``'s: a run's wall time holds compilation and skip counting,
  and does not time the loss.

Every model exposes ``hidden(inputs) -> E`` (N, D) and a classifier ``C`` (V, D); the loss of a step
is ``method(E, C, x)``, the only line that differs between arms.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from helpers.cce import resolve_options
from helpers.compare.methods import get_method
from helpers.compare.trained import ContextMLPLM, context_windows
from helpers.spec import raise_for_targets

# ---------------------------------------------------------------------------------------------
# The losses the arms train with: methods of the registry (``helpers.compare.methods``), presets
# included ("exact", "ours_nofilter"), by name.
# ---------------------------------------------------------------------------------------------


def filter_threshold(dtype: torch.dtype, vocabulary: int) -> float | None:
    """Our gradient filter's "auto" threshold in ``dtype`` for ``vocabulary`` classes (None: off), per
    256 columns, as ``helpers.cce`` resolves it for the dense backwards."""
    return resolve_options(dtype, vocabulary=vocabulary).filter_eps


# ---------------------------------------------------------------------------------------------
# Models: hidden(inputs) -> E (N, D), and a classifier C (V, D)
# ---------------------------------------------------------------------------------------------


class LastLayerAndHead(nn.Module):
    """Fine-tuning the top of a frozen model: features h (data) -> last layer -> E -> classifier C.

    E = LayerNorm(W h + b),  (N, D). The last layer keeps E differentiable, so both gradients a
    fused loss returns (dE and dC) shape the run; with h alone (an lm_head on frozen features)
    Liger 0.8.5 returns no dC at all, because it computes dC only when E requires a gradient.
    """

    def __init__(self, d_features: int, D: int, V: int):
        super().__init__()
        self.last = nn.Linear(d_features, D)
        self.norm = nn.LayerNorm(D)
        self.C = nn.Parameter(torch.randn(V, D) / math.sqrt(D))

    def hidden(self, h: torch.Tensor) -> torch.Tensor:  # (N, d_features) -> (N, D)
        return self.norm(self.last(h))


# ---------------------------------------------------------------------------------------------
# Tasks: a model factory, a batch sampler and (for the LM) a validation set
# ---------------------------------------------------------------------------------------------


@dataclass
class FineTuneTask:
    """The article's fine-tuning A/B on fixed synthetic data, with ``LastLayerAndHead``.

    Features h (rows, d_features): standard normal with a constant last feature (a bias direction,
    as real hidden states carry one). Teacher logits = h T^T - zipf_alpha * log(1 + rank(v)) over a
    random ordering of the vocabulary, so the softmax is peaked like a trained LM's (most entries
    far below 2^-12, where a gradient filter acts); targets (rows,) are sampled from it once.
    """

    V: int
    D: int
    d_features: int
    rows: int
    batch: int
    zipf_alpha: float = 1.0
    data_seed: int = 1234

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.data_seed)
        h = torch.randn(self.rows, self.d_features, generator=g)
        h[:, -1] = 1.0
        teacher = torch.randn(self.V, self.d_features, generator=g) * (2 / math.sqrt(self.d_features))
        zipf_bias = -self.zipf_alpha * torch.log1p(torch.randperm(self.V, generator=g).float())  # (V,)
        self.features = h
        # Inverse-CDF sampling, a block of rows at a time: (rows, V) logits would be gigabytes at GPU
        # sizes, and torch.multinomial over tens of thousands of classes is slow on a CPU.
        targets = []
        for block in h.split(2048):
            cdf = torch.softmax(block @ teacher.T + zipf_bias, 1).cumsum_(1)  # (block, V)
            u = torch.rand(block.shape[0], 1, generator=g) * cdf[:, -1:]
            targets.append(torch.searchsorted(cdf, u).squeeze(1).clamp_(max=self.V - 1))
        self.targets = torch.cat(targets)

    def make_model(self) -> nn.Module:
        return LastLayerAndHead(self.d_features, self.D, self.V)

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, self.rows, (self.batch,), generator=g)
        return self.features[i], self.targets[i]


@dataclass
class CorpusLMTask:
    """Next-token prediction on a ``helpers.compare.corpus.Corpus`` with ``ContextMLPLM``."""

    corpus: object  # helpers.compare.corpus.Corpus
    D: int
    context: int
    d_embed: int
    d_hidden: int
    batch: int
    curve_tokens: int | None = None  # the validation curve uses the first this-many val positions

    @property
    def V(self) -> int:
        return len(self.corpus.vocab)

    def make_model(self) -> nn.Module:
        return ContextMLPLM(self.V, self.D, self.context, self.d_embed, self.d_hidden)

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.corpus.train_ids
        positions = torch.randint(self.context, ids.numel(), (self.batch,), generator=g)
        return context_windows(ids, positions, self.context)

    def validation_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(contexts (M, k), targets (M,)): every position of the validation split."""
        ids = self.corpus.val_ids
        return context_windows(ids, torch.arange(self.context, ids.numel()), self.context)


# ---------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainRun:
    """What one arm (variant, seed) produced. Tensors stay on the CPU and out of ``summary``."""

    variant: str
    seed: int
    train_loss: list[float]  # per step, as the arm's own loss reported it
    eval_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)  # exact fp32 loss on the curve's val positions
    wall_s: float = 0.0  # the whole run, evaluation included
    eval_s: float = 0.0
    skipped_steps: int = 0  # fp16 steps the gradient scaler dropped for an inf/NaN gradient
    # Per step, the fraction of logit tiles whose gradient our filter dropped (ours only, else []).
    filter_skipped: list[float] = field(default_factory=list)
    rows_with_grad: torch.Tensor | None = None  # (V,) steps on which row v of C got a nonzero gradient
    row_drift: torch.Tensor | None = None  # (V,) ||C_final[v] - C_init[v]||
    val_token_loss: torch.Tensor | None = None  # (M,) final per-token loss, whole validation split

    def summary(self) -> dict:
        return {
            "variant": self.variant,
            "seed": self.seed,
            "train_loss": self.train_loss,
            "eval_steps": self.eval_steps,
            "val_loss": self.val_loss,
            "wall_s": self.wall_s,
            "eval_s": self.eval_s,
            "skipped_steps": self.skipped_steps,
            "filter_skipped": self.filter_skipped,
        }


def learning_rate_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def per_token_loss(model, inputs, targets, compute_dtype, batch: int = 8192) -> torch.Tensor:
    """(M,) exact fp32 loss of each position, whatever loss the model was trained with."""
    device = next(model.parameters()).device
    C = model.C.to(compute_dtype)
    out = []
    for start in range(0, targets.numel(), batch):
        i = slice(start, start + batch)
        with _autocast(device, compute_dtype):
            E = model.hidden(inputs[i].to(device))
        out.append(get_method("exact")(E.to(compute_dtype), C, targets[i].to(device), reduction="none").cpu())
    return torch.cat(out)


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


@dataclass
class Arm:
    """One arm's model, loss, optimizer and gradient scaler, as ``train`` sets them up; what
    ``helpers.lab.step_time`` times is the same arm, built by the same ``start_arm``."""

    loss_fn: object  # a helpers.compare.methods.Method
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    compute_dtype: torch.dtype

    def loss_inputs(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(E (N, D), C (V, D), x (N,)) of one batch, as the loss receives them: the body under
        autocast in the compute dtype, then E and C cast to it, because that is where a fused
        kernel's precision (and its gradient filter's threshold) applies."""
        device, dtype = self.model.C.device, self.compute_dtype
        with _autocast(device, dtype):
            E = self.model.hidden(inputs.to(device))
        return E.to(dtype), self.model.C.to(dtype), targets.to(device)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, stats: dict | None = None) -> torch.Tensor:
        """The loss of one batch. ``stats``: passed on to a method that counts skipped tiles (None:
        no counting, and no host read of the counts). Targets on the host (the tasks' batches) are
        checked there, before they move: the method's own check would read the device, a sync every
        step that times a host-heavy arm as host plus GPU (``helpers.compare.measure.loss_step``)."""
        extra = {} if stats is None else {"stats": stats}
        E, C, x = self.loss_inputs(inputs, targets)
        on_host = targets.device.type == "cpu"
        if on_host:
            raise_for_targets(targets, C.shape[0], -100)  # the methods' default ignore_index
        return self.loss_fn(E, C, x, check_targets=not on_host, **extra)


def start_arm(task, variant: str, *, seed: int, lr: float, compute_dtype: torch.dtype,
              device: torch.device | str) -> Arm:
    """``task.make_model()`` initialised on the CPU after ``torch.manual_seed(seed)``, moved to
    ``device``, with Adam (betas 0.9, 0.95, no weight decay) and a gradient scaler that is on in
    fp16 only. Raises, saying why, where ``variant`` cannot run."""
    device = torch.device(device)
    loss_fn = get_method(variant)
    reason = loss_fn.why_unavailable(device, compute_dtype)
    if reason:
        raise RuntimeError(f"{variant} cannot run on {device} in {compute_dtype}: {reason}")
    torch.manual_seed(seed)
    model = task.make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler(device.type, enabled=compute_dtype == torch.float16)
    return Arm(loss_fn, model, optimizer, scaler, compute_dtype)


def train(
    task,
    variant: str,
    *,
    seed: int,
    steps: int,
    lr: float,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    warmup: int = 0,
    eval_every: int = 0,
) -> TrainRun:
    """Train ``task.make_model()`` with loss ``variant`` for ``steps`` steps; see ``TrainRun``.

    Seeding: the model is initialised on the CPU after ``torch.manual_seed(seed)``, and batches
    come from a CPU generator seeded with ``seed``, so every arm with the same seed starts from the
    same weights and sees the same batches, on any device.

    Precision: the parameters stay fp32 (the optimizer's master weights); the body runs under
    autocast in ``compute_dtype``, and E and C are cast to it before the loss, because that is
    where a fused kernel's precision (and its gradient filter's threshold) applies. fp16 adds a
    gradient scaler, as fp16 training needs. Adam without weight decay: a classifier row that gets
    no gradient does not move, so its drift measures the gradient it received.
    """
    device = torch.device(device)
    arm = start_arm(task, variant, seed=seed, lr=lr, compute_dtype=compute_dtype, device=device)
    loss_fn, model, optimizer, scaler = arm.loss_fn, arm.model, arm.optimizer, arm.scaler
    C_init = model.C.detach().float().cpu().clone()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: learning_rate_factor(s, steps, warmup))
    g = torch.Generator().manual_seed(seed)
    validation = task.validation_set() if eval_every else None
    curve = tuple(t[: task.curve_tokens] for t in validation) if eval_every else None

    losses = torch.empty(steps, device=device)  # kept on the device: no sync per step
    rows_with_grad = torch.zeros(model.C.shape[0], dtype=torch.int64, device=device)
    run = TrainRun(variant, seed, [])
    start = time.perf_counter()
    for step in range(steps):
        if eval_every and step % eval_every == 0:
            _evaluate(run, model, curve, compute_dtype, step)
        stats = {}
        loss = arm.loss(*task.sample(g), stats=stats)
        scaler.scale(loss).backward()
        if loss_fn.counts_skips:
            run.filter_skipped.append(stats.get("skipped", 0) / max(1, stats.get("tiles", 0)))
        # The filter's footprint: rows of C that received any gradient at all this step.
        if model.C.grad is not None:
            rows_with_grad += (model.C.grad != 0).any(dim=1)
        scale_before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)
        scaler.update()
        if scale_before is not None and scaler.get_scale() < scale_before:
            run.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # A step the fp16 scaler skipped (inf or NaN gradient) leaves the optimizer unstepped;
            # the schedule moves on regardless, which torch warns about. Expected, not a fault.
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            schedule.step()
        losses[step] = loss.detach().float()
    if eval_every:
        _evaluate(run, model, curve, compute_dtype, steps)
        start_final = time.perf_counter()
        run.val_token_loss = per_token_loss(model, *validation, compute_dtype)
        run.eval_s += time.perf_counter() - start_final
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    run.wall_s = time.perf_counter() - start
    run.train_loss = losses.cpu().tolist()
    run.rows_with_grad = rows_with_grad.cpu()
    run.row_drift = (model.C.detach().float().cpu() - C_init).norm(dim=1)
    return run


def _evaluate(run: TrainRun, model, curve, compute_dtype, step: int):
    start = time.perf_counter()
    run.eval_steps.append(step)
    run.val_loss.append(float(per_token_loss(model, *curve, compute_dtype).mean()))
    run.eval_s += time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def write_json(path, payload: dict):
    """Write ``payload`` as JSON; NaN and inf (an empty bin, a diverged run) become null."""

    def clean(v):
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(payload), indent=1))
    return path


__all__ = [
    "filter_threshold",
    "LastLayerAndHead",
    "ContextMLPLM",
    "FineTuneTask",
    "CorpusLMTask",
    "context_windows",
    "TrainRun",
    "Arm",
    "start_arm",
    "train",
    "per_token_loss",
    "learning_rate_factor",
    "write_json",
]
