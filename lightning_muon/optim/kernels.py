"""Matrix kernels of Muon: quintic Newton–Schulz orthogonalization, oriented RowNorm and the shape factor."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "NS_PRESETS",
    "Orthogonalizer",
    "POLAR_EXPRESS_COEFFICIENTS",
    "default_ns_dtype",
    "gram_ns_flops",
    "make_orthogonalizer",
    "newton_schulz",
    "orthogonalize_batched",
    "refresh_scales",
    "ns_flops",
    "resolve_ns_coefficients",
    "row_norm",
    "shape_factor",
]

#: Keller Jordan's quintic coefficients (a, b, c), also torch.optim.Muon's defaults.
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
# The choices of the string options, as types (the recipe's CLI checks them at parse time) and as tuples: one list.
AdjustLR = Literal["original", "match_rms_adamw", "spectral_unclamped"]
NSMethod = Literal["standard", "gram"]
NSNormalize = Literal["frobenius", "aol"]
NSPreset = Literal["jordan", "polar_express", "turbo_muon"]
AutoScale = Literal["auto", "auto_rms"]
ADJUST_LR_CHOICES, NS_METHODS, NS_NORMALIZE = get_args(AdjustLR), get_args(NSMethod), get_args(NSNormalize)

#: Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932): one optimal odd quintic per iteration,
#: the 5-step schedule of modded-nanogpt (with its 2% safety factor on the normalization).
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
#: Named schedules for ``ns_coefficients``: (triples, normalization safety factor). A schedule runs its triples in
#: order; ``ns_steps`` truncates it or repeats its last triple (as the Polar Express reference does).
#: "turbo_muon" is Polar Express without its first triple, for AOL-preconditioned input (Boissin et al. 2025,
#: arXiv 2512.04632, modded-nanogpt record 2025-11-11: "drop the first iteration of the usual coefficients").
NS_PRESETS: dict[str, tuple[tuple[tuple[float, float, float], ...], float]] = dict(
    zip(
        get_args(NSPreset),
        [((DEFAULT_NS_COEFFICIENTS,), 1.0), (POLAR_EXPRESS_COEFFICIENTS, 1.02), (POLAR_EXPRESS_COEFFICIENTS[1:], 1.02)],
        strict=True,
    )
)
#: Gram-space iteration: restart (fold Q into X, recompute the Gram) before these iterations, as the
#: gram-newton-schulz reference recommends for 5 steps (the Gram squares X's condition number).
GRAM_RESTARTS = (2,)
#: Same-shape matrices are orthogonalized as one batch of at most this many bytes (in the NS dtype).
MAX_NS_BATCH_BYTES = 512 * 2**20

Coefficients = str | tuple[float, float, float] | Sequence[tuple[float, float, float]]
Triples = tuple[tuple[float, float, float], ...]


def resolve_ns_coefficients(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    """One (a, b, c) triple per iteration: a single triple is repeated ``steps`` times; a preset name of
    :data:`NS_PRESETS` is truncated to ``steps`` or extended with its last triple.

    Raises:
        ValueError: if ``steps < 1``, the name is unknown, or a sequence of triples does not have exactly ``steps``
            entries.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps < 100:
        raise ValueError(f"Newton-Schulz steps must be a positive integer below 100 (as torch.optim.Muon): {steps!r}.")
    if isinstance(coefficients, str):
        if coefficients not in NS_PRESETS:
            raise ValueError(f"Unknown ns_coefficients preset {coefficients!r}; choose one of {sorted(NS_PRESETS)}.")
        schedule = NS_PRESETS[coefficients][0]
        return [schedule[min(i, len(schedule) - 1)] for i in range(steps)]
    given = tuple(coefficients)
    triples = ((given,) * steps if len(given) == 3 else (given,)) if all(_is_number(c) for c in given) else given
    if not all(isinstance(t, Sequence) and len(t) == 3 and all(_is_number(c) for c in t) for t in triples):
        raise ValueError(
            f"Newton-Schulz coefficients must be exactly 3 values (a, b, c) or a sequence of such triples, got "
            f"{given!r:.200}."
        )
    triples = [tuple(float(c) for c in triple) for triple in triples]
    if len(triples) != steps:
        raise ValueError(
            f"Got {len(triples)} Newton-Schulz coefficient triples for {steps} steps; pass one triple per step "
            "or set ns_steps to the number of triples."
        )
    return triples


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class Orthogonalizer:
    r"""How refresh steps approximate the polar factor :math:`UV^\top` (hashable: equal ones are batched together).

    On the wide orientation :math:`X \in \mathbb{R}^{p \times q}`, :math:`p \le q` (tall matrices run the same
    recursion transposed, written without transposing):

    * normalization ``"frobenius"``: :math:`X_0 = X / \max(s\lVert X \rVert_F, \varepsilon)` (torch.optim.Muon's
      clamp, so gradients of any scale give its result bit for bit) with safety factor
      :math:`s`; ``"aol"`` (Turbo-Muon, arXiv 2512.04632; AOL, Prach & Lampert 2022): after the Frobenius step,
      :math:`X_0 = D X / s`, :math:`D = \mathrm{diag}(\sum_j |XX^\top|_{ij})^{-1/2}`, which bounds
      :math:`\lVert X_0 \rVert_2 \le 1` and, where rows have unequal norms, lifts the small singular values; its Gram
      :math:`DXX^\top D` is the first iteration's, so it costs no matmul.
    * method ``"standard"``: :math:`X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k`, :math:`A_k = X_k X_k^\top`
      — :math:`4p^2q + 2p^3` FLOPs per iteration. ``"gram"`` (Gram Newton–Schulz, Zhang, Amsel, Chen, Dao 2026):
      every :math:`X_k = Q_k X_0` with :math:`Q_k` a polynomial in :math:`R_0 = X_0X_0^\top`, so iterate on
      :math:`p \times p` matrices, :math:`Z = b R + c R^2`, :math:`Q \leftarrow Q(aI + Z)`,
      :math:`R \leftarrow (aI + Z) R (aI + Z)`, and apply :math:`Q` to :math:`X` once; restarted (``X ← QX``,
      fresh Gram) before iteration :data:`GRAM_RESTARTS`. Used only where it needs fewer FLOPs than
      ``"standard"`` (aspect ratio above ≈ 1.5); equal to it in exact arithmetic.
    """

    coefficients: Triples = (DEFAULT_NS_COEFFICIENTS,) * 5
    eps: float = 1e-7
    dtype: torch.dtype = torch.float32
    normalize: str = "frobenius"
    method: str = "standard"
    safety: float = 1.0

    @property
    def steps(self) -> int:
        return len(self.coefficients)

    def uses_gram(self, shape: Sequence[int]) -> bool:
        """Whether ``shape`` runs the Gram-space iteration (method ``"gram"`` and fewer FLOPs than standard)."""
        return self.method == "gram" and gram_ns_flops(shape, self.steps) < ns_flops(shape, self.steps)

    def flops(self, shape: Sequence[int]) -> int:
        """Matmul FLOPs of one ``(m, n)`` matrix (the AOL Gram is the first iteration's, so it adds none)."""
        return gram_ns_flops(shape, self.steps) if self.uses_gram(shape) else ns_flops(shape, self.steps)

    def __call__(self, X: Tensor) -> Tensor:
        """Orthogonalize a contiguous ``(B, m, n)`` batch in :attr:`dtype`, which it may overwrite."""
        m, n = X.shape[-2:]
        tall = m > n
        X.div_(torch.linalg.matrix_norm(X, keepdim=True).mul_(self.safety).clamp_min_(self.eps))
        A = None
        if self.normalize == "aol":
            A = _gram(X, tall)
            d = A.abs().sum(-1).clamp_min_(self.eps).rsqrt_().div_(self.safety)  # (B, p); AOL is scale-free
            X.mul_(d.unsqueeze(-2) if tall else d.unsqueeze(-1))
            A.mul_(d.unsqueeze(-1)).mul_(d.unsqueeze(-2))
        if self.uses_gram((m, n)):
            return _gram_newton_schulz(X, A, self.coefficients, tall, self.normalize == "aol")
        for k, (a, b, c) in enumerate(self.coefficients):
            # Tall matrices iterate X <- aX + X(bA + cA²) with A = XᵀX: the transposed recursion written without
            # transposing (A and bA + cA² are symmetric), so every operand stays contiguous.
            A = A if k == 0 and A is not None else _gram(X, tall)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
        return X


