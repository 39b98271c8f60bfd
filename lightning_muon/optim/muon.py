"""Periodic Row-wise Muon: NS5 every K steps, RowNorm of the momentum in between, AdamW for everything else."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_muon.optim.distributed import CommStats, RowShard, gather_orthogonalize, row_shard, scatter_orthogonalize
from lightning_muon.optim.kernels import (
    ADJUST_LR_CHOICES,
    DEFAULT_NS_COEFFICIENTS,
    compiled_rownorm_kernels,
    default_ns_dtype,
    newton_schulz_,
    ns_flops,
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
class _Work:
    """One group's step: params with gradients, local views (weights, grads), row shardings, and the plan:
    indices that refresh / take RowNorm, RowNorm row sums of squares, and which of those are partial (per rank)."""

    params: list[Tensor] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    shards: list[RowShard] = field(default_factory=list)
    refresh: list[int] = field(default_factory=list)
    rownorm: list[int] = field(default_factory=list)
    sumsq: list[Tensor | None] = field(default_factory=list)
    partial: list[bool] = field(default_factory=list)


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
        refresh: how refresh steps get full matrices of FSDP2-sharded (DTensor) parameters: ``"gather"`` (bucketed
            all-gather, NS5 on every rank, as the paper) or ``"scatter"`` (one owner rank per matrix, NS5 once).
        bucket_mb: all-gather bucket size in MiB for ``refresh="gather"``.

    Attributes:
        last_branches: how many matrices took each branch in the last step, ``{"refresh": int, "rownorm": int}``.
        nonfinite_steps_skipped: steps skipped for non-finite gradients (with ``skip_nonfinite=True``).
        last_ns_flops: NS5 FLOPs this rank ran in the last step.
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
        refresh: str = "gather",
        bucket_mb: float = 64.0,
    ) -> None:
        if refresh not in ("gather", "scatter"):
            raise ValueError(f"refresh must be 'gather' or 'scatter', got {refresh!r}.")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}.")
        self.refresh_mode, self.bucket_mb = refresh, bucket_mb
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
        self.last_ns_flops = 0
        self._comm = CommStats()
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
        self.__dict__.setdefault("last_ns_flops", 0)
        self.__dict__.setdefault("_comm", CommStats())
        self.__dict__.setdefault("refresh_mode", "gather")
        self.__dict__.setdefault("bucket_mb", 64.0)
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

    def _collect(self, group: dict[str, Any]) -> _Work:
        """Params with gradients, local views of them, their row sharding; creates missing state (zeros, step 0)."""
        work = _Work()
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
                for key in ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            work.params.append(p)
            work.weights.append(_local(p))
            work.grads.append(_local(p.grad))
            if group["use_muon"]:
                work.shards.append(row_shard(p))
        return work

    def _plan(self, group: dict[str, Any], work: _Work) -> None:
        """Which matrices refresh and which take RowNorm; the latter's row statistics are filled by
        :meth:`_row_statistics` (partial column sums on this rank's rows for tall sharded matrices)."""
        if not group["use_muon"]:
            return
        refresh = [int(self.state[p]["step"].item()) % group["period"] == 0 for p in work.params]  # (t - 1) mod K
        work.refresh = [i for i, r in enumerate(refresh) if r]
        work.rownorm = [i for i, r in enumerate(refresh) if not r]
        work.partial = [row_norm_dim(work.shards[i].shape) == -2 and work.shards[i].sharded for i in work.rownorm]
        work.sumsq = [None] * len(work.rownorm)

    def _row_statistics(self, works: list[_Work], partial: bool) -> None:
        """Read-only: Σ N² along each RowNorm matrix's reduction axis, for the partial (or the local) ones."""
        sumsq_fn = compiled_rownorm_kernels()[0] if self.fused else rownorm_sumsq
        for group, work in zip(self.param_groups, works):
            for j, (i, part) in enumerate(zip(work.rownorm, work.partial)):
                if part == partial:
                    buf = _local(self.state[work.params[i]]["momentum_buffer"])
                    dim = row_norm_dim(work.shards[i].shape)
                    work.sumsq[j] = sumsq_fn(buf, work.grads[i], group["momentum"], group["nesterov"], dim)

    def _sync_and_check(self, works: list[_Work]) -> str | None:
        """Row statistics, completed across ranks, and one finiteness verdict shared by all ranks.

        Single process: the local statistics of RowNorm matrices (a finite momentum with a non-finite gradient gives a
        non-finite sum of squares) plus one multi-tensor norm of the other gradients, one host sync. Sharded: ONE
        async all-reduce carries every partial column-sum vector of tall matrices and a probe of all other local
        gradients; the statistics of matrices with local rows are computed while it is in flight. Non-finite anywhere
        on any rank makes the buffer non-finite everywhere, so all ranks raise or skip together. Returns the name of
        a parameter with a NaN/inf gradient (``"a parameter on another rank"`` when it is not local), or None.
        """
        device = next((g.device for w in works for g in w.grads), torch.device("cpu"))
        group = next((s.group for w in works for s in w.shards if s.sharded), None)
        partial_rows = {(k, w.rownorm[j]) for k, w in enumerate(works) for j, part in enumerate(w.partial) if part}
        if group is None:
            self._row_statistics(works, partial=False)
            probes = [sq.sum() for w in works for sq in w.sumsq]
            rest = [g for w in works for i, g in enumerate(w.grads) if i not in set(w.rownorm)]
        else:
            self._row_statistics(works, partial=True)
            probes = []
            rest = [g for k, w in enumerate(works) for i, g in enumerate(w.grads) if (k, i) not in partial_rows]
        probes += list(torch._foreach_norm(rest)) if rest else []
        probe = torch.stack(probes).sum().float() if probes else torch.zeros((), device=device)
        if group is None:
            finite = bool(probe.isfinite())
        else:
            partials = [sq for w in works for sq, part in zip(w.sumsq, w.partial) if part]
            flat = torch.cat([t.reshape(-1).float() for t in partials] + [probe.reshape(1)])
            handle = dist.all_reduce(flat, group=group, async_op=True)
            branch = "rownorm" if any(w.rownorm for w in works) else "refresh"
            self._comm.add(branch, flat.numel() * flat.element_size(), flat.numel() * flat.element_size())
            self._row_statistics(works, partial=False)  # overlapped with the all-reduce
            handle.wait()
            finite = bool(flat.isfinite().all())
            for t, reduced in zip(partials, flat[:-1].split([t.numel() for t in partials])):
                t.copy_(reduced.view_as(t))
        if finite:
            return None
        for group_, w in zip(self.param_groups, works):
            names = {id(p): _param_name(group_, i) for i, p in enumerate(group_["params"])}
            for p, g in zip(w.params, w.grads):
                if not bool(g.isfinite().all()):
                    return names[id(p)]
        return "a parameter on another rank" if group is not None else None  # None: a sum of squares overflowed

    # ---------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step (all groups, or none when a gradient is non-finite)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        works = [self._collect(group) for group in self.param_groups]
        for group, work in zip(self.param_groups, works):
            self._plan(group, work)
        bad = self._sync_and_check(works)
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
        self.last_ns_flops = 0
        for group, work in zip(self.param_groups, works):
            if not work.params:
                continue
            if group["use_muon"]:
                self._rownorm(group, work)
                self._refresh(group, work)
                self.last_branches["refresh"] += len(work.refresh)
                self.last_branches["rownorm"] += len(work.rownorm)
                _add_([self.state[p]["step"] for p in work.params], 1.0, self.foreach)
            else:
                self._adamw_step(group, work)
        return loss

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes sent / received and collectives issued by this rank per branch (``"refresh"``, ``"rownorm"``)
        since the last call. The per-step all-reduce counts under ``"rownorm"`` when any matrix took RowNorm."""
        return self._comm.pop()

    def _rownorm(self, group: dict[str, Any], work: _Work) -> None:
        """W ← W(1 - lr·wd) - lr·γ·s·RowNorm(N) with the planned row statistics, one fused pass per matrix."""
        update_fn = compiled_rownorm_kernels()[1] if self.fused else rownorm_update_
        decay = 1 - group["lr"] * group["weight_decay"]
        for i, sumsq in zip(work.rownorm, work.sumsq):
            scale = -group["lr"] * group["rownorm_scale"] * shape_factor(work.shards[i].shape, group["adjust_lr"])
            buf = _local(self.state[work.params[i]]["momentum_buffer"])
            update_fn(work.weights[i], buf, work.grads[i], sumsq, group["momentum"], group["nesterov"], decay, scale,
                      group["ns_eps"])  # fmt: skip

    def _refresh(self, group: dict[str, Any], work: _Work) -> None:
        """Momentum, then W ← W(1 - lr·wd) - lr·s·NS5(N) on full matrices (gathered or sent to owners if sharded)."""
        if not work.refresh:
            return
        weights = [work.weights[i] for i in work.refresh]
        grads = [work.grads[i] for i in work.refresh]
        shards = [work.shards[i] for i in work.refresh]
        bufs = [_local(self.state[work.params[i]]["momentum_buffer"]) for i in work.refresh]
        beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        _lerp_(bufs, grads, 1 - beta, self.foreach)
        if group["nesterov"]:  # N = βM + (1-β)G written over the gradient, which step() consumes
            _lerp_(grads, bufs, beta, self.foreach)
        updates = grads if group["nesterov"] else bufs
        if wd != 0:
            _mul_(weights, 1 - lr * wd, self.foreach)
        dtype = _ns_dtype(group, weights[0].device)

        def orthogonalize(matrices: list[Tensor]) -> list[Tensor]:
            return _orthogonalize(matrices, dtype, group["ns_steps"], group["ns_coefficients"], group["ns_eps"])

        sharded = [j for j, s in enumerate(shards) if s.sharded]
        local = [j for j, s in enumerate(shards) if not s.sharded]
        results: list[Tensor | None] = [None] * len(weights)
        if sharded:
            args = ([updates[j] for j in sharded], [shards[j] for j in sharded], orthogonalize, dtype)
            if self.refresh_mode == "gather":
                out = gather_orthogonalize(*args, int(self.bucket_mb * 2**20), self._comm)
                self.last_ns_flops += sum(ns_flops(shards[j].shape, group["ns_steps"]) for j in sharded)
            else:
                out, flops = scatter_orthogonalize(*args, self._comm, group["ns_steps"])
                self.last_ns_flops += flops
            for j, o in zip(sharded, out):
                results[j] = o
        for j, o in zip(local, orthogonalize([updates[j] for j in local]) if local else []):
            results[j] = o
            self.last_ns_flops += ns_flops(shards[j].shape, group["ns_steps"])
        by_scale: dict[float, list[int]] = defaultdict(list)
        for j, s in enumerate(shards):
            by_scale[-lr * shape_factor(s.shape, group["adjust_lr"])].append(j)
        for scale, index in by_scale.items():
            # the multi-tensor add casts bf16 -> fp32 on the fly (a plain mixed-dtype add_ is ~6x slower)
            torch._foreach_add_([weights[j] for j in index], [results[j] for j in index], alpha=scale)

    def _adamw_step(self, group: dict[str, Any], work: _Work) -> None:
        """Decoupled-weight-decay Adam, op for op as ``torch.optim.AdamW`` (bit-identical results), on local shards."""
        params, grads = work.weights, work.grads
        states = [self.state[p] for p in work.params]
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
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


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view: in-place ops update the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _orthogonalize(
    matrices: list[Tensor], dtype: torch.dtype, steps: int, coefficients: Any, eps: float
) -> list[Tensor]:
    """NS5 of each matrix in ``dtype``; same-shape matrices are stacked (cast in the same copy) into batched calls."""
    results: list[Tensor | None] = [None] * len(matrices)
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, x in enumerate(matrices):
        buckets[(tuple(x.shape), x.device)].append(i)
    for (shape, device), index in buckets.items():
        per_batch = max(1, MAX_NS_BATCH_BYTES // (math.prod(shape) * dtype.itemsize))
        for start in range(0, len(index), per_batch):
            chunk = index[start : start + per_batch]
            X = torch.empty((len(chunk), *shape), dtype=dtype, device=device)
            for j, i in enumerate(chunk):
                X[j].copy_(matrices[i])
            for i, o in zip(chunk, newton_schulz_(X, steps, coefficients, eps).unbind(0)):
                results[i] = o
    return results


def _param_name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    shape = tuple(group["params"][index].shape)
    return f"parameter {names[index]!r} {shape}" if names else f"parameter {index} {shape} of its group"


def _ns_dtype(group: dict[str, Any], device: torch.device) -> torch.dtype:
    return default_ns_dtype(device) if group["ns_dtype"] is None else NS_DTYPES[group["ns_dtype"]]


def _validate_muon_group(group: dict[str, Any]) -> None:
    """Check a Muon group's options and parameters; stores ``ns_dtype`` by name ("bfloat16", ...)."""
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
    names = {v: k for k, v in NS_DTYPES.items()}
    if dtype in names:  # stored by name: distributed checkpoints take strings, not torch.dtype
        group["ns_dtype"] = dtype = names[dtype]
    if dtype is not None and dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {sorted(NS_DTYPES)} (or the torch dtype) or None, got {dtype!r}.")
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
