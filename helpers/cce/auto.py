"""``backward_impl="auto"`` (the default): the "sparse" backward where it pays, "gemm" elsewhere,
decided from what the last calls of the same problem saw.

Why a memory. The "sparse" backward computes only the (row, tile) pairs that the forward's activity
bits mark, and pays when they are few: on an H200 at the Gemma-2-2B head it took 33.6 ms for a step
with 8.9% of the pairs marked (the ``realistic`` regime) and 45.5 ms with 15.2% (``trained``), where
"gemm" takes 58-59. But the bits are made by the forward, before anyone knows how many there will
be, and the sorted forward that makes them takes 12-20% longer than the plain one (Gemma 16.2 ms
against 14.5; Qwen3 head, 16,384 tokens, 10.6 against 8.8). On a flat softmax they mark every pair,
the backward hands over to "gemm", and the bits were made for nothing: 62.7 ms against 59.5 at the
Gemma head (``uniform``), 39.3 against 36.3 at the Qwen3 head with 16,384 tokens
(docs/measurements/h200-2026-12-01g). Whether bits pay is a property of the model's softmax,
which moves slowly over training (flat at initialisation, peaked later): the last decision for the
same problem is a good guess for the next call.

The rule, per problem (``helpers.cce.options.problem_key``: device, dtype, V, D, N rounded up to a
power of two, the tier, and the options the bits depend on):

- nothing seen yet: *probe*, i.e. run "sparse": the forward makes bits, and the backward decides
  as it always does (it hands over to "gemm" past the tier's ``dense_fallback`` of marked pairs);
  its decision is remembered;
- last decision "sparse": run "sparse" again; each of these backwards decides afresh and is
  remembered, so a softmax that flattens is seen on the next call;
- last decision "gemm": run "gemm", with no bits, until ``HostTuning.auto_probe_calls`` calls have
  passed since that decision or since the last probe, then probe again. A softmax that sharpens is
  seen within that many calls; on a flat one a probe costs one forward with bits per that many
  calls (5-8% of one step, 0.2-0.3% over 32). A probe whose backward never runs (a forward with grad
  enabled, then no backward) leaves the decision as it was and restarts the count.

Problems where "sparse" cannot run (the filter off, options that need every pair, too few pairs for
its index, no gradient wanted) get "gemm" from the plan, with no probe and nothing remembered.

So consecutive calls may run different backwards, with different filters: "sparse" drops at most
B of a row's |G| mass (eps = B / T per tile, B = 2^-7 bf16, 2^-10 fp16), "gemm" its eps per 256
columns (2^-12 bf16, 2^-15 fp16, lower past 8,192 classes: at most B of a row's mass too), both within
the accuracy gate. Every backward "auto" runs is the one
asked for by name: a remembered "gemm" is ``backward_impl="gemm"``'s to the bit, a probe's hand-over
to "gemm" too but for the lse, which the sorted forward with bits sums in another order. Code that
needs the same backward on every call passes "gemm" or "sparse". ``stats["backward"]`` says which
ran and ``stats["auto"]`` why.

The record is per process, a few numbers per problem in host memory, behind a lock;
``forget_backward_choices`` clears it (tests, and a benchmark point that should not inherit another
softmax's decision).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoChoice:
    """What "auto" chose for one call and why (``stats["auto"]``). ``key`` None: the plan decided
    alone ("sparse" cannot run), nothing is remembered."""

    backward: str  # "sparse" (a probe, or remembered) or "gemm"
    why: str
    key: tuple | None = None
    call: int = 0  # this call's number among the problem's calls


@dataclass
class _Seen:
    calls: int = 0  # the problem's calls so far
    backward: str | None = None  # what the last sparse backward decided: "sparse" or "gemm"; None: none yet
    density: float | None = None  # the share of pairs its bits marked (None: it decided before counting)
    reason: str | None = None  # why it handed over to "gemm"
    at: int = 0  # the call whose backward decided
    since: int = 0  # the call since which "gemm" is remembered: the decision's, or the last probe's


class BackwardRecord:
    """The per-process memory of "auto": per problem, the last decision of a sparse backward."""

    def __init__(self):
        self._seen: dict[tuple, _Seen] = {}
        self._lock = threading.Lock()

    def choose(self, key: tuple, probe_calls: int) -> AutoChoice:
        """The backward this call of problem ``key`` runs (module doc); ``probe_calls``:
        ``HostTuning.auto_probe_calls``."""
        with self._lock:
            seen = self._seen.setdefault(key, _Seen())
            seen.calls += 1
            call = seen.calls
            if seen.backward is None:
                seen.since = call
                return AutoChoice("sparse", "probe: nothing seen yet for this problem", key, call)
            if seen.backward == "sparse":
                return AutoChoice("sparse", f"remembered: {seen.density:.1%} of the pairs marked at call {seen.at}",
                                  key, call)
            if call - seen.since >= probe_calls:
                why = f"probe: 'gemm' since call {seen.at} ({seen.reason}), {call - seen.since} calls ago"
                seen.since = call
                return AutoChoice("sparse", why, key, call)
            return AutoChoice("gemm", f"remembered: {seen.reason} at call {seen.at}", key, call)

    def observe(self, choice: AutoChoice, density: float | None, reason: str | None) -> None:
        """What the sparse backward of ``choice``'s call decided: ``reason`` why it handed over to
        "gemm" (None: it ran), ``density`` the share of pairs its bits marked."""
        if choice.key is None:
            return
        with self._lock:
            seen = self._seen.setdefault(choice.key, _Seen(calls=choice.call))
            seen.backward = "sparse" if reason is None else "gemm"
            seen.density, seen.reason, seen.at = density, reason, choice.call
            seen.since = max(seen.since, choice.call)

    def forget(self) -> None:
        with self._lock:
            self._seen.clear()


RECORD = BackwardRecord()


def forget_backward_choices() -> None:
    """Clear what "auto" remembers: the next call of every problem probes."""
    RECORD.forget()