def orthogonalize_batched(matrices: Sequence[Tensor], orthogonalizers: Sequence[Orthogonalizer]) -> list[Tensor]:
    """Orthogonalize each matrix with its :class:`Orthogonalizer`; same-shape matrices with equal orthogonalizers are
    stacked (cast in the same copy) into batched calls of at most :data:`MAX_NS_BATCH_BYTES`."""
    results: list[Tensor | None] = [None] * len(matrices)
    batches: dict[tuple, list[int]] = defaultdict(list)
    for i, (x, ortho) in enumerate(zip(matrices, orthogonalizers)):
        batches[(tuple(x.shape), x.device, ortho)].append(i)
    for (shape, device, ortho), index in batches.items():
        per_batch = max(1, MAX_NS_BATCH_BYTES // max(1, math.prod(shape) * ortho.dtype.itemsize))
        for start in range(0, len(index), per_batch):
            chunk = index[start : start + per_batch]
            X = torch.empty((len(chunk), *shape), dtype=ortho.dtype, device=device)
            for j, i in enumerate(chunk):
                X[j].copy_(matrices[i])
            for i, o in zip(chunk, ortho(X).unbind(0)):
                results[i] = o
    return results


def _gram(X: Tensor, tall: bool) -> Tensor:
    """The small-side Gram matrix of a ``(B, m, n)`` batch: XᵀX when tall, else XXᵀ."""
    return torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)


