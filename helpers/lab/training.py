"""Convergence A/B: train the same model on the same data from the same seed, changing only the loss.

A loss that is fast but subtly wrong corrupts every optimizer step, and a gradient check on one
batch cannot see an error that only matters summed over thousands of steps (a gradient that is
dropped when it is small, say). So notebook 03 trains, and compares curves. This module holds the
pieces:

- The losses the arms train with are methods of the registry (``helpers.compare.methods``), by
  name: ``exact`` is the yardstick (fp32 logits from the same low-precision E and C every arm
  gets), ``ours`` and ``ours_nofilter`` our kernel with the filter on and off, and the peers. A
  method that cannot run says why (``why_unavailable``); none is skipped or swapped silently.
- Two tasks. ``FineTuneTask``: the article's fine-tuning A/B, the last layer and lm_head trained
  on fixed synthetic features (nearly convex: arms drift apart by error more than by chaos).
  ``CorpusLMTask``: a small language model trained from scratch on ``helpers.compare.corpus``.
- ``train``: the one training loop. Seeded (same seed, same losses, bit for bit on a CPU), mixed
  precision with fp32 master weights, and it records what the rare-token diagnostic needs.
- Diagnostics: frequency bins, per-bin means, and the comparison of each arm with ``exact``, paired
  by seed (a 95% confidence interval of the per-seed differences).
- Reading: the fine-tuning bound (calibrated on the naive arm, as the gate calibrates its own), what
  our filter skipped, and the sentences, headline and per-method facts the notebook reports, each
  computed from the numbers. Step times are ``helpers.lab.step_time``'s: a run's wall time holds
  compilation and skip counting, and does not time the loss.

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
from helpers.compare import verdicts
from helpers.compare.verdicts import t_quantile
from helpers.compare.methods import get_method
from helpers.compare.trained import ContextMLPLM, context_windows
from helpers.spec import reference_loss_and_grads

# ---------------------------------------------------------------------------------------------
# The losses the arms train with: methods of the registry (``helpers.compare.methods``), presets
# included ("exact", "ours_nofilter"), by name.
# ---------------------------------------------------------------------------------------------


def filter_threshold(dtype: torch.dtype) -> float | None:
    """Our gradient filter's "auto" threshold in ``dtype`` (None: off), as ``helpers.cce`` resolves it."""
    return resolve_options(dtype).filter_eps


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
        no counting, and no host read of the counts)."""
        extra = {} if stats is None else {"stats": stats}
        return self.loss_fn(*self.loss_inputs(inputs, targets), **extra)


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
# Diagnostics
# ---------------------------------------------------------------------------------------------

# Training-count bins, in decades: [1, 10), [10, 100), ...
FREQUENCY_EDGES = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000)


def frequency_bins(counts: torch.Tensor, edges=FREQUENCY_EDGES, exclude: tuple[int, ...] = (0,)):
    """(bin of each vocabulary id (V,), labels). -1 marks excluded ids (``<unk>``) and counts
    outside the edges; only bins holding at least one id are kept, renumbered from 0."""
    counts = counts.long()
    raw = torch.bucketize(counts, torch.tensor(edges[1:]), right=True)
    raw[(counts < edges[0]) | (counts >= edges[-1])] = -1
    raw[list(exclude)] = -1
    used = sorted(int(b) for b in raw.unique() if b >= 0)
    bins = torch.full_like(raw, -1)
    for new, old in enumerate(used):
        bins[raw == old] = new
    labels = [f"{edges[b]:,}–{edges[b + 1] - 1:,}" for b in used]
    return bins, labels


def per_bin_mean(values: torch.Tensor, bins: torch.Tensor, n_bins: int) -> list[float]:
    """Mean of ``values`` over the items of each bin (bins -1 ignored); NaN for an empty bin."""
    values, bins = values.double(), bins.long()
    kept = bins >= 0
    total = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins[kept], values[kept])
    count = torch.bincount(bins[kept], minlength=n_bins).double()
    return (total / count).tolist()  # 0/0 = NaN for an empty bin


DIAGNOSTIC_QUANTITIES = ("val_loss", "row_drift", "grad_step_fraction")


def rare_token_diagnostic(
    runs: dict[str, list[TrainRun]], type_bins: torch.Tensor, val_targets: torch.Tensor, n_bins: int
) -> dict[str, dict[str, list[list[float]]]]:
    """{arm: {quantity: (seeds, bins) nested list}}, per training-frequency bin:

    - val_loss: final exact validation loss on the validation tokens whose target is in the bin;
    - row_drift: mean ||C_final[v] - C_init[v]|| over the bin's classifier rows;
    - grad_step_fraction: mean fraction of steps on which the bin's rows got any gradient.
    """
    out = {}
    for arm, arm_runs in runs.items():
        out[arm] = {q: [] for q in DIAGNOSTIC_QUANTITIES}
        for run in arm_runs:
            steps = len(run.train_loss)
            out[arm]["val_loss"].append(per_bin_mean(run.val_token_loss, type_bins[val_targets], n_bins))
            out[arm]["row_drift"].append(per_bin_mean(run.row_drift, type_bins, n_bins))
            out[arm]["grad_step_fraction"].append(per_bin_mean(run.rows_with_grad.double() / steps, type_bins, n_bins))
    return out


def paired_difference(arm, base) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, ci95) of arm - base over seeds, the first dimension: ``arm`` and ``base`` are (seeds,)
    or (seeds, points), seed s of one paired with seed s of the other. ci95 is the half-width of
    the mean's two-sided 95% confidence interval, t quantile × sd / sqrt(seeds); NaN with one seed.
    For the figures; verdicts come from ``helpers.compare.verdicts``."""
    diff = torch.as_tensor(arm, dtype=torch.float64) - torch.as_tensor(base, dtype=torch.float64)
    n = diff.shape[0]
    if n < 2:
        return diff.mean(0), torch.full_like(diff[0], math.nan)
    return diff.mean(0), t_quantile(n - 1, 0.95) * diff.std(0) / math.sqrt(n)


