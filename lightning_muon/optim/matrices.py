r"""Which matrices a Muon parameter holds: its stored orientation, fused pieces and experts.

A Muon parameter of stored shape :math:`(\dots, a, b)` is a batch of logical matrices :math:`(m, n)` = (outputs,
inputs), each orthogonalized (NS5) and row-normalized on its own:

- ``transposed=False``: ``nn.Linear`` stores :math:`W \in \mathbb{R}^{out \times in}`; ``transposed=True``:
  transformers' ``Conv1D`` (GPT-2) stores :math:`W^\top \in \mathbb{R}^{in \times out}`.
- leading dimensions: a mixture-of-experts weight :math:`(E, out, in)` is :math:`E` matrices, one per expert.
- ``pieces`` :math:`P`: the output dimension stacks :math:`P` equal blocks (a fused QKV projection: 3; per head:
  3·heads), each its own matrix :math:`(out/P, in)`.

NS5 and the oriented RowNorm commute with transposition, so the layout changes three things only: the shape factor
:math:`s(m, n)` of the logical piece, the axis RowNorm sums over (for square matrices, and within pieces), and the
blocks NS5 sees. FSDP2 shards stored dim 0 whatever it means (a ``Conv1D``'s inputs, an MoE weight's experts); the
optimizer all-reduces RowNorm's partial sums exactly when that axis is the one it sums over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["MatrixLayout"]


@dataclass(frozen=True)
class MatrixLayout:
    """How a stored Muon parameter maps to logical ``(out, in)`` matrices (the module docstring)."""

    transposed: bool = False
    pieces: int = 1

    @classmethod
    def of(cls, group: dict) -> MatrixLayout:
        """The layout a Muon param group declares (``transposed``, ``pieces``)."""
        return cls(group.get("transposed", False), group.get("pieces", 1))

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(m, n)`` of one logical matrix (one piece of one expert)."""
        out, inp = (shape[-1], shape[-2]) if self.transposed else (shape[-2], shape[-1])
        return out // self.pieces, inp

    def count(self, shape: Sequence[int]) -> int:
        """How many logical matrices a parameter of ``shape`` holds."""
        return math.prod(shape[:-2]) * self.pieces

    def rows(self, shape: Sequence[int]) -> int:
        """How many vectors RowNorm normalizes: :math:`\\min(m, n)` per matrix."""
        return self.count(shape) * min(self.matrix_shape(shape))

    def reduce_dim(self, shape: Sequence[int]) -> int:
        """The stored axis RowNorm sums over: the logical inputs when :math:`m \\le n` (rows of each piece), else the
        logical outputs (columns; :meth:`check` allows that only for a whole, unpieced output dimension)."""
        m, n = self.matrix_shape(shape)
        inputs, outputs = (-2, -1) if self.transposed else (-1, -2)
        return inputs if m <= n else outputs

    def check(self, shape: Sequence[int]) -> str | None:
        """What is wrong with this layout for a matrix or stack of matrices of ``shape`` (None: it fits)."""
        if isinstance(self.pieces, bool) or not isinstance(self.pieces, int) or self.pieces < 1:
            return f"has pieces={self.pieces!r}; expected an integer >= 1"
        out = shape[-1] if self.transposed else shape[-2]
        if out % self.pieces:
            return f"has {out} outputs, not divisible into pieces={self.pieces}"
        m, n = self.matrix_shape(shape)
        if self.pieces > 1 and m > n:
            return (
                f"would be split into {self.pieces} pieces of shape {(m, n)}, taller than wide: RowNorm of such a "
                "piece sums along the fused output axis; use pieces=1 for it"
            )
        return None

    def matrices(self, x: Tensor) -> Tensor:
        """The logical matrices of a full (unsharded) tensor shaped like the parameter, ``(count, m, n)``: a view when
        the layout is the identity, else a copy."""
        m, n = self.matrix_shape(x.shape)
        if self.transposed:
            x = x.mT
        return x.reshape(self.count(x.shape), m, n)

    def restore(self, matrices: Tensor, shape: Sequence[int]) -> Tensor:
        """The inverse of :meth:`matrices`: a tensor of the stored ``shape``."""
        if not self.transposed:
            return matrices.reshape(shape)
        return matrices.reshape(*shape[:-2], shape[-1], shape[-2]).mT