def _gram_newton_schulz(X: Tensor, R: Tensor | None, coefficients: Triples, tall: bool, aol: bool) -> Tensor:
    """:class:`Orthogonalizer`'s ``"gram"`` method: Q and R are polynomials in the first Gram, so they commute.

    Without AOL the p×p iteration runs in float32 at least: in bf16 the errors that compound in Q and R (the Gram
    squares X's condition number) let singular values reach ~2 on ill-conditioned matrices and ~250 on digits
    momenta (``benchmarks/orthogonalize.py``); in float32 they stay below ~1.4 (standard NS5 in bf16: 1.2). AOL's
    bound ‖X₀‖₂ ≤ 1 keeps the bf16 iteration at NS5's accuracy (measured on the same sets, σ ≤ 1.15), so it stays in
    X's dtype there. The p×q products (Gram of X, restart, final Q·X) are always in X's dtype."""
    work = X.dtype if aol else torch.promote_types(X.dtype, torch.float32)
    apply = (lambda Y, Q: torch.bmm(Y, Q.to(Y.dtype))) if tall else (lambda Y, Q: torch.bmm(Q.to(Y.dtype), Y))
    R = (_gram(X, tall) if R is None else R).to(work)
    Q = None
    last = len(coefficients) - 1
    for k, (a, b, c) in enumerate(coefficients):
        if k in GRAM_RESTARTS and Q is not None:
            X = apply(X, Q)
            R, Q = _gram(X, tall).to(work), None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c)  # bR + cR²
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # aI + Z
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a)  # Q(aI + Z)
        if k < last and k + 1 not in GRAM_RESTARTS:
            RZ = torch.baddbmm(R, R, Z, beta=a)  # R(aI + Z)
            R = torch.baddbmm(RZ, Z, RZ, beta=a)  # (aI + Z) R (aI + Z)
    return apply(X, Q)