def outcomes_against(values: dict[str, list[float]], baseline: str = "exact", floor: float | None = None) -> dict:
    """{arm: the engine's ``pretrain_outcome`` against the baseline, as a dict}: ``values[arm][s]``
    is seed s's number. The arms share each seed's initial weights and batches, so the paired
    per-seed differences isolate the loss. ``floor``: the margin's floor (nats by default; 0 for a
    quantity that is not a loss, such as a row's drift)."""
    base = values[baseline]
    kwargs = {} if floor is None else {"floor": floor}
    return {arm: verdicts.pretrain_outcome(v, base, **kwargs).as_dict() for arm, v in values.items() if arm != baseline}


def pretraining_findings(
    runs: dict[str, list[TrainRun]],
    diagnostic: dict,
    bin_labels: list[str],
    labels: dict[str, str],
    baseline: str = "exact",
) -> tuple[dict, list[str]]:
    """(comparisons, sentences): every arm against the baseline, paired by seed, on the final
    validation loss (the verdict) and on each frequency bin's validation loss and row drift (the
    diagnostic, read by ``describe_rare_tokens`` and ``bin_table``); the sentences are the engine's."""
    final = {arm: [r.val_loss[-1] for r in arm_runs] for arm, arm_runs in runs.items()}
    comparisons = {"final_val_loss": outcomes_against(final, baseline), "bins": {}}
    lines = [f"{labels.get(arm, arm)}: {verdicts.Outcome.from_dict(o).describe()}"
             for arm, o in comparisons["final_val_loss"].items()]
    for quantity, floor in (("val_loss", None), ("row_drift", 0.0)):
        comparisons["bins"][quantity] = [
            outcomes_against({arm: [seed[b] for seed in d[quantity]] for arm, d in diagnostic.items()}, baseline, floor)
            for b in range(len(bin_labels))]
    return comparisons, lines


