"""What one entry of the method registry is (``helpers.compare.methods``): a loss with the
registry's one signature, where it can run, what it can take, and its memory theory.

``Method`` is the entry; ``MethodUnavailable`` what calling one where it cannot run raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from helpers.compare.units import dtype_bytes
from helpers.spec import validate_inputs


class MethodUnavailable(RuntimeError):
    """Raised when a method is called where it cannot run; the message says why."""


Reason = str | None  # None: the method can run; otherwise a sentence saying why not
# (N, V, D, bytes per element of E and C, CUDA compute capability or None for the CPU, **the options
# of the loss that change its memory, as the loss names them) -> bytes
PeakFormula = Callable[..., int]


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # short, for tables and legends
    summary: str  # one sentence: what it is and how it saves (or spends) memory
    implementation: Callable[..., torch.Tensor]
    availability: Callable[[torch.device, torch.dtype, float | None], Reason]
    kind: str = "baseline"  # "ours", "peer" (another project's kernel) or "baseline"
    notes: str = ""
    preset_of: str | None = None  # the method this one is a preset of (other options, same code)
    counts_skips: bool = False  # takes stats=, which its backward fills with the tiles it skipped
    supports_bias: bool = False  # takes bias= (V,), added to the logits; without it a bias is refused
    # Its memory theory (helpers.compare.theory): bytes above the inputs E, C, x at the peak of one
    # forward+backward, from (N, V, D, bytes per element, CUDA capability or None for the CPU) and
    # the loss's options that change it (PeakFormula), and the formula in words. None: no formula (compared with the floor dE + dC instead).
    peak_bytes: PeakFormula | None = None
    peak_formula: str = ""
    # Calls per gate case on the same leaf tensors, the last one's result gated: a method whose repeated
    # call runs another path (ours with the backward's CUDA graphs replays from the third) is gated on it.
    gate_calls: int = 1

    def predicted_peak_bytes(self, N: int, V: int, D: int, dtype: torch.dtype | str,
                             capability: tuple[int, int] | None = None, **options) -> int | None:
        """Peak bytes above the inputs one forward+backward should need (None: no formula here).
        ``capability``: the CUDA compute capability whose code path runs (None: the CPU's);
        ``options``: the loss's own options that change its memory (chunked's ``rows``, ours'
        ``configs``), None or left out for its defaults."""
        if self.peak_bytes is None:
            return None
        return int(self.peak_bytes(N, V, D, dtype_bytes(dtype), tuple(capability) if capability else None,
                                   **options))

    def why_unavailable(
        self, device: torch.device | str, dtype: torch.dtype, softcap: float | None = None
    ) -> Reason:
        return self.availability(torch.device(device), dtype, softcap)

    def __call__(
        self,
        E: torch.Tensor,
        C: torch.Tensor,
        x: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        softcap: float | None = None,
        stats: dict | None = None,
        check_targets: bool = True,
    ) -> torch.Tensor:
        """The loss; ``bias``, for a method that ``supports_bias`` (others refuse one); ``stats``, for a
        method that ``counts_skips``, is filled by its backward with what its gradient filter skipped
        (other methods leave it empty). ``check_targets``: x's range checked here, a read of the device
        (a sync: the host waits for all work queued before); False for a caller that checked these
        targets already (``helpers.compare.measure.loss_step``: a timed call must not wait)."""
        validate_inputs(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap, bias=bias,
                        check_targets=check_targets)
        reason = self.why_unavailable(E.device, E.dtype, softcap)
        if bias is not None and not self.supports_bias:
            reason = reason or f"{self.label} takes no bias"
        if reason:
            raise MethodUnavailable(f"{self.name}: {reason}")
        extra = {"stats": stats} if self.counts_skips else {}
        if self.supports_bias:
            extra["bias"] = bias
        return self.implementation(E, C, x, ignore_index=ignore_index, reduction=reduction, softcap=softcap, **extra)


__all__ = ["Method", "MethodUnavailable", "PeakFormula", "Reason"]