def make_orthogonalizer(
    coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
    normalize: str = "frobenius",
    method: str = "standard",
) -> Orthogonalizer:
    """An :class:`Orthogonalizer` from the optimizer's options (validated; a preset brings its safety factor)."""
    if normalize not in NS_NORMALIZE:
        raise ValueError(f"ns_normalize must be one of {NS_NORMALIZE}, got {normalize!r}.")
    if method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}.")
    safety = NS_PRESETS[coefficients][1] if isinstance(coefficients, str) and coefficients in NS_PRESETS else 1.0
    triples = tuple(map(tuple, resolve_ns_coefficients(coefficients, steps)))
    return Orthogonalizer(triples, eps, dtype, normalize, method, safety)


def newton_schulz(
    X: Tensor,
    steps: int = 5,
    coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
    normalize: str = "frobenius",
    method: str = "standard",
) -> Tensor:
    r"""Approximate the polar factor :math:`UV^\top` of each matrix in a ``(..., m, n)`` batch.

    .. math::
        X_0 = X / \max(\lVert X \rVert_F, \varepsilon), \qquad
        A_k = X_k X_k^\top, \qquad
        X_{k+1} = a_k X_k + (b_k A_k + c_k A_k^2) X_k

    The Gram matrix is the small side, ``min(m, n)²`` (for ``m > n`` the same recursion on :math:`X^\top`).
    With the default coefficients the singular values land in roughly [0.7, 1.2] (Keller Jordan). The opt-in
    ``normalize="aol"``, ``method="gram"`` and coefficient presets are described in :class:`Orthogonalizer`.

    Args:
        X: matrices, ``(..., m, n)``.
        steps: number of quintic iterations.
        coefficients: one (a, b, c) triple for every step, a sequence with one triple per step, or a preset name
            of :data:`NS_PRESETS` (``"jordan"``, ``"polar_express"``, ``"turbo_muon"``).
        eps: lower bound of the Frobenius norm it divides by (as torch.optim.Muon).
        dtype: computation dtype (``None`` keeps ``X.dtype``).
        normalize: ``"frobenius"`` or ``"aol"``.
        method: ``"standard"`` or ``"gram"``.

    Returns:
        Tensor of shape ``X.shape`` in ``dtype``.
    """
    if X.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices (..., m, n), got shape {tuple(X.shape)}.")
    batch_shape, (m, n) = X.shape[:-2], X.shape[-2:]
    ortho = make_orthogonalizer(coefficients, steps, eps, dtype or X.dtype, normalize, method)
    X = X.to(ortho.dtype, copy=True).reshape(-1, m, n)
    return ortho(X).reshape(*batch_shape, m, n)