def bin_table(bin_comparisons: list[dict], bin_labels: list[str], labels: dict[str, str]) -> str:
    """A Markdown table of each arm's validation loss against exact per frequency bin: the paired
    mean difference, its 95% interval, and the engine's verdict where it is not "equivalent"."""
    if not bin_comparisons or not bin_comparisons[0]:
        return ""
    head = "| method | " + " | ".join(f"seen {b} times" for b in bin_labels) + " |"
    rows = [head, "|---|" + "---:|" * len(bin_labels)]
    for arm in bin_comparisons[0]:
        cells = []
        for per_bin in bin_comparisons:
            o = verdicts.Outcome.from_dict(per_bin[arm])
            if not math.isfinite(o.effect):
                cells.append("no tokens" if o.verdict == verdicts.UNDECIDED else "not finite")
                continue
            ci = f" ± {o.ci95:.2g}" if math.isfinite(o.ci95) else ""
            word = "" if o.verdict == verdicts.EQUIVALENT else f" ({o.verdict})"
            cells.append(f"{verdicts.signed(o.effect)}{ci}{word}")
        rows.append(f"| {labels.get(arm, arm)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def loss_scale_check(task, names: list[str], *, device, dtype=torch.float16, scale: float = 2.0**16,
                     seed: int = 0) -> dict[str, dict]:
    """What each loss hands back under fp16 loss scaling, on one batch of ``task`` at init.

    Every fp16 trainer multiplies the loss by a scale (``GradScaler`` starts at 2^16) so that small
    gradients survive fp16, and divides it out before the optimizer step. That works when the
    scale reaches every fp16 intermediate of the backward. A loss that forms its gradients in the
    forward pass (Liger) rounds them to fp16 before the scale exists: entries of G / N below fp16's
    smallest subnormal (2^-24 = 6e-8) are zero whatever the scale. Per loss: "dC_error",
    "dE_error", relative L2 error of the unscaled gradients against float64; "zero_rows", the
    fraction of classifier rows whose whole gradient is zero (rows that would not train this
    step); and for reference "underflow", the fraction of entries of S / N that are 0 in fp16.
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    model = task.make_model().to(device)
    inputs, targets = task.sample(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        E = model.hidden(inputs.to(device)).to(dtype)
        C = model.C.detach().to(dtype)
    x = targets.to(device)
    _, dE64, dC64 = reference_loss_and_grads(E, C, x)
    S = torch.softmax(E.double() @ C.double().T, dim=1)
    underflow = float(((S / x.numel()).to(dtype) == 0).double().mean())
    out = {}
    for name in names:
        E_, C_ = E.clone().requires_grad_(True), C.clone().requires_grad_(True)
        (get_method(name)(E_, C_, x) * scale).backward()
        dE, dC = E_.grad.double() / scale, C_.grad.double() / scale
        out[name] = {
            "zero_rows": float((C_.grad == 0).all(dim=1).double().mean()),
            "dC_error": float((dC - dC64).norm() / dC64.norm()),
            "dE_error": float((dE - dE64).norm() / dE64.norm()),
            "underflow": underflow,
        }
    return out


def split_faults(problems: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(ours, peers) from [(arm, what went wrong)]: a drift or crash of our own code (an arm of
    kind "ours" or "baseline": our kernel, the exact arm, the chunked loss, the pipeline) is a
    fault that must stop the notebook; a peer's is a finding to report and explain."""
    ours, peers = [], []
    for arm, problem in problems:
        (peers if get_method(arm).kind == "peer" else ours).append(problem)
    return ours, peers


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


