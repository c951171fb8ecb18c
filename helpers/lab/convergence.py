"""What a convergence A/B's runs say (``helpers.lab.training`` trains them; notebook 03 reads them).

- Diagnostics: frequency bins, per-bin means, and the comparison of each arm with ``exact``, paired
  by seed (a 95% confidence interval of the per-seed differences); what each loss hands back under
  fp16 loss scaling (``loss_scale_check``).
- Reading: the fine-tuning bound (calibrated on the naive arm, as the gate calibrates its own), what
  our filter skipped, and the sentences, headline and per-method facts the notebook reports, each
  computed from the numbers. The verdict words are ``helpers.compare.verdicts``'s.
"""

from __future__ import annotations

import math

import torch

from helpers.compare import verdicts
from helpers.compare.verdicts import t_quantile
from helpers.compare.methods import get_method
from helpers.lab.training import TrainRun
from helpers.spec import reference_loss_and_grads

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
    # The best of the more frequent bins: the mechanism below is read only where those beat guessing.
    per_bin = [[s[b] for s in diagnostic[baseline]["val_loss"] if math.isfinite(s[b])] for b in range(len(bin_labels))]
    others = [(bin_labels[b], sum(v) / len(v)) for b, v in enumerate(per_bin) if b > 0 and v]
    best = min(others, key=lambda o: o[1]) if others else None
    if rarest > uniform and best is not None and best[1] < uniform:
        lines.append(f"{name} scores {rarest:.2f} nats on tokens seen {bin_labels[0]} times in training, worse than "
                     f"uniform guessing, while it scores {best[1]:.2f} on tokens seen {best[0]} times: every step "
                     "pushes down the logit of every token but the target, and a rare token is seldom the target "
                     "that pushes it back up.")
    elif rarest > uniform and best is not None:
        lines.append(f"{name} scores {rarest:.2f} nats on tokens seen {bin_labels[0]} times in training, worse than "
                     "uniform guessing, and no better than guessing on the more frequent tokens either "
                     f"({best[1]:.2f} at best, on tokens seen {best[0]} times): the model has not learned past "
                     "guessing yet, so this says nothing about rare tokens.")
    elif rarest > uniform:
        lines.append(f"{name} scores {rarest:.2f} nats on tokens seen {bin_labels[0]} times in training, worse than "
                     "uniform guessing; no more frequent token was scored to compare it with.")
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
]
