"""Matrix kernels of Muon: quintic Newton–Schulz orthogonalization, oriented RowNorm and the shape factor."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "default_ns_dtype",
    "newton_schulz",
    "ns_flops",
    "resolve_ns_coefficients",
    "row_norm",
    "shape_factor",
]

#: Keller Jordan's quintic coefficients (a, b, c), also torch.optim.Muon's defaults.
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
ADJUST_LR_CHOICES = ("original", "match_rms_adamw")

Coefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]]


def resolve_ns_coefficients(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    """One (a, b, c) triple per iteration: a single triple is repeated ``steps`` times.

    Raises:
        ValueError: if ``steps < 1`` or a sequence of triples does not have exactly ``steps`` entries.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Newton-Schulz steps must be a positive integer, got {steps!r}.")
    coefficients = tuple(coefficients)
    if len(coefficients) == 3 and all(isinstance(c, (int, float)) for c in coefficients):
        return [tuple(float(c) for c in coefficients)] * steps
    triples = [tuple(float(c) for c in triple) for triple in coefficients]
    if any(len(t) != 3 for t in triples):
        raise ValueError(f"Newton-Schulz coefficients must be (a, b, c) or a sequence of triples, got {coefficients}.")
    if len(triples) != steps:
        raise ValueError(
            f"Got {len(triples)} Newton-Schulz coefficient triples for {steps} steps; pass one triple per step "
            "or set ns_steps to the number of triples."
        )
    return triples


