"""Figures of notebook 03 (convergence A/B). Each function draws one figure and returns it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .training import TrainRun


def plot_rank_frequency(counts, vocab_size: int):
    """Training count of every type by rank, log-log: the long tail the pretraining A/B is about.
    ``counts`` holds every distinct training type's count; the vocabulary keeps the first
    ``vocab_size - 1`` ranks."""
    counts = np.sort(np.asarray(counts))[::-1]
    rank = np.arange(1, counts.size + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(rank, counts, lw=1.5)
    ax.axvline(vocab_size - 1, color="red", lw=1, label=f"vocabulary cap ({vocab_size:,} ids with <unk>)")
    ax.set(xlabel="rank of the type", ylabel="occurrences in the training split",
           title="The corpus's long tail (Zipf)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_finetune_ab(runs: dict[str, TrainRun], labels: dict[str, str], tolerance: float, baseline: str = "exact"):
    """Left: every arm's training loss per step, overlaid. Right: its relative difference from the
    baseline at each step, with the tolerance the verdict uses."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    reference = np.asarray(runs[baseline].train_loss)
    steps = np.arange(1, reference.size + 1)
    for i, (name, run) in enumerate(runs.items()):
        loss = np.asarray(run.train_loss)
        style = dict(lw=2.5, color="black") if name == baseline else dict(lw=1.2, ls=("--", ":", "-.")[i % 3])
        left.plot(steps, loss, label=labels.get(name, name), **style)
        if name != baseline:
            right.plot(steps, np.abs(loss - reference) / np.abs(reference), label=labels.get(name, name), **style)
    right.axhline(tolerance, color="red", lw=1, label=f"tolerance {tolerance:g}")
    right.set_yscale("symlog", linthresh=1e-8)
    left.set(xlabel="step", ylabel="training loss (nats)", title="Fine-tuning: loss per step")
    right.set(xlabel="step", ylabel="|loss − exact| / exact", title="Fine-tuning: drift from exact")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_pretrain_curves(runs: dict[str, list[TrainRun]], labels: dict[str, str], baseline: str = "exact"):
    """Left: validation loss per arm, mean over seeds with a min-max band. Right: each arm minus
    the baseline, paired by seed (mean and min-max band), against the baseline's own seed spread."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    base = np.array([r.val_loss for r in runs[baseline]])  # (seeds, evals)
    for i, (name, arm_runs) in enumerate(runs.items()):
        steps = np.asarray(arm_runs[0].eval_steps)
        val = np.array([r.val_loss for r in arm_runs])
        # distinct dashes: arms that agree draw on top of each other and must stay visible
        line = left.plot(steps, val.mean(0), ls=("-", "--", ":", "-.")[i % 4],
                         label=f"{labels.get(name, name)} ({len(arm_runs)} seeds)")[0]
        left.fill_between(steps, val.min(0), val.max(0), color=line.get_color(), alpha=0.2)
        if name == baseline:
            spread = val.std(0, ddof=1) if len(arm_runs) > 1 else np.zeros_like(steps, dtype=float)
            right.fill_between(steps, -2 * spread, 2 * spread, color="grey", alpha=0.25, label="±2 seed std of exact")
        else:
            diff = val - base
            right.plot(steps, diff.mean(0), color=line.get_color(), label=labels.get(name, name))
            right.fill_between(steps, diff.min(0), diff.max(0), color=line.get_color(), alpha=0.2)
    right.axhline(0, color="black", lw=0.8)
    left.set(xlabel="step", ylabel="validation loss (nats, exact fp32)", title="Pretraining: validation loss")
    right.set(xlabel="step", ylabel="Δ validation loss vs exact (nats)", title="Pretraining: difference, paired by seed")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_rare_token_diagnostic(diagnostic: dict, bin_labels: list[str], labels: dict[str, str]):
    """Per training-frequency bin, for each arm (mean over seeds, min-max bars): validation loss,
    drift of the classifier rows from their initialisation, and the fraction of steps on which
    those rows received any gradient. ``diagnostic[arm][quantity]`` is (seeds, bins)."""
    panels = [
        ("val_loss", "validation loss (nats)"),
        ("row_drift", "‖C_v − C_v(init)‖, mean over the bin"),
        ("grad_step_fraction", "steps with a nonzero dC row"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(bin_labels))
    width = 0.8 / max(1, len(diagnostic))
    for i, (name, quantities) in enumerate(diagnostic.items()):
        for ax, (key, ylabel) in zip(axes, panels):
            values = np.array(quantities[key], dtype=float)  # (seeds, bins)
            mean = values.mean(0)
            err = np.stack([mean - values.min(0), values.max(0) - mean])
            ax.bar(x + (i - (len(diagnostic) - 1) / 2) * width, mean, width, yerr=err, capsize=2,
                   label=labels.get(name, name))
            ax.set(ylabel=ylabel)
    for ax in axes:
        ax.set_xticks(x, bin_labels, rotation=20)
        ax.set_xlabel("times the token occurs in the training split")
    axes[0].set_title("Loss on validation tokens, by frequency")
    axes[1].set_title("How far each classifier row moved")
    axes[2].set_title("How often each row got a gradient")
    axes[2].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