def row_norm(X: Tensor, eps: float = 1e-7) -> Tensor:
    r"""Normalize the ``min(m, n)`` vectors along the longer axis of each ``(..., m, n)`` matrix to unit L2 norm.

    Rows when ``m <= n``, columns when ``m > n`` (RowNorm of the oriented matrix, transposed back), so the result
    has Frobenius norm :math:`\sqrt{\min(m, n)}`, that of the exact polar factor (NS5's approximation of it is
    about 0.87 of that). A vector with norm below ``eps`` is divided by ``eps`` instead: zero stays zero, nothing
    becomes NaN.
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
    return (
        lookahead(M, G, beta, nesterov, updated=False).square_().sum(dim=dim, keepdim=True)
    )  # eager square-sum: faster than vector_norm


def lookahead(M: Tensor, G: Tensor, beta: float, nesterov: bool, *, updated: bool, out: Tensor | None = None) -> Tensor:
    r"""The update direction :math:`N_t` of a step — the one place the Nesterov look-ahead is formed.

    ``updated=True``: ``M`` is the new momentum :math:`M_t`; :math:`N_t = \beta M_t + (1-\beta) G` (nesterov, op for
    op as torch.optim.Muon, written into ``out`` when given, e.g. over the gradient) or :math:`M_t` itself.
    ``updated=False``: ``M`` is the old momentum :math:`M_{t-1}`, read-only, one pass:
    :math:`N_t = \beta^2 M_{t-1} + (1-\beta^2) G` (nesterov) or :math:`\beta M_{t-1} + (1-\beta) G` — the same
    value (to rounding) before anything is written, for statistics read before the step's verdict.
    """
    if not updated:
        return torch.lerp(G, M, beta * beta) if nesterov else torch.lerp(M, G, 1 - beta)
    if not nesterov:
        return M
    return G.lerp_(M, beta) if out is G else torch.lerp(G, M, beta)


def drift_sums(M: Tensor, G: Tensor, R: Tensor, beta: float, nesterov: bool, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    r"""Sums along ``dim`` (kept) of :math:`N^2` (as :func:`rownorm_sumsq`), :math:`N \odot R` and :math:`R^2` from
    one look-ahead N, for the adaptive schedule's drift (R: the look-ahead of the last refresh). Read-only; sums, not
    cosines, so that shards can be added up."""
    N = lookahead(M, G, beta, nesterov, updated=False)
    dot, rr = (N * R).sum(dim=dim, keepdim=True), R.square().sum(dim=dim, keepdim=True)
    return N.square_().sum(dim=dim, keepdim=True), dot, rr


#: ``rownorm_scale`` values that calibrate γ per matrix at every refresh (:func:`refresh_scales`)
AUTO_SCALES = {name: i for i, name in enumerate(get_args(AutoScale))}  # the index of its row in the state


def refresh_scales(N: Tensor, U: Tensor, eps: float = 1e-7) -> Tensor:
    r"""The γ that makes a RowNorm step comparable to this refresh's NS5 step, two ways, from the full look-ahead
    ``N`` and its orthogonalization ``U = NS5(N)`` (float32, ``(2,)``):

    - descent-matched (``rownorm_scale="auto"``): :math:`\langle N, U\rangle / \sum_i \lVert n_i \rVert`. The
      polar factor maximizes :math:`\langle X, N\rangle` over :math:`\lVert X\rVert_2 \le 1` (value
      :math:`\lVert N\rVert_*`), RowNorm over unit oriented rows (value :math:`\sum_i \lVert n_i\rVert`): with this
      γ a RowNorm step of the same momentum descends as far to first order as the NS5 step did.
    - RMS-matched (``"auto_rms"``): :math:`\lVert U\rVert_F / \sqrt{p}`, :math:`p = \min(m, n)` (RowNorm's
      output has Frobenius norm exactly :math:`\sqrt p`).

    Their inverses are the RowNorm-to-spectral ratios ``OptimizerTelemetry`` logs. Sums, so a matrix rebuilt from
    shards gives the same value as the dense one.
    """
    n, u = N.float(), U.float()
    rows = torch.linalg.vector_norm(n, dim=row_norm_dim(n.shape)).sum()
    descent = torch.dot(n.reshape(-1), u.reshape(-1)) / rows.clamp_min(eps)
    rms = torch.linalg.vector_norm(u) / math.sqrt(math.prod(n.shape[:-2]) * min(n.shape[-2:]))
    return torch.stack([descent, rms])


def masked_scalar(ok: Tensor, value: float | Tensor, identity: float, like: Tensor) -> Tensor:
    """``value`` where the device verdict ``ok`` holds, else ``identity``: a 0-d tensor on ``like``'s device, made
    without a host synchronization, in at least float32 — as a Python scalar is applied: a bf16 weight multiplied by
    it is computed in float32 and rounded once (never by a bf16-rounded factor: 0.998 would become 0.996)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    if isinstance(value, Tensor):
        return torch.where(ok, value.to(like.device, dtype), identity)
    return torch.where(ok, torch.full((), value, dtype=dtype, device=like.device), identity)