def newton_schulz(
    X: Tensor,
    steps: int = 5,
    coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    r"""Approximate the polar factor :math:`UV^\top` of each matrix in a ``(..., m, n)`` batch.

    .. math::
        X_0 = X / (\lVert X \rVert_F + \varepsilon), \qquad
        A_k = X_k X_k^\top, \qquad
        X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k

    The Gram matrix is the small side, ``min(m, n)²`` (for ``m > n`` the same recursion on :math:`X^\top`).
    With the default coefficients the singular values land in roughly [0.7, 1.2] (Keller Jordan).

    Args:
        X: matrices, ``(..., m, n)``.
        steps: number of quintic iterations.
        coefficients: one (a, b, c) triple for every step, or a sequence with one triple per step.
        eps: added to the Frobenius norm before normalizing.
        dtype: computation dtype (``None`` keeps ``X.dtype``).

    Returns:
        Tensor of shape ``X.shape`` in ``dtype``.
    """
    if X.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices (..., m, n), got shape {tuple(X.shape)}.")
    batch_shape, (m, n) = X.shape[:-2], X.shape[-2:]
    X = X.to(dtype or X.dtype, copy=True).reshape(-1, m, n)
    return newton_schulz_(X, steps, coefficients, eps).reshape(*batch_shape, m, n)


def newton_schulz_(X: Tensor, steps: int, coefficients: Coefficients, eps: float) -> Tensor:
    """:func:`newton_schulz` on a contiguous ``(B, m, n)`` batch that it may overwrite (normalized in place)."""
    triples = resolve_ns_coefficients(coefficients, steps)
    m, n = X.shape[-2:]
    X.div_(torch.linalg.matrix_norm(X, keepdim=True).add_(eps))
    tall = m > n
    for a, b, c in triples:
        # Tall matrices iterate X <- aX + X(bA + cA²) with A = XᵀX: the transposed recursion written without
        # transposing (A and bA + cA² are symmetric), so every operand stays contiguous.
        A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X


def row_norm(X: Tensor, eps: float = 1e-7) -> Tensor:
    r"""Normalize the ``min(m, n)`` vectors along the longer axis of each ``(..., m, n)`` matrix to unit L2 norm.

    Rows when ``m <= n``, columns when ``m > n`` (RowNorm of the oriented matrix, transposed back), so the result
    has Frobenius norm :math:`\sqrt{\min(m, n)}` like the polar factor. A vector with norm below ``eps`` is divided
    by ``eps`` instead: zero stays zero, nothing becomes NaN.
    """
    if X.ndim < 2:
        raise ValueError(f"row_norm needs matrices (..., m, n), got shape {tuple(X.shape)}.")
    return X / torch.linalg.vector_norm(X, dim=row_norm_dim(X.shape), keepdim=True).clamp_min_(eps)


def row_norm_dim(shape: Sequence[int]) -> int:
    """The axis RowNorm reduces over: -1 (rows are the short side) when m <= n, else -2."""
    return -1 if shape[-2] <= shape[-1] else -2


def rownorm_sumsq(M: Tensor, G: Tensor, beta: float, nesterov: bool, dim: int) -> Tensor:
    r"""Row statistics of a RowNorm step, read-only: :math:`\sum N^2` along ``dim`` (kept) for the update direction
    this step will produce, computed from the *old* momentum so nothing is written before gradients are checked.

    nesterov: :math:`N = \beta M_t + (1-\beta) G = \beta^2 M_{t-1} + (1-\beta^2) G`; else :math:`N = M_t`.
    Non-finite entries of ``G`` make the result non-finite. Sums of squares (not norms) so shards can be added up.
    """
    N = torch.lerp(G, M, beta * beta) if nesterov else torch.lerp(M, G, 1 - beta)
    return N.square_().sum(dim=dim, keepdim=True)  # eager: 7x faster than vector_norm across rows (dim=-2)


def masked_scalar(ok: Tensor, value: float | Tensor, identity: float, like: Tensor) -> Tensor:
    """``value`` where the device verdict ``ok`` holds, else ``identity``: a 0-d tensor in ``like``'s dtype and device
    (rounded as the Python scalar would be), made without a host synchronization."""
    value = value.to(like) if isinstance(value, Tensor) else torch.full((), value, dtype=like.dtype, device=like.device)
    return torch.where(ok, value, identity)


def rownorm_update_(
    W: Tensor,
    M: Tensor,
    G: Tensor,
    sumsq: Tensor,
    beta: float,
    nesterov: bool,
    decay: float | Tensor,
    scale: float | Tensor,
    eps: float,
    ok: Tensor | None = None,
) -> None:
    r"""One RowNorm step in place: :math:`M \leftarrow \beta M + (1-\beta)G`, :math:`N` (written over ``G``),
    :math:`W \leftarrow \text{decay}\cdot W + \text{scale}\cdot N / \max(\sqrt{\text{sumsq}}, \varepsilon)`.

    With a device verdict ``ok`` (False: a non-finite gradient somewhere) every write is an identity: ``G`` is
    replaced by ``M`` (so ``M`` and ``N`` stay finite), the denominator by inf and the decay by 1.
    """
    den = sumsq.sqrt().clamp_min(eps)
    if ok is not None:
        G = torch.where(ok, G, M)
        den = torch.where(ok, den, float("inf"))
        decay = masked_scalar(ok, decay, 1.0, W)
    M.lerp_(G, 1 - beta)
    N = G.lerp_(M, beta) if nesterov else M
    if isinstance(decay, Tensor) or decay != 1.0:
        W.mul_(decay)
    if isinstance(scale, Tensor):
        W.add_(N / den * scale)
    else:
        W.addcdiv_(N, den, value=scale)


@functools.cache
def compiled_rownorm_kernels() -> tuple[Callable[..., Tensor], Callable[..., None]]:
    """:func:`rownorm_sumsq` and :func:`rownorm_update_` compiled by inductor into one pass each (shape-dynamic)."""
    return (
        torch.compile(rownorm_sumsq, dynamic=True, fullgraph=True),
        torch.compile(rownorm_update_, dynamic=True, fullgraph=True),
    )


def shape_factor(shape: Sequence[int], adjust_lr: str = "original") -> float:
    r"""Update scale :math:`s(m, n)` shared by the NS5 and RowNorm branches.

    ``"original"``: :math:`\sqrt{\max(1, m/n)}` (Keller Jordan, torch.optim.Muon);
    ``"match_rms_adamw"``: :math:`0.2\sqrt{\max(m, n)}` (Moonlight), which gives the update AdamW's RMS.
    """
    m, n = shape[-2], shape[-1]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {adjust_lr!r}.")


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """Multiply-add FLOPs of :func:`newton_schulz` on one ``(m, n)`` matrix: per step 2·p²q (Gram), 2·p³ (A²)
    and 2·p²q (product), with p = min(m, n), q = max(m, n)."""
    p, q = sorted((shape[-2], shape[-1]))
    return steps * (4 * p * p * q + 2 * p**3)


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 where bf16 matmul is fast and accurate enough for NS5 (CUDA, CPUs with AVX-512/AMX bf16), else fp32.

    NS5 is self-correcting, so bf16 rounding does not accumulate (Keller Jordan; torch.optim.Muon always uses bf16).
    On the development CPU (AVX-512 + AMX) bf16 matmul runs ~9x faster than fp32; without native bf16 support it is
    emulated and slower than fp32, so fp32 is chosen there.
    """
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        try:
            return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
        except (AttributeError, RuntimeError):
            return torch.float32
    return torch.float32
