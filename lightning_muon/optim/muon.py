"""Periodic Row-wise Muon: NS5 every K steps, RowNorm of the momentum in between, AdamW for everything else."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.optim.kernels import (
    ADJUST_LR_CHOICES,
    DEFAULT_NS_COEFFICIENTS,
    compiled_rownorm_kernels,
    default_ns_dtype,
    newton_schulz_,
    resolve_ns_coefficients,
    row_norm_dim,
    rownorm_sumsq,
    rownorm_update_,
    shape_factor,
)

__all__ = ["PeriodicRowwiseMuon"]

log = logging.getLogger(__name__)

MUON_KEYS = (
    "lr", "momentum", "nesterov", "weight_decay", "period", "rownorm_scale",
    "ns_steps", "ns_coefficients", "ns_dtype", "ns_eps", "adjust_lr",
)  # fmt: skip
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
#: Same-shape matrices are orthogonalized as one batch of at most this many bytes (in the NS dtype).
MAX_NS_BATCH_BYTES = 512 * 2**20


@dataclass
class _Plan:
    """What one Muon group does this step: indices of refreshing / RowNorm matrices, RowNorm row sums of squares."""

    refresh: list[int]
    rownorm: list[int]
    sumsq: list[Tensor]


class PeriodicRowwiseMuon(Optimizer):
    r"""Periodic Row-wise Muon (arXiv 2608.20818) for 2-D hidden weights, AdamW for all other parameters.

    For a matrix :math:`W \in \mathbb{R}^{m \times n}` with gradient :math:`G_t` at step :math:`t = 1, 2, \dots`:

    .. math::
        M_t &= \beta M_{t-1} + (1-\beta) G_t, \qquad
        N_t = \beta M_t + (1-\beta) G_t \ \text{(nesterov) or } M_t \\
        U_t &= \begin{cases}
            s(m,n)\,\mathrm{NS5}(N_t) & (t-1) \bmod K = 0 \quad\text{(refresh)} \\
            \gamma\, s(m,n)\,\mathrm{RowNorm}(N_t) & \text{otherwise}
        \end{cases} \\
        W &\leftarrow W (1 - \eta\lambda) - \eta U_t

    RowNorm normalizes the :math:`\min(m,n)` vectors along the longer axis, so both branches have Frobenius norm
    :math:`s\sqrt{\min(m,n)}` and :math:`\gamma` is the RowNorm step relative to the spectral step. ``period=1`` is
    vanilla Muon (identical to ``torch.optim.Muon``). Groups with ``use_muon=False`` run AdamW (identical to
    ``torch.optim.AdamW``). With ``nesterov=True`` the look-ahead :math:`N_t` is written into ``p.grad`` in place
    (as in Keller Jordan's reference), saving one matrix allocation per parameter and step. The step counter of
    every parameter lives in ``state[p]["step"]``, so a resumed run takes
    the same branch sequence as an uninterrupted one.

    Args:
        params: parameters or param groups (e.g. from :func:`lightning_muon.muon_param_groups`); a group's
            ``use_muon`` (default ``True``) picks the branch. Named parameters ``(name, tensor)`` give errors names.
        lr: learning rate :math:`\eta` of Muon groups.
        period: :math:`K`, steps between NS5 refreshes (1 = vanilla Muon).
        rownorm_scale: :math:`\gamma`, the RowNorm step relative to the NS5 step.
        momentum: :math:`\beta` in [0, 1).
        nesterov: use the Nesterov look-ahead :math:`N_t`.
        weight_decay: decoupled weight decay :math:`\lambda` of Muon groups.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: one (a, b, c) or a sequence of ``ns_steps`` triples.
        ns_dtype: NS5 compute dtype (``torch.bfloat16``, ``torch.float32`` or their names); ``None`` picks per
            device with :func:`~lightning_muon.optim.kernels.default_ns_dtype` (bf16 on CUDA and bf16-capable CPUs).
        ns_eps: stabilizer of the NS5 normalization and of RowNorm.
        adjust_lr: shape factor :math:`s(m, n)`: ``"original"`` or ``"match_rms_adamw"``.
        adamw_lr: default lr of AdamW groups (``None``: ``lr``).
        betas: AdamW :math:`(\beta_1, \beta_2)`.
        eps: AdamW epsilon.
        adamw_weight_decay: default weight decay of AdamW groups (``None``: ``weight_decay``).
        skip_nonfinite: on a NaN/inf gradient skip the whole step and count it in ``nonfinite_steps_skipped``
            instead of raising ``FloatingPointError``.
        foreach: multi-tensor elementwise kernels (``None``: on).
        fused: compile the RowNorm step (row statistics, momentum, weight decay, update) with ``torch.compile`` into
            two passes per matrix: ~4x less elementwise time on CPU, but the first step compiles (seconds to a
            minute, cached on disk afterwards) and needs a C++ compiler on CPU / triton on CUDA.

    Attributes:
        last_branches: how many matrices took each branch in the last step, ``{"refresh": int, "rownorm": int}``.
        nonfinite_steps_skipped: steps skipped for non-finite gradients (with ``skip_nonfinite=True``).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float = 0.02,
        period: int = 3,
        rownorm_scale: float = 0.15,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Sequence[float] | Sequence[Sequence[float]] = DEFAULT_NS_COEFFICIENTS,
        ns_dtype: torch.dtype | str | None = None,
        ns_eps: float = 1e-7,
        adjust_lr: str = "original",
        adamw_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        skip_nonfinite: bool = False,
        foreach: bool | None = None,
        fused: bool = False,
    ) -> None:
        self._muon_defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, period=period,
            rownorm_scale=rownorm_scale, ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            ns_eps=ns_eps, adjust_lr=adjust_lr,
        )  # fmt: skip
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        )
        self.skip_nonfinite = skip_nonfinite
        self.foreach = True if foreach is None else foreach
        self.fused = fused
        self.nonfinite_steps_skipped = 0
        self.last_branches = {"refresh": 0, "rownorm": 0}
        super().__init__(params, {"use_muon": True})

    # ----------------------------------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; missing options are filled from the constructor values of its branch, then validated."""
        use_muon = param_group.setdefault("use_muon", True)
        if use_muon not in (True, False):
            raise ValueError(f"use_muon must be True or False, got {use_muon!r}.")
        allowed = {"params", "param_names", "use_muon", *(MUON_KEYS if use_muon else ADAMW_KEYS)}
        unknown = sorted(set(param_group) - allowed)
        if unknown:
            branch = "Muon" if use_muon else "AdamW"
            raise ValueError(f"Unknown option(s) {unknown} for a {branch} group; allowed: {sorted(allowed)}.")
        for key, value in (self._muon_defaults if use_muon else self._adamw_defaults).items():
            param_group.setdefault(key, value)
        params = param_group["params"]
        if not isinstance(params, (Tensor, set)):  # torch rejects sets itself
            param_group["params"] = params = list(params)
            ids = [id(p[1] if isinstance(p, tuple) else p) for p in params]
            if len(set(ids)) != len(ids):
                raise ValueError("A parameter appears twice in one param group; list each parameter once.")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            (_validate_muon_group if use_muon else _validate_adamw_group)(group)
        except ValueError:
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("skip_nonfinite", False)
        self.__dict__.setdefault("foreach", True)
        self.__dict__.setdefault("fused", False)
        self.__dict__.setdefault("nonfinite_steps_skipped", 0)
        self.__dict__.setdefault("last_branches", {"refresh": 0, "rownorm": 0})
        for group in self.param_groups:
            group.setdefault("use_muon", True)
            if group["use_muon"]:
                group.setdefault("ns_eps", 1e-7)
                group.setdefault("ns_coefficients", DEFAULT_NS_COEFFICIENTS)
                group.setdefault("ns_dtype", None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict after checking it was saved for the same parameter layout.

        Raises:
            ValueError: naming the first group or parameter whose branch or state shape differs.
        """
        self._check_layout(state_dict)
        super().load_state_dict(state_dict)

    def _check_layout(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        hint = "Load the checkpoint into the model and parameter grouping it was saved with."
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"Optimizer state has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}. "
                + hint
            )
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"Param group {g} has {len(group['params'])} parameters, the saved one {len(saved['params'])}. "
                    + hint
                )
            if saved.get("use_muon", True) != group["use_muon"]:
                raise ValueError(f"Param group {g} has use_muon={group['use_muon']} but was saved with "
                                 f"use_muon={saved.get('use_muon', True)}. " + hint)  # fmt: skip
            for i, (index, param) in enumerate(zip(saved["params"], group["params"])):
                for key, value in state_dict["state"].get(index, {}).items():
                    if isinstance(value, Tensor) and value.ndim > 0 and value.shape != param.shape:
                        raise ValueError(
                            f"Saved state {key!r} of {_param_name(group, i)} has shape {tuple(value.shape)}, "
                            f"the parameter has shape {tuple(param.shape)}. " + hint
                        )

    def _collect(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
        """Params with gradients and their gradients; creates missing state (zeros, step 0)."""
        params, grads = [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{_param_name(group, i)} has a sparse gradient; PeriodicRowwiseMuon needs dense.")
            if torch.is_complex(p):
                raise RuntimeError(f"{_param_name(group, i)} is complex; PeriodicRowwiseMuon supports real tensors.")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                if group["use_muon"]:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
        return params, grads

    def _plan(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> _Plan:
        """Read-only first phase: which matrices refresh, and the RowNorm row statistics of the others."""
        if not group["use_muon"]:
            return _Plan([], [], [])
        refresh = [int(self.state[p]["step"].item()) % group["period"] == 0 for p in params]  # (t - 1) mod K
        rownorm = [i for i, r in enumerate(refresh) if not r]
        sumsq_fn = compiled_rownorm_kernels()[0] if self.fused else rownorm_sumsq
        sumsq = [
            sumsq_fn(self.state[params[i]]["momentum_buffer"], grads[i], group["momentum"], group["nesterov"],
                     row_norm_dim(params[i].shape))
            for i in rownorm
        ]  # fmt: skip
        return _Plan([i for i, r in enumerate(refresh) if r], rownorm, sumsq)

    def _first_nonfinite(self, work: list[tuple[list[Tensor], list[Tensor]]], plans: list[_Plan]) -> str | None:
        """Name of the first parameter with a NaN/inf gradient, or None; one host sync when all are finite.

        RowNorm matrices are covered by their row statistics (finite momentum + non-finite gradient gives a
        non-finite sum of squares); every other gradient gets one multi-tensor norm.
        """
        probes = [sq.sum() for plan in plans for sq in plan.sumsq]
        rest = [g for (_, gs), plan in zip(work, plans) for i, g in enumerate(gs) if i not in set(plan.rownorm)]
        probes += torch._foreach_norm(rest) if rest else []
        if not probes or bool(torch.stack(probes).sum().isfinite()):
            return None
        for group, (params, gs) in zip(self.param_groups, work):
            names = {id(p): _param_name(group, i) for i, p in enumerate(group["params"])}
            for p, g in zip(params, gs):
                if not bool(g.isfinite().all()):
                    return names[id(p)]
        return None  # a sum of squares overflowed on finite values

    # ---------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step (all groups, or none when a gradient is non-finite)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [self._collect(group) for group in self.param_groups]
        plans = [self._plan(group, params, grads) for group, (params, grads) in zip(self.param_groups, work)]
        bad = self._first_nonfinite(work, plans)
        if bad is not None:
            if not self.skip_nonfinite:
                raise FloatingPointError(
                    f"Non-finite (NaN or inf) gradient in {bad}. Lower the learning rate, enable gradient clipping or "
                    "loss scaling, or pass skip_nonfinite=True to skip such steps."
                )
            self.nonfinite_steps_skipped += 1
            log.warning("Skipped optimizer step: non-finite gradient in %s (%d skipped so far).", bad,
                        self.nonfinite_steps_skipped)  # fmt: skip
            return loss
        self.last_branches = {"refresh": 0, "rownorm": 0}
        for group, (params, grads), plan in zip(self.param_groups, work, plans):
            if not params:
                continue
            if group["use_muon"]:
                self._rownorm(group, params, grads, plan)
                self._refresh(group, [params[i] for i in plan.refresh], [grads[i] for i in plan.refresh])
                self.last_branches["refresh"] += len(plan.refresh)
                self.last_branches["rownorm"] += len(plan.rownorm)
                _add_([self.state[p]["step"] for p in params], 1.0, self.foreach)
            else:
                self._adamw_step(group, params, grads)
        return loss

    def _rownorm(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], plan: _Plan) -> None:
        """W ← W(1 - lr·wd) - lr·γ·s·RowNorm(N) with the planned row statistics, one fused pass per matrix."""
        update_fn = compiled_rownorm_kernels()[1] if self.fused else rownorm_update_
        decay = 1 - group["lr"] * group["weight_decay"]
        for i, sumsq in zip(plan.rownorm, plan.sumsq):
            p = params[i]
            scale = -group["lr"] * group["rownorm_scale"] * shape_factor(p.shape, group["adjust_lr"])
            update_fn(p, self.state[p]["momentum_buffer"], grads[i], sumsq, group["momentum"], group["nesterov"],
                      decay, scale, group["ns_eps"])  # fmt: skip

    def _refresh(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> None:
        """Momentum, then W ← W(1 - lr·wd) - lr·s·NS5(N), same-shape matrices stacked into batched matmuls."""
        if not params:
            return
        beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        _lerp_(bufs, grads, 1 - beta, self.foreach)
        if group["nesterov"]:  # N = βM + (1-β)G written over the gradient, which step() consumes
            _lerp_(grads, bufs, beta, self.foreach)
        updates = grads if group["nesterov"] else bufs
        if wd != 0:
            _mul_(params, 1 - lr * wd, self.foreach)
        dtype = _ns_dtype(group, params[0].device)
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            buckets[(tuple(p.shape), p.device, p.dtype)].append(i)
        for (shape, _, _), index in buckets.items():
            per_batch = max(1, MAX_NS_BATCH_BYTES // (math.prod(shape) * dtype.itemsize))
            scale = -lr * shape_factor(shape, group["adjust_lr"])
            for start in range(0, len(index), per_batch):
                chunk = index[start : start + per_batch]
                X = torch.empty((len(chunk), *shape), dtype=dtype, device=params[chunk[0]].device)
                for j, i in enumerate(chunk):
                    X[j].copy_(updates[i])  # stack and cast in one pass
                ortho = newton_schulz_(X, group["ns_steps"], group["ns_coefficients"], group["ns_eps"])
                # the multi-tensor add casts bf16 -> fp32 on the fly (a plain mixed-dtype add_ is ~6x slower)
                torch._foreach_add_([params[i] for i in chunk], list(ortho.unbind(0)), alpha=scale)

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> None:
        """Decoupled-weight-decay Adam, op for op as ``torch.optim.AdamW`` (bit-identical results)."""
        states = [self.state[p] for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        _add_(steps, 1.0, self.foreach)
        if wd != 0:
            _mul_(params, 1 - lr * wd, self.foreach)
        _lerp_(exp_avgs, grads, 1 - beta1, self.foreach)
        _mul_(exp_avg_sqs, beta2, self.foreach)
        if self.foreach:
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        else:
            for v, g in zip(exp_avg_sqs, grads):
                v.addcmul_(g, g, value=1 - beta2)
        step_size = [-lr / (1 - beta1 ** t.item()) for t in steps]
        bias_correction2_sqrt = [(1 - beta2 ** t.item()) ** 0.5 for t in steps]
        if self.foreach:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
        else:
            for p, m, v, size, bc2 in zip(params, exp_avgs, exp_avg_sqs, step_size, bias_correction2_sqrt):
                p.addcdiv_(m, (v.sqrt() / bc2).add_(eps), value=size)


# ------------------------------------------------------------------------------------------------------- helpers
def _lerp_(xs: list[Tensor], ys: list[Tensor], weight: float, foreach: bool) -> None:
    if foreach:
        torch._foreach_lerp_(xs, ys, weight)
    else:
        for x, y in zip(xs, ys):
            x.lerp_(y, weight)


def _mul_(xs: list[Tensor], value: float, foreach: bool) -> None:
    if foreach:
        torch._foreach_mul_(xs, value)
    else:
        for x in xs:
            x.mul_(value)


def _add_(xs: list[Tensor], value: float, foreach: bool) -> None:
    if foreach:
        torch._foreach_add_(xs, value)
    else:
        for x in xs:
            x.add_(value)


def _param_name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    shape = tuple(group["params"][index].shape)
    return f"parameter {names[index]!r} {shape}" if names else f"parameter {index} {shape} of its group"


def _ns_dtype(group: dict[str, Any], device: torch.device) -> torch.dtype:
    return default_ns_dtype(device) if group["ns_dtype"] is None else group["ns_dtype"]


def _validate_muon_group(group: dict[str, Any]) -> None:
    """Check a Muon group's options and parameters; normalizes ``ns_dtype`` names to torch dtypes."""
    _check_nonnegative(group, "lr", "weight_decay", "rownorm_scale", "ns_eps")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}.")
    period = group["period"]
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period (K) must be an integer >= 1 (1 = vanilla Muon), got {period!r}.")
    if group["adjust_lr"] not in ADJUST_LR_CHOICES:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {group['adjust_lr']!r}.")
    resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
    dtype = group["ns_dtype"]
    if isinstance(dtype, str):
        if dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {sorted(NS_DTYPES)} or None, got {dtype!r}.")
        group["ns_dtype"] = dtype = NS_DTYPES[dtype]
    if dtype is not None and dtype not in NS_DTYPES.values():
        raise ValueError(f"ns_dtype must be torch.bfloat16, torch.float32, torch.float64 or None, got {dtype!r}.")
    for i, p in enumerate(group["params"]):
        if p.ndim != 2:
            raise ValueError(
                f"{_param_name(group, i)} is in a Muon group but is not a 2-D matrix. Put biases, norms, embeddings "
                "and convolutions in an AdamW group (use_muon=False), e.g. with lightning_muon.muon_param_groups."
            )


def _validate_adamw_group(group: dict[str, Any]) -> None:
    _check_nonnegative(group, "lr", "weight_decay", "eps")
    betas = tuple(group["betas"])
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {group['betas']}.")


def _check_nonnegative(group: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = group[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0 or math.isinf(value):
            raise ValueError(f"{key} must be a finite number >= 0, got {value!r}.")
