"""The verdict engine: every verdict the suite prints is decided here, and worded here.

Notebooks measure and save numbers; this module turns numbers into verdicts (the gate's pass or
fail, "trains like exact", the first steps of a whole-model run agreeing, what fits, what is
fastest, what to use) and into the sentences that state them. Notebooks and the REPORT call it;
none restates a verdict in its own words or with its own threshold.

The margins, declared before any run (each notebook prints the one it uses before it measures):

- **Gradients (01).** Per case and quantity, error against float64 <= max(floor of the dtype,
  ``SLACK`` × the naive loss's error on the same inputs): ``gate_bound``. A method passes a dtype
  when it ran there and no case failed.
- **Fine-tuning (03).** The largest per-step relative drift of the training loss from the exact
  arm's <= max(floor of the dtype, ``SLACK`` × the naive arm's drift): ``finetune_bound``. One run
  per arm: "equivalent" within it, "different" past it (with the sign of the last steps' gap).
- **Pretraining (03).** The final validation loss within ±δ nats of exact's, δ = max(
  ``PRETRAIN_MARGIN_FLOOR_NATS``, ``PRETRAIN_MARGIN_SEED_SHARE`` × the exact arm's seed-to-seed
  standard deviation): a difference smaller than half of what the choice of seed does is not one a
  user can act on. Two one-sided tests on the paired per-seed differences (equivalent when the 90%
  interval lies inside ±δ); "better" or "worse" only when the whole 95% interval lies beyond δ;
  otherwise "undecided" (too few seeds to tell).
- **The first steps of a whole model (05).** The largest step-by-step gap of the training loss to
  transformers' default loss within max(2 × the default's own repeat gap, the gradient bound):
  the first steps agree. Twenty steps from random weights say nothing about convergence; that
  verdict is 03's alone.
- **Speed and memory.** Times within ``SPEED_TIE`` (5%) of each other are a tie, and so are peaks
  within ``MEMORY_TIE`` (5%); "least memory" and "fastest" name every method in the tie.
- **Recommended.** A method is recommended for training in a dtype only where this run measured
  that it passes the gate there (01) and trains like exact, or better (03), in that dtype; a
  measurement that did not run is said, and nothing is recommended on its absence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from helpers.compare.methods import METHODS, method_label

# ---------------------------------------------------------------------------------------------
# Margins
# ---------------------------------------------------------------------------------------------

# Gradients: max(FLOOR[dtype], SLACK × naive's error). Below the dtype's rounding of the
# inputs themselves no kernel can be judged, hence the floors (relative L2 errors).
# fp32 is real fp32 (a TF32 matmul lands near 5e-4 and fails, as it should: the caller asked for
# fp32). The floors are below 1% everywhere, so a gradient scaled by 1.01 or a dropped soft cap
# fails in every dtype (tests/compare/test_gate.py).
GATE_FLOOR = {
    "float32": {"loss": 1e-5, "dE": 1e-4, "dC": 1e-4},
    "float16": {"loss": 1e-3, "dE": 3e-3, "dC": 3e-3},
    "bfloat16": {"loss": 4e-3, "dE": 6e-3, "dC": 6e-3},
}
SLACK = 2.0
# A whole model's gradients (05) against the same model with fp32-logit loss, all tensors together:
# the dtype's rounding of the model body dominates, so the bound is the dtype's, not naive-calibrated.
WHOLE_MODEL_GRADIENT_BOUND = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 3e-2}
PRETRAIN_MARGIN_FLOOR_NATS = 0.005
PRETRAIN_MARGIN_SEED_SHARE = 0.5
SPEED_TIE = 0.05
MEMORY_TIE = 0.05

# Verdicts on training, and the one phrase each is printed with, everywhere.
EQUIVALENT, BETTER, WORSE, DIFFERENT, UNDECIDED = "equivalent", "better", "worse", "different", "undecided"
TRAINS = {
    EQUIVALENT: "trains like exact",
    BETTER: "trains better than exact",
    WORSE: "trains worse than exact",
    DIFFERENT: "trains differently from exact",
    UNDECIDED: "training verdict undecided",
    None: "training not measured",
}
# A method may be recommended for training where its verdict is one of these.
TRAINS_WELL = (EQUIVALENT, BETTER)


def gate_bound(dtype: str, quantity: str, naive_error: float | None) -> float:
    """The gate's bound on one quantity: max(floor, SLACK × naive's error); naive itself, and a
    naive that gave no finite error, get the floor."""
    yardstick = naive_error if naive_error is not None and math.isfinite(naive_error) else 0.0
    return max(GATE_FLOOR[dtype][quantity], SLACK * yardstick)


def gate_case_status(method: str, errors: dict, bounds: dict, raised: str) -> str:
    """"pass" when every quantity is within its bound. naive is the yardstick, not a candidate:
    over a floor it is the dtype's own limit, "over floor" (a pass), unless it raised or gave NaN."""
    if not raised and errors and all(errors[q] <= bounds[q] for q in bounds):
        return "pass"
    if method == "naive" and not raised and errors and all(math.isfinite(e) for e in errors.values()):
        return "over floor"
    return "fail"