def max_relative_drift(losses: list[float], reference: list[float]) -> float:
    """max over steps of |loss - reference| / |reference|: the fine-tuning A/B's verdict number."""
    a, r = torch.tensor(losses, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    if not torch.isfinite(a).all():
        return math.inf
    return float(((a - r).abs() / r.abs()).max())


# ---------------------------------------------------------------------------------------------
# Reading the runs: the fine-tuning bound, the filter's work, and the sentences and facts
# the notebook reports (each computed from the numbers, never written in advance)
# ---------------------------------------------------------------------------------------------


def filter_skip_summary(runs: list[TrainRun]) -> dict | None:
    """What our filter skipped over one arm's ``runs`` (its seeds), as fractions of the logit tiles:
    "mean" over every step, "first" and "last" (that step, averaged over the runs), "max" over
    every step. None when no run counted skips (an arm that is not our kernel)."""
    counted = [r.filter_skipped for r in runs if r.filter_skipped]
    if not counted:
        return None
    steps = [f for fractions in counted for f in fractions]
    return {
        "mean": sum(steps) / len(steps),
        "first": sum(f[0] for f in counted) / len(counted),
        "last": sum(f[-1] for f in counted) / len(counted),
        "max": max(steps),
    }


def describe_rare_tokens(
    diagnostic: dict,
    bin_comparisons: dict[str, list[dict]],
    bin_labels: list[str],
    vocab_size: int,
    labels: dict[str, str],
    baseline: str = "exact",
) -> list[str]:
    """What the rare-token result means, in sentences computed from the numbers.

    ``diagnostic``: ``rare_token_diagnostic``'s; ``bin_comparisons``: ``pretraining_findings``'s
    comparisons["bins"] ({"val_loss": [per bin: {arm: outcome}], "row_drift": [...]}), judged by
    the engine with its practical margins. The yardstick is uniform guessing, ln V nats; the
    reading compares each arm with the baseline on the rarest bin, says whether its classifier rows
    moved less, and where the arm pays instead. The final validation loss, not this, is the verdict.
    """
    uniform = math.log(vocab_size)
    lines = [f"Lower is better. Guessing uniformly over the {vocab_size:,} ids scores ln {vocab_size:,} = "
             f"{uniform:.2f} nats on any token."]
    seeds = [s[0] for s in diagnostic[baseline]["val_loss"]] if bin_labels else []
    rarest = sum(seeds) / len(seeds) if seeds else math.nan
    if not math.isfinite(rarest):
        return lines + ["No validation token falls in the rarest frequency bin: nothing to read here."]
    name = labels.get(baseline, baseline)
    if rarest > uniform:
        lines.append(f"{name} scores {rarest:.2f} nats on tokens seen {bin_labels[0]} times in training, worse than "
                     "uniform guessing: every step pushes down the logit of every token but the target, and a rare "
                     "token is seldom the target that pushes it back up.")
    else:
        lines.append(f"{name} scores {rarest:.2f} nats on tokens seen {bin_labels[0]} times in training, better than "
                     "uniform guessing.")
    val_loss, row_drift = bin_comparisons["val_loss"], bin_comparisons["row_drift"]
    alike = []
    for arm in val_loss[0]:
        arm_name = labels.get(arm, arm)
        first = verdicts.Outcome.from_dict(val_loss[0][arm])
        if first.seeds < 2 or not math.isfinite(first.effect):
            lines.append(f"{arm_name}: one seed or no data on the rarest tokens, no reading.")
            continue
        worse = [bin_labels[b] for b, c in enumerate(val_loss) if c[arm]["verdict"] == verdicts.WORSE]
        moved = verdicts.Outcome.from_dict(row_drift[0][arm])
        if first.verdict == verdicts.BETTER:
            why = (f" Its rarest classifier rows moved {abs(moved.effect):.2g} less than exact's (mean distance "
                   "from their initialisation): they received less of that push-down and stayed nearer uniform "
                   "guessing." if moved.verdict == verdicts.BETTER
                   else " Its rarest rows' drift is not measurably smaller than exact's, so the cause is not "
                        "measured here.")
            cost = (f" It pays on tokens seen {', '.join(worse)} times, where its loss is higher than exact's."
                    if worse else "")
            lines.append(f"{arm_name}: better than exact on the rarest tokens by {abs(first.effect):.2g} nats "
                         f"(margin ±{first.margin:.2g})." + why + cost)
        elif first.verdict == verdicts.WORSE:
            lines.append(f"{arm_name}: worse than exact on the rarest tokens by {first.effect:.2g} nats (margin "
                         f"±{first.margin:.2g}): what a filter that starves rare tokens of gradient would do.")
        elif worse:
            lines.append(f"{arm_name}: the rarest tokens not measurably different from exact, but worse on tokens "
                         f"seen {', '.join(worse)} times.")
        else:
            alike.append(arm_name)
    if alike:
        lines.append(f"{', '.join(alike)}: no frequency bin measurably worse than exact's.")
    return lines


def convergence_facts(
    finetune: dict[str, verdicts.Outcome],
    pretrain: dict[str, verdicts.Outcome],
    dtype: str,
    labels: dict[str, str],
    not_run: dict[str, str] | None = None,
    caveats: dict[str, list[str]] | None = None,
    yardsticks: tuple[str, ...] = ("exact", "naive"),
) -> dict[str, dict]:
    """Per method, what the REPORT reads (``helpers.suite.report.FACT_KEYS``): "convergence",
    {dtype: {"verdict", "parts"}} (the engine's ``convergence_fact`` over the parts the method ran
    in), and "caveats". A preset (ours with the filter off, Apple's filter-off and Kahan-FullC
    arms) has no row of its own: where its verdict differs from its method's, or it did not run
    for another reason, that is a short caveat of the method it is a preset of. ``not_run``:
    {method: why} for the arms that could not run here."""
    from helpers.compare.methods import METHODS

    parts: dict[str, list[verdicts.Outcome]] = {}
    for name in dict.fromkeys([*finetune, *pretrain, *(not_run or {})]):
        if name not in METHODS or name in yardsticks or (METHODS[name].preset_of or name) in yardsticks:
            continue
        parts[name] = [o for o in (finetune.get(name), pretrain.get(name)) if o is not None]
    facts: dict[str, dict] = {}
    for name, outcomes in parts.items():
        parent = METHODS[name].preset_of or name
        entry = facts.setdefault(parent, {"caveats": []})
        verdict = verdicts.combine(outcomes)
        if parent == name:
            if outcomes:
                entry["convergence"] = verdicts.convergence_fact(dtype, outcomes)
            elif name in (not_run or {}):
                entry["caveats"].insert(0, f"not trained here: {not_run[name]}")
            continue
        parent_verdict = verdicts.combine(parts.get(parent, []))
        if outcomes and verdict != parent_verdict:
            entry["caveats"].append(f"{labels.get(name, name)}: {verdicts.trains_phrase(verdict)} in {dtype} "
                                    f"({'; '.join(o.describe() for o in outcomes if o.verdict != verdicts.EQUIVALENT)})")
        elif not outcomes and name in (not_run or {}) and (not_run or {}).get(parent) != not_run[name]:
            entry["caveats"].append(f"{labels.get(name, name)}: not trained here: {not_run[name]}")
    for name, extra in (caveats or {}).items():
        facts.setdefault(name, {"caveats": []})["caveats"] += extra
    return facts


def convergence_headline(finetune: dict[str, verdicts.Outcome], pretrain: dict[str, verdicts.Outcome],
                         labels: dict[str, str]) -> str:
    """One line for the report: each part's verdicts, the engine's words, the exceptions named."""
    said = []
    for part, outcomes in (("fine-tuning", finetune), ("pretraining", pretrain)):
        if not outcomes:
            said.append(f"{part}: no arm ran")
            continue
        odd = {n: o for n, o in outcomes.items() if o.verdict != verdicts.EQUIVALENT}
        names = [f"{labels.get(n, n)} {o.describe().removeprefix(part + ': ')}" for n, o in odd.items()]
        rest = len(outcomes) - len(odd)
        margin = next(iter(outcomes.values())).margin
        tail = (f"{'the other ' if odd else 'all '}{rest} equivalent to exact (margin {margin:.2g}"
                + (" nats)" if part == "pretraining" else ")")) if rest else ""
        said.append(f"{part}: " + "; ".join([*names, tail] if tail else names))
    return "; ".join(said)


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
    "FREQUENCY_EDGES",
    "frequency_bins",
    "per_bin_mean",
    "DIAGNOSTIC_QUANTITIES",
    "rare_token_diagnostic",
    "pretraining_findings",
    "outcomes_against",
    "bin_table",
    "paired_difference",
    "filter_skip_summary",
    "describe_rare_tokens",
    "convergence_facts",
    "convergence_headline",
    "max_relative_drift",
    "loss_scale_check",
    "split_faults",
    "write_json",
]
