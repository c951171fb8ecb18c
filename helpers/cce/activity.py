"""What the forward tells the "sparse" backward: which (row, vocabulary tile) pairs may carry gradient.

``Activity`` holds one bit per (row, tile of ``block_v`` vocabulary positions), packed 8 tiles to a
byte as ``bits`` (ceil(T / 8), N) uint8 (byte-major, so a byte of 128 rows is one coalesced store),
the vocabulary order the forward walked (tiles are tiles of sorted positions when there is one), and
the eps the bits were computed for. A bit is 1 whenever the pair's softmax mass may be >= eps /
coef_max (see ``helpers/cce/kernels/lse_forward.py``: the forward compares against a lower bound of
the row's sum, so the bits over-mark and never miss). The backward decides from the bits alone which
work to skip, and applies the exact rule to what it computes.

Why eps / coef_max. The filter judges G = a S - b [v = x] (``helpers.cce.backward.rows.RowGradient``):
outside the target's tile a row's |G| mass (taken before the soft cap's derivative,
``helpers/cce/kernels/gradient_tile.py``) is |a| times its softmax mass, so bits made at eps / coef_max
miss no tile the rule keeps while |a| <= coef_max. With
g the loss's upstream gradient and h the lse's, a = (g (1 + 2 zl lse) + h) / max(|g|, |h|), so
|a| <= |1 + 2 zl lse| + [h != 0]. The forward knows neither lse nor h yet: ``coef_bound`` assumes
|1 + 2 zl lse| <= 2 under z-loss (1 without) and adds 1 when the lse is returned to the caller (a
gradient may flow into it); the backward checks every row's |a| against it and runs "gemm" past it.

Memory: N * ceil(V / block_v / 8) bytes: 2.0 MB at the Gemma-2-2B head (N = 8,192, V = 256,000,
128-column tiles), 19.5 MB at the Qwen3 head with N = 131,072 (0.034 LB), plus the order (V int64).

This module also holds the host-side bit arithmetic both sides share: marked tiles per row, and the
fix-up that marks a pair; the list of marked pairs is built on the device (``helpers.cce.backward.pair_index``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Activity:
    bits: torch.Tensor  # (ceil(T / 8), N) uint8: bit t % 8 of byte t // 8 is tile t of each row
    block_v: int  # vocabulary positions per tile
    vocab: int  # V
    order: torch.Tensor | None  # (V,) int64: C's row at each sorted position; None: unsorted
    eps: float  # the filter's threshold the bits were computed for (before the coef_max margin)
    pilot: int = 0  # vocabulary positions walked first, in one split, to seed the others (sorted)
    coef_max: float = 1.0  # the largest |a| the bits hold for: they compared S's mass with eps / coef_max

    @property
    def tiles(self) -> int:
        return -(-self.vocab // self.block_v)

    def nbytes(self) -> int:
        return self.bits.numel() + (self.order.numel() * self.order.element_size() if self.order is not None else 0)


def coef_bound(z_loss: float, return_lse: bool) -> float:
    """The |a| the forward's bits are made for (module doc): 1, plus 1 under z-loss, plus 1 when a
    gradient may flow into the lse."""
    return 1.0 + (1.0 if z_loss else 0.0) + (1.0 if return_lse else 0.0)


# ``live`` below: (N,) bool or None, the rows whose bits count (the others carry no gradient in this
# backward: their bits stay as the forward left them, for a later backward through the same graph).


def popcount_rows(bits: torch.Tensor, live: torch.Tensor | None = None, *, count_rows: int) -> torch.Tensor:
    """(N,) int64: marked tiles of each row (0 where not ``live``), by SWAR popcount of the bytes
    (no N x T temporary), ``count_rows`` rows at a time (``HostTuning.count_rows``: torch casts the
    bytes it sums to int64 whole)."""
    counts = torch.empty(bits.shape[1], dtype=torch.int64, device=bits.device)
    for n0 in range(0, bits.shape[1], count_rows):
        b = bits[:, n0:n0 + count_rows]
        b = b - ((b >> 1) & 0x55)
        b = (b & 0x33) + ((b >> 2) & 0x33)
        b = (b + (b >> 4)) & 0x0F
        torch.sum(b, dim=0, dtype=torch.int64, out=counts[n0:n0 + count_rows])
    return counts if live is None else counts * live


def set_bits(bits: torch.Tensor, tiles: torch.Tensor, mark: torch.Tensor) -> None:
    """Mark tile tiles[r] of every row r where ``mark`` ((N,) bool) holds; no host sync."""
    rows = torch.arange(tiles.numel(), device=bits.device)
    byte = tiles // 8
    bits[byte, rows] = bits[byte, rows] | ((1 << (tiles % 8)) * mark).to(torch.uint8)