def scale_(tensors: list[Tensor], factor: float | Tensor, ok: Tensor | None = None) -> None:
    """``tensors *= factor`` (an identity where the device verdict ``ok`` is False), the factor applied in at least
    float32 as ``Tensor.mul_`` applies a Python scalar: torch's multi-tensor multiply would first round a Python
    scalar to a bf16 list's dtype (a weight decay of 0.998 would become 0.996)."""
    if ok is not None:
        factor = masked_scalar(ok, factor, 1.0, tensors[0])
    elif not isinstance(factor, Tensor) and tensors[0].dtype in (torch.bfloat16, torch.float16):
        factor = torch.full((), factor, dtype=torch.float32, device=tensors[0].device)
    torch._foreach_mul_(tensors, factor)


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
    gamma: float | Tensor = 1.0,
) -> None:
    r"""One RowNorm step in place: :math:`M \leftarrow \beta M + (1-\beta)G`, :math:`N` (written over ``G``),
    :math:`W \leftarrow \text{decay}\cdot W + \gamma\cdot\text{scale}\cdot N / \max(\sqrt{\text{sumsq}},
    \varepsilon)`. A tensor ``scale`` or ``gamma`` (a tensor lr; a calibrated γ) divides the row-sized denominator
    instead, so W still sees one pass.

    With a device verdict ``ok`` (False: a non-finite gradient somewhere) every write is an identity: ``G`` is
    replaced by ``M`` (so ``M`` and ``N`` stay finite), the denominator by inf and the decay by 1.
    """
    den = sumsq.sqrt().clamp_min(eps)
    if isinstance(gamma, Tensor):
        den = den / gamma
    else:
        scale = scale * gamma
    if ok is not None:
        G = torch.where(ok, G, M)
        den = torch.where(ok, den, float("inf"))
        decay = masked_scalar(ok, decay, 1.0, W)
    M.lerp_(G, 1 - beta)
    N = lookahead(M, G, beta, nesterov, updated=True, out=G)
    if isinstance(decay, Tensor) or decay != 1.0:
        W.mul_(decay)
    if isinstance(scale, Tensor):
        W.addcdiv_(N, den / scale)
    else:
        W.addcdiv_(N, den, value=scale)


def shape_factor(shape: Sequence[int], adjust_lr: str = "original") -> float:
    r"""Update scale :math:`s(m, n)` shared by the NS5 and RowNorm branches.

    ``"original"``: :math:`\sqrt{\max(1, m/n)}` (Keller Jordan, torch.optim.Muon);
    ``"match_rms_adamw"``: :math:`0.2\sqrt{\max(m, n)}` (Moonlight), which gives the update AdamW's RMS;
    ``"spectral_unclamped"``: :math:`\sqrt{m/n}` (torch.optim.Muon's option of that name).
    """
    m, n = shape[-2], shape[-1]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, m / n))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "spectral_unclamped":
        return math.sqrt(m / n)
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {adjust_lr!r}.")


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """Multiply-add FLOPs of standard Newton–Schulz on one ``(m, n)`` matrix: per step 2·p²q (Gram), 2·p³ (A²)
    and 2·p²q (product), with p = min(m, n), q = max(m, n)."""
    p, q = sorted((shape[-2], shape[-1]))
    return steps * (4 * p * p * q + 2 * p**3)


def gram_ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of the Gram-space iteration: 2·p²q for the first Gram and 2·p²q for the final Q·X, 2·p³ per p×p
    product (Z, Q, R·Z, Z·RZ; the first Q and the last R need none), and 4·p²q per restart (X ← QX, its Gram)."""
    p, q = sorted((shape[-2], shape[-1]))
    restarts = [k for k in GRAM_RESTARTS if 0 < k < steps]
    cut = set(restarts) | {0}
    products = sum(1 + (k not in cut) + 2 * (k + 1 < steps and k + 1 not in restarts) for k in range(steps))
    return 4 * p * p * q + 4 * p * p * q * len(restarts) + 2 * p**3 * products


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 where bf16 matmul is fast and accurate enough for NS5 (CUDA, CPUs with AVX-512/AMX bf16), else fp32.

    NS5 is self-correcting, so bf16 rounding does not accumulate (Keller Jordan; torch.optim.Muon always uses bf16).
    Where the CPU has native bf16 matmul (AVX-512 BF16 / AMX) it is much faster than fp32 (``lightning-muon doctor``
    times it); without native bf16 support it is emulated and slower than fp32, so fp32 is chosen there.
    """
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        from lightning_muon.compat import cpu_has_native_bf16

        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32