def gate_verdict(statuses: list[str]) -> str | None:
    """A method's verdict in one dtype from its cases' statuses: "pass", "fail", or None where no
    case ran ("unavailable" everywhere)."""
    ran = [s for s in statuses if s != "unavailable"]
    if not ran:
        return None
    return "pass" if all(s in ("pass", "over floor") for s in ran) else "fail"


def finetune_bound(yardstick_drift: float, floor: float) -> float:
    """max(floor, SLACK × the naive arm's drift); a yardstick that diverged calibrates nothing."""
    return floor if not math.isfinite(yardstick_drift) else max(floor, SLACK * yardstick_drift)


def pretrain_margin(seed_spread: float) -> float:
    """δ in nats for the final validation loss (see the module's doc)."""
    share = PRETRAIN_MARGIN_SEED_SHARE * seed_spread if math.isfinite(seed_spread) else 0.0
    return max(PRETRAIN_MARGIN_FLOOR_NATS, share)


def margins_text() -> list[str]:
    """The margins in words, for a notebook to print before it measures."""
    return [
        f"gradients: error against float64 <= max(the dtype's floor, {SLACK:g} x the naive loss's error)",
        f"fine-tuning: largest relative drift of the loss from exact's <= max(the dtype's floor, {SLACK:g} x "
        "the naive arm's drift)",
        f"pretraining: final validation loss within ±δ of exact's, δ = max({PRETRAIN_MARGIN_FLOOR_NATS:g} nats, "
        f"{PRETRAIN_MARGIN_SEED_SHARE:g} x exact's seed-to-seed spread); equivalent when the 90% interval of "
        "the paired difference lies inside ±δ, better or worse when the whole 95% interval lies beyond δ, "
        "otherwise undecided",
        f"speed and memory: within {SPEED_TIE:.0%} is a tie",
    ]


# ---------------------------------------------------------------------------------------------
# Numbers, as a reader should see them
# ---------------------------------------------------------------------------------------------


def signed(x: float, digits: int = 2) -> str:
    """+0.0013, -0.0074, and 0 for a zero (never "-0.00"): ``digits`` significant digits."""
    if not math.isfinite(x):
        return "not finite"
    if x == 0:
        return "0"
    return f"{x:+.{digits}g}"


# ---------------------------------------------------------------------------------------------
# Training verdicts
# ---------------------------------------------------------------------------------------------

# Student's t quantiles by degrees of freedom (1..30), two-sided 95% (0.975) and 90% (0.95).
_T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
          2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
          2.045, 2.042]
_T_95 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761,
         1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701,
         1.699, 1.697]


def t_quantile(df: int, two_sided: float = 0.95) -> float:
    """Student's t quantile for a two-sided ``two_sided`` interval (0.95 or 0.90); past 30
    degrees of freedom, 30's (conservative)."""
    if df < 1:
        raise ValueError(f"an interval needs at least 1 degree of freedom (2 seeds), got {df}")
    table = {0.95: _T_975, 0.90: _T_95}.get(two_sided)
    if table is None:
        raise ValueError(f"two_sided must be 0.95 or 0.90, got {two_sided}")
    return table[min(df, len(table)) - 1]


