"""The model heads the suite measures at: one table, used wherever a head's V and D are needed.

A head is the last layer of a language model, the classifier C (V, D) that the loss multiplies
with the hidden states E (N, D). Its V and D are what a loss's memory and time depend on; the
rest of the model does not matter to the loss. Shapes from the models' published configs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Head:
    name: str  # the key used on command lines and in results files
    label: str  # how a person reads it
    V: int  # vocabulary size
    D: int  # hidden size


HEADS = {
    "qwen3-0.6b": Head("qwen3-0.6b", "Qwen3-0.6B", 151_936, 1_024),  # the seed article's model
    "gemma2-2b": Head("gemma2-2b", "Gemma-2-2B", 256_000, 2_304),
}
QWEN3 = HEADS["qwen3-0.6b"]
GEMMA2 = HEADS["gemma2-2b"]

__all__ = ["Head", "HEADS", "QWEN3", "GEMMA2"]