@dataclass(frozen=True)
class Outcome:
    """One training verdict and the numbers behind it.

    verdict: EQUIVALENT, BETTER, WORSE, DIFFERENT or UNDECIDED; part: "fine-tuning" or
    "pretraining"; effect: the arm minus exact (nats of final validation loss in pretraining; the
    signed last-steps gap of the training loss in fine-tuning); margin: the practical margin it was
    judged against; ci95/ci90: half-widths of the paired intervals (pretraining); seed_spread: exact's
    seed-to-seed standard deviation; seeds: paired seeds; drift: the fine-tuning drift."""

    verdict: str
    part: str
    effect: float
    margin: float
    ci95: float = math.nan
    ci90: float = math.nan
    seed_spread: float = math.nan
    seeds: int = 1
    drift: float = math.nan
    same_sign_seeds: int = 0
    extras: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extras"} | self.extras

    @classmethod
    def from_dict(cls, d: dict) -> Outcome:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "extras"}
        return cls(**{k: (math.nan if v is None and k not in ("verdict", "part") else v) for k, v in known.items()})

    def noise_multiple(self) -> float:
        """|effect| in units of the seed-to-seed spread."""
        return abs(self.effect) / self.seed_spread if self.seed_spread and math.isfinite(self.seed_spread) else math.nan

    def describe(self) -> str:
        """The verdict with its evidence, in one clause (no method name)."""
        if self.part == "fine-tuning":
            bound = f"largest drift {self.drift:.2g}, bound {self.margin:.2g}"
            if self.verdict == EQUIVALENT:
                return f"fine-tuning: within the bound ({bound})"
            direction = "higher" if self.effect > 0 else "lower"
            return f"fine-tuning: past the bound ({bound}; its loss ends {direction} than exact's)"
        nats = f"{signed(self.effect, 3)} nats"
        if not math.isfinite(self.effect):
            return "pretraining: the final validation loss is not finite (a run diverged)"
        if self.verdict == UNDECIDED and self.seeds < 2:
            return f"pretraining: {nats} against exact on one seed: undecided (no interval with one seed)"
        interval = f"95% CI ±{self.ci95:.2g}, {self.seeds} paired seeds"
        noise = self.noise_multiple()
        of_noise = f", {noise:.1f}x the seed-to-seed spread {self.seed_spread:.2g}" if math.isfinite(noise) else ""
        if self.verdict == EQUIVALENT:
            return f"pretraining: {nats} against exact ({interval}): equivalent within ±{self.margin:.2g} nats"
        if self.verdict in (BETTER, WORSE):
            return (f"pretraining: {self.verdict} by {abs(self.effect):.3g} nats ({interval}{of_noise}; "
                    f"margin ±{self.margin:.2g})")
        return (f"pretraining: {nats} against exact ({interval}): undecided at ±{self.margin:.2g} nats "
                "(too few seeds to tell)")


def pretrain_outcome(arm: list[float], exact: list[float], margin: float | None = None,
                     floor: float = PRETRAIN_MARGIN_FLOOR_NATS) -> Outcome:
    """The verdict on a per-seed quantity (the final validation loss, in nats), ``arm[s]`` paired
    with ``exact[s]``.

    margin: δ; default max(``floor``, ``PRETRAIN_MARGIN_SEED_SHARE`` × exact's seed spread).
    Equivalent by two one-sided tests at 5% (the 90% interval inside ±δ); better or worse when the
    95% interval lies wholly beyond -δ or +δ (lower is better); undecided otherwise, and with one
    seed. A run that did not finish finite is worse."""
    a = torch.tensor(arm, dtype=torch.float64)
    b = torch.tensor(exact, dtype=torch.float64)
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(f"arm and exact need one value per seed each, got {tuple(a.shape)} and {tuple(b.shape)}")
    n = a.numel()
    diff = a - b
    effect = float(diff.mean())
    spread = float(b.std()) if n > 1 else math.nan
    share = PRETRAIN_MARGIN_SEED_SHARE * spread if math.isfinite(spread) else 0.0
    delta = max(floor, share) if margin is None else margin
    if not math.isfinite(effect):
        finite_base = bool(torch.isfinite(b).all())
        return Outcome(WORSE if finite_base else UNDECIDED, "pretraining", effect, delta, seed_spread=spread, seeds=n)
    if n < 2:
        return Outcome(UNDECIDED, "pretraining", effect, delta, seed_spread=spread, seeds=n)
    se = float(diff.std()) / math.sqrt(n)
    ci95, ci90 = t_quantile(n - 1, 0.95) * se, t_quantile(n - 1, 0.90) * se
    if abs(effect) + ci90 < delta:
        verdict = EQUIVALENT
    elif effect - ci95 > delta:
        verdict = WORSE
    elif effect + ci95 < -delta:
        verdict = BETTER
    else:
        verdict = UNDECIDED
    same = int((torch.sign(diff) == math.copysign(1, effect)).sum())
    return Outcome(verdict, "pretraining", effect, delta, ci95, ci90, spread, n, same_sign_seeds=same)


def finetune_outcome(losses: list[float], exact: list[float], bound: float) -> Outcome:
    """The fine-tuning verdict: the largest per-step relative drift of ``losses`` from ``exact``
    within ``bound``; the effect is the mean signed gap over the last quarter of the steps."""
    a, r = torch.tensor(losses, dtype=torch.float64), torch.tensor(exact, dtype=torch.float64)
    drift = float(((a - r).abs() / r.abs()).max()) if torch.isfinite(a).all() else math.inf
    tail = max(1, a.numel() // 4)
    effect = float((a[-tail:] - r[-tail:]).mean())
    verdict = EQUIVALENT if drift <= bound else DIFFERENT
    return Outcome(verdict, "fine-tuning", effect, bound, drift=drift)


def combine(outcomes: list[Outcome]) -> str | None:
    """One training verdict from the parts a method ran in: worse anywhere is worse; past the
    fine-tuning bound is different; equivalent only when every part is; better where pretraining
    is better and nothing else disagrees; undecided otherwise. None when nothing ran."""
    verdicts = [o.verdict for o in outcomes]
    if not verdicts:
        return None
    if WORSE in verdicts:
        return WORSE
    if DIFFERENT in verdicts:
        return DIFFERENT
    if all(v == EQUIVALENT for v in verdicts):
        return EQUIVALENT
    if BETTER in verdicts and all(v in (EQUIVALENT, BETTER) for v in verdicts):
        return BETTER
    return UNDECIDED


def convergence_fact(dtype: str, outcomes: list[Outcome]) -> dict:
    """What 03 saves for the REPORT about one method in one dtype: {dtype: {"verdict", "parts"}}."""
    return {dtype: {"verdict": combine(outcomes), "parts": [o.as_dict() for o in outcomes]}}


def trains_phrase(verdict: str | None) -> str:
    """A method's one training verdict in one dtype, in words (``combine`` of its parts)."""
    return TRAINS[verdict]


def part_phrase(outcome: Outcome) -> str:
    """One part's outcome in words, never a "trains ..." phrase: those are for a method's one
    verdict, which may differ from a part's (Liger in fp16: past the fine-tuning bound, and worse
    in pretraining, is "trains worse")."""
    if outcome.part == "fine-tuning":
        return "within the bound" if outcome.verdict == EQUIVALENT else "past the bound"
    return {EQUIVALENT: "equivalent", BETTER: "better", WORSE: "worse", UNDECIDED: "undecided"}.get(
        outcome.verdict, outcome.verdict)


def convergence_cell(convergence: dict) -> str:
    """The REPORT's "trains like exact" cell: per dtype, the verdict's phrase and its main number."""
    cells = []
    for dtype, c in convergence.items():
        parts = [Outcome.from_dict(p) for p in c.get("parts", [])]
        v = c.get("verdict")
        short = {EQUIVALENT: "yes", BETTER: "yes, better", WORSE: "**no**, worse", DIFFERENT: "**no**, differs",
                 UNDECIDED: "undecided", None: "not measured"}[v]
        numbers = []
        for p in parts:
            if p.part == "pretraining" and math.isfinite(p.effect):
                numbers.append(f"pretraining {signed(p.effect, 3)} nats, margin ±{p.margin:.2g}")
            elif p.part == "fine-tuning" and p.verdict != EQUIVALENT:
                numbers.append(f"fine-tuning drift {p.drift:.2g}, bound {p.margin:.2g}")
        cells.append(f"{dtype}: {short}" + (f" ({'; '.join(numbers)})" if numbers else ""))
    return "; ".join(cells)


def first_steps_agree(gap: float, repeat_gap: float, gradient_bound: float) -> tuple[bool, float]:
    """(agree, allowed) for 05's short whole-model runs: the largest step-by-step relative gap to
    the default loss within max(2 × the default's repeat gap, the gradient bound)."""
    allowed = max(2 * repeat_gap, gradient_bound)
    return gap <= allowed, allowed


# ---------------------------------------------------------------------------------------------
# Speed and memory
# ---------------------------------------------------------------------------------------------


def least(values: dict[str, float], tie: float) -> list[str]:
    """Every key whose value is within ``tie`` (a fraction) of the smallest, smallest first."""
    known = {k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if not known:
        return []
    low = min(known.values())
    return sorted((k for k, v in known.items() if v <= low * (1 + tie)), key=known.get)




# ---------------------------------------------------------------------------------------------
# What to use: the REPORT's sentences, from every notebook's facts
# ---------------------------------------------------------------------------------------------

REGIME_TOKENS = (4_096, 16_384, 65_536)  # the token counts recommendations are given for, where measured
NEAR_LEAST_MEMORY = 1.5  # "memory-efficient" at a token count: a peak within this multiple of the least
EVIDENCE = {"01_correctness": "01 (gradients against float64)", "02_memory_sweep": "02 (memory and time of the loss)",
            "03_convergence": "03 (training against exact)", "05_fits": "05 (whole training steps)"}


def _kind(method: str) -> str:
    return METHODS[method].kind if method in METHODS else "peer"


def training_verdict(facts: dict, dtype: str) -> str | None:
    """A method's training verdict in ``dtype`` from its facts (None: not measured)."""
    return facts.get("convergence", {}).get(dtype, {}).get("verdict")


def why_not_recommended(method: str, facts: dict, dtype: str, trained: bool) -> str | None:
    """Why ``method`` cannot be recommended for training in ``dtype`` from this run's facts; None
    when it can. A baseline (naive, torch.compile, chunked: the standard loss with fp32 logits,
    the arithmetic "exact" is) needs only the gate; every other method needs the gate and 03."""
    gate = facts.get("gradients", {}).get(dtype)
    if gate == "fail":
        return f"fails the gradient gate in {dtype}"
    if gate is None:
        return f"its gradients were not gated in {dtype} in this run"
    if _kind(method) == "baseline":
        return None
    verdict = training_verdict(facts, dtype)
    if verdict in TRAINS_WELL:
        return None
    if verdict is None:
        return "its training was not measured in this run" if trained else "notebook 03 did not run"
    return f"{TRAINS[verdict]} in {dtype}"


def _points(facts: dict) -> tuple[str | None, dict[int, dict]]:
    sweep = facts.get("sweep") or {}
    return sweep.get("dtype"), {int(n): p for n, p in (sweep.get("points") or {}).items()}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3g} ms" if seconds < 0.1 else f"{seconds * 1e3:,.0f} ms"


def _names(methods: list[str]) -> str:
    return " and ".join(", ".join(method_label(m) for m in methods).rsplit(", ", 1)) if methods else ""


def regime_sentences(methods: dict[str, dict], trained: bool) -> list[str]:
    """Per token count of ``REGIME_TOKENS`` measured in 02: the least memory and the fastest among
    the methods that may be recommended, what is lighter or faster but may not be, and the cost in
    memory of the fastest."""
    from helpers.compare.units import format_bytes

    out = []
    for N in REGIME_TOKENS:
        here = {}
        dtype = None
        for m, f in methods.items():
            d, pts = _points(f)
            p = pts.get(N)
            if p and p.get("status") == "ok" and p.get("peak_bytes") is not None:
                here[m], dtype = p, d
        if not here:
            continue
        ok = {m: p for m, p in here.items() if why_not_recommended(m, methods[m], dtype, trained) is None}
        peaks = {m: p["peak_bytes"] for m, p in here.items()}
        times = {m: p["seconds"] for m, p in here.items() if p.get("seconds")}
        head = f"At {N:,} tokens ({dtype}, loss forward and backward)"
        if not ok:
            lightest, fastest = least(peaks, MEMORY_TIE), least(times, SPEED_TIE)
            out.append(f"{head}: nothing is recommended, because no method that ran has every verdict it needs "
                       f"({'; '.join(f'{method_label(m)}: {why_not_recommended(m, methods[m], dtype, trained)}' for m in here)}). "
                       f"Measured: least memory {_names(lightest)}, {format_bytes(peaks[lightest[0]])}; fastest "
                       f"{_names(fastest)}, {_ms(times[fastest[0]])}.")
            continue
        ok_peaks = {m: peaks[m] for m in ok}
        lightest = least(ok_peaks, MEMORY_TIE)
        low = ok_peaks[lightest[0]]
        efficient = {m: times[m] for m in ok if m in times and peaks[m] <= NEAR_LEAST_MEMORY * low}
        fast_efficient = least(efficient, SPEED_TIE)
        fastest = least({m: times[m] for m in ok if m in times}, SPEED_TIE)
        parts = [f"least memory: {_names(lightest)}, {format_bytes(low)}"]
        if fast_efficient:
            t = efficient[fast_efficient[0]]
            others = sorted((m for m in efficient if m not in fast_efficient), key=efficient.get)
            parts.append(f"fastest at near-least memory (within {NEAR_LEAST_MEMORY:g}x): {_names(fast_efficient)}, "
                         f"{_ms(t)}" + (f" ({', '.join(f'{method_label(m)} {_ms(efficient[m])}' for m in others)})" if others else ""))
        if fastest and fastest[0] not in efficient:
            f0 = fastest[0]
            parts.append(f"fastest overall: {_names(fastest)}, {_ms(times[f0])} at {format_bytes(peaks[f0])}, "
                         f"{peaks[f0] / low:,.1f}x the least memory")
        sentence = f"{head}: " + "; ".join(parts) + "."
        lighter = [m for m in here if m not in ok and peaks[m] < low * (1 - MEMORY_TIE)]
        if lighter:
            sentence += " Lighter, but not recommended: " + "; ".join(
                f"{method_label(m)} {format_bytes(peaks[m])} ({why_not_recommended(m, methods[m], dtype, trained)})"
                for m in lighter) + "."
        out.append(sentence)
    return out + crossovers(methods, trained)


def crossovers(methods: dict[str, dict], trained: bool) -> list[str]:
    """Where one recommendable method overtakes another as the token count grows, among those at
    near-least memory (within ``NEAR_LEAST_MEMORY`` of the lightest recommendable) at every count."""
    out = []
    series, peaks = {}, {}
    for m, f in methods.items():
        dtype, pts = _points(f)
        if why_not_recommended(m, f, dtype, trained) is None:
            ok = {n: p for n, p in pts.items() if p.get("status") == "ok" and p.get("seconds")}
            series[m] = {n: p["seconds"] for n, p in ok.items()}
            peaks[m] = {n: p["peak_bytes"] for n, p in ok.items()}
    lowest = {}
    for m in peaks:
        for n, p in peaks[m].items():
            lowest[n] = min(lowest.get(n, p), p)
    series = {m: s for m, s in series.items() if all(peaks[m][n] <= NEAR_LEAST_MEMORY * lowest[n] for n in s)}
    names = sorted(series)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common = sorted(set(series[a]) & set(series[b]))
            if len(common) < 2:
                continue
            # who is faster, beyond a tie, at each token count
            lead = [(n, series[a][n] / series[b][n]) for n in common]
            faster = [(n, a if r < 1 - SPEED_TIE else b if r > 1 + SPEED_TIE else None) for n, r in lead]
            winners = [w for _, w in faster if w]
            if len(set(winners)) < 2:
                continue
            first, last = winners[0], winners[-1]
            if first == last:
                continue
            from_n = next(n for n, w in faster if w == last and all(w2 in (last, None) for n2, w2 in faster if n2 >= n))
            loser = first
            out.append(f"{method_label(last)} is faster than {method_label(loser)} from {from_n:,} tokens "
                       f"({_ms(series[last][from_n])} against {_ms(series[loser][from_n])}); "
                       f"{method_label(loser)} is faster below.")
    return out


def budget_sentences(methods: dict[str, dict]) -> list[str]:
    """What ours' memory budgets bought in 02 (``budgets`` of its facts), per token count of
    ``REGIME_TOKENS``: each budget that ran another schedule than ours as it ships (its default budget,
    "min", 1 GiB on a T4; a peak more than ``MEMORY_TIE`` above it) and passed the gate, its time and peak
    beside the default's and the fastest other method's. Said as measured, not recommended: notebook 03
    trains ours with its default budget only."""
    from helpers.compare.units import format_bytes

    ours = next((m for m, f in methods.items() if f.get("budgets")), None)
    if ours is None:
        return []
    out = []
    _, own = _points(methods[ours])
    for N in REGIME_TOKENS:
        base = own.get(N)
        if not base or base.get("status") != "ok" or not base.get("seconds"):
            continue
        runs, dtype = [], None
        for budget, fact in methods[ours]["budgets"].items():
            p = fact["points"].get(str(N)) or fact["points"].get(N)
            if (p and p.get("status") == "ok" and p.get("seconds") and fact.get("gate") == "pass"
                    and p["peak_bytes"] > base["peak_bytes"] * (1 + MEMORY_TIE)):
                runs.append((budget, p))
                dtype = fact.get("dtype")
        if not runs:
            continue
        others = {}
        for m, f in methods.items():
            p = _points(f)[1].get(N)
            if m != ours and p and p.get("status") == "ok" and p.get("seconds"):
                others[m] = p
        fastest = min(others, key=lambda m: others[m]["seconds"]) if others else None
        said = "; ".join(f"{method_label(b)} {_ms(p['seconds'])} at {format_bytes(p['peak_bytes'])}" for b, p in runs)
        against = (f", and {method_label(fastest)}'s {_ms(others[fastest]['seconds'])} at "
                   f"{format_bytes(others[fastest]['peak_bytes'])}" if fastest else "")
        out.append(f"Given memory, at {N:,} tokens ({dtype}, 02): {said}; against its default "
                   f"{_ms(base['seconds'])} at {format_bytes(base['peak_bytes'])}{against}. The budgets pass 02's "
                   "gate; notebook 03 trains ours with its default budget only.")
    return out


def whole_step_sentence(methods: dict[str, dict]) -> str | None:
    """05's finding as a headline: how far apart the fused losses' whole-step peaks and speeds are."""
    from helpers.compare.units import format_bytes

    steps = {m: f["whole_step"] for m, f in methods.items() if (f.get("whole_step") or {}).get("peak_bytes")}
    fused = {m: s for m, s in steps.items() if m != "naive"}
    if len(fused) < 2:
        return None
    peaks = {m: s["peak_bytes"] for m, s in fused.items()}
    speeds = {m: s["tokens_per_s"] for m, s in fused.items()}
    low, high = min(peaks.values()), max(peaks.values())
    tokens = next(iter(fused.values()))["tokens"]
    default = steps.get("naive", {}).get("peak_bytes")
    against = f", against {format_bytes(default)} for transformers' default loss" if default else ""
    spread = f"{min(speeds.values()):,.0f} to {max(speeds.values()):,.0f} tokens/s"
    if high <= low * (1 + MEMORY_TIE):
        return (f"In a whole training step at {tokens:,} tokens (05), {_names(list(fused))} peak within "
                f"{(high / low - 1):.1%} of each other ({format_bytes(low)}{against}) and run at {spread}: once the "
                "logits are gone, the loss no longer decides a step's memory; choose on accuracy, speed and features.")
    order = sorted(peaks, key=peaks.get)
    return (f"In a whole training step at {tokens:,} tokens (05): " + ", ".join(
        f"{method_label(m)} {format_bytes(peaks[m])} at {speeds[m]:,.0f} tokens/s" for m in order) + f"{against}.")


def recommend(methods: dict[str, dict], ran: list[str], *, t4: bool) -> list[str]:
    """The REPORT's "use X when" sentences, each from the facts of the notebooks that ran (``ran``:
    their names); a deciding measurement that did not run is said, and nothing is recommended on it.
    ``t4``: the run is a T4's (or a pretend T4's)."""
    from helpers.compare.units import format_bytes

    trained = "03_convergence" in ran
    missing = [EVIDENCE[n] for n in EVIDENCE if n not in ran]
    out = []
    if missing:
        out.append("Not measured in this run: " + "; ".join(missing) + ". What needs them is not recommended below.")
    if step := whole_step_sentence(methods):
        out.append(step)
    out += regime_sentences(methods, trained)
    out += budget_sentences(methods)
    if t4:
        on_t4 = {m: f for m, f in methods.items() if f.get("runs_on_t4") is True and isinstance(f.get("t4_peak_bytes_16k"), int)}
        fit = {m: f for m, f in on_t4.items() if why_not_recommended(m, f, "float16", trained) is None}
        if not trained:
            out.append("On a T4 (fp16): no recommendation, because notebook 03 (does each loss train like exact in "
                       "fp16?) did not run in this run.")
        elif fit:
            lightest = least({m: f["t4_peak_bytes_16k"] for m, f in fit.items()}, MEMORY_TIE)
            out.append(f"On a T4 (fp16), at 16,384 tokens: {_names(lightest)}, "
                       f"{format_bytes(fit[lightest[0]]['t4_peak_bytes_16k'])}, the least memory among the losses "
                       "that run there, pass the fp16 gate and train like exact in fp16.")
        cannot = [f"{method_label(m)} ({f['runs_on_t4']})" for m, f in methods.items() if isinstance(f.get("runs_on_t4"), str)]
        if cannot:
            out.append("Cannot run on a T4: " + "; ".join(cannot) + ".")
    out += whole_step_fit_sentences(methods)
    for m, f in methods.items():
        failing = [d for d, v in f.get("gradients", {}).items() if v == "fail"]
        if failing:
            failures = f.get("gradient_failures", {})
            cases = [c for d in failing for c in failures.get(d, {}).get("failed", [])]
            not_finite = all(failures.get(d, {}).get("not_finite") for d in failing)
            if cases and not_finite and all("mean, ignore all" in c for c in cases):
                # One convention, not a wrong kernel: say what it costs a trainer.
                out.append(f"Avoid {method_label(m)} where a micro-batch can be all padding: its gradients are not "
                           "finite when every target of a mean is ignored, where torch's cross_entropy gives 0, so one "
                           "such micro-batch puts NaN into the weights (01: the float64 gate"
                           + gate_failures_text(failures, failing) + "; every other case it ran passes).")
            else:
                out.append(f"Avoid {method_label(m)} in {', '.join(failing)}: its gradients fail the float64 gate (01)"
                           + gate_failures_text(failures, failing) + ".")
        for dtype, c in f.get("convergence", {}).items():
            if c.get("verdict") in (WORSE, DIFFERENT):
                parts = [Outcome.from_dict(p) for p in c.get("parts", [])]
                why = "; ".join(p.describe() for p in parts if p.verdict != EQUIVALENT)
                out.append(f"Avoid {method_label(m)} for training in {dtype}: it {TRAINS[c['verdict']]} ({why}) (03).")
    return out or ["Too little was measured in this run to recommend a method."]


def largest_step_text(f: dict) -> str:
    """A method's largest whole training step on a 16 GB card (05): "N tokens", "N tokens or more" where the
    search stopped at its limit without meeting the wall, or "not even one sequence" (0)."""
    n = f["largest_step_tokens_16gb"]
    if not n:
        return "not even one sequence"
    more = " or more (the search's limit)" if f.get("largest_step_at_search_limit") else ""
    return f"{n:,} tokens{more}"


def whole_step_fit_sentences(methods: dict) -> list[str]:
    """What notebook 05's search found on a 16 GB card: the losses that fit the most tokens against
    transformers' default ("naive"), and every loss that fit fewer than the default, by name. A count
    the search's limit stopped is a lower bound, said as such; 0 is "not even one sequence"."""
    most = {m: f["largest_step_tokens_16gb"] for m, f in methods.items() if "largest_step_tokens_16gb" in f}
    if not most:
        return []
    where = "Largest whole Qwen3-0.6B training step on a 16 GB card (05)"
    fused = {m: v for m, v in most.items() if m != "naive"}
    default = most.get("naive")
    if not fused:
        return [f"{where}: transformers' default loss, {largest_step_text(methods['naive'])}."]
    if default is not None and all(v == default for v in fused.values()):
        return [f"{where}: every loss that ran fits {largest_step_text(methods['naive'])}, as transformers' default "
                "loss does: at this model's size the loss is not the limit."]
    top = max(fused.values())
    out = []
    if default is None or top >= default:
        best = [m for m, v in fused.items() if v == top]
        ties = " (the search steps coarsely: equal counts are ties)" if len(best) > 1 else ""
        out.append(f"{where}: {_names(best)}, {largest_step_text(methods[best[0]])}"
                   + (f", against {largest_step_text(methods['naive'])} with transformers' default loss" if default
                      is not None else "") + f"{ties}.")
    else:
        out.append(f"{where}: transformers' default loss fits the most, {largest_step_text(methods['naive'])}.")
    fewer = [m for m, v in fused.items() if default is not None and v < default]
    if fewer:
        out.append("Fit fewer tokens than transformers' default loss (05): "
                   + "; ".join(f"{method_label(m)}, {largest_step_text(methods[m])}" for m in fewer) + ".")
    return out


def gate_failures_text(failures: dict, dtypes: list[str]) -> str:
    """Which of the gate's cases failed, per dtype (" in 1 of 12 cases (float32: [N=37 ... ignore all])"),
    so that a reader can tell one degenerate case from a wrong kernel; "" where the facts predate it."""
    known = [failures[d] for d in dtypes if d in failures]
    if not known:
        return ""
    failed = sum(len(k["failed"]) for k in known)
    cases = sum(k["cases"] for k in known)
    named = "; ".join(f"{d}: " + " ".join(f"[{c}]" for c in failures[d]["failed"]) for d in dtypes if d in failures)
    return f" in {failed} of {cases} cases ({named})"


__all__ = [
    "GATE_FLOOR", "SLACK", "WHOLE_MODEL_GRADIENT_BOUND", "PRETRAIN_MARGIN_FLOOR_NATS", "PRETRAIN_MARGIN_SEED_SHARE", "SPEED_TIE", "MEMORY_TIE",
    "EQUIVALENT", "BETTER", "WORSE", "DIFFERENT", "UNDECIDED", "TRAINS", "TRAINS_WELL",
    "gate_bound", "gate_case_status", "gate_verdict", "finetune_bound", "pretrain_margin", "margins_text",
    "signed", "t_quantile", "largest_step_text", "whole_step_fit_sentences", "gate_failures_text", "Outcome", "pretrain_outcome", "finetune_outcome", "combine", "convergence_fact",
    "trains_phrase", "part_phrase", "convergence_cell", "first_steps_agree", "least", "REGIME_TOKENS", "training_verdict",
    "why_not_recommended", "regime_sentences", "crossovers", "whole_step_sentence", "recommend",
]
