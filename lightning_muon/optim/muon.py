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

from lightning_muon.optim.distributed import (
    CommStats,
    RefreshItem,
    RowShard,
    flag_ok,
    gather_refresh,
    local_refresh,
    row_shard,
    scatter_refresh,
)
from lightning_muon.optim.kernels import (
    ADJUST_LR_CHOICES,
    DEFAULT_NS_COEFFICIENTS,
    Orthogonalizer,
    compiled_rownorm_kernels,
    default_ns_dtype,
    drift_sums,
    make_orthogonalizer,
    row_norm_dim,
    rownorm_sumsq,
    rownorm_update_,
    scale_,
    shape_factor,
)

__all__ = ["PeriodicRowwiseMuon"]

log = logging.getLogger(__name__)

MUON_KEYS = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "period",
    "rownorm_scale",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "ns_eps",
    "ns_normalize",
    "ns_method",
    "adjust_lr",
    "schedule",
    "drift_threshold",
    "min_period",
    "max_period",
)
ADAMW_KEYS = ("lr", "betas", "momentum", "eps", "weight_decay")
NONFINITE_MODES = ("skip", "raise", "ignore")
SCHEDULES = ("fixed", "adaptive")
#: adaptive-schedule state the host reads every step (never a device synchronization)
HOST_STATE = ("refresh_age", "refresh_drift", "refreshes")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
#: Same-shape matrices are orthogonalized as one batch of at most this many bytes (in the NS dtype).
MAX_NS_BATCH_BYTES = 512 * 2**20


@dataclass
class _Work:
    """One group's step: params with gradients, local views (weights, grads), row shardings (Muon) and mesh
    groups, and the plan: indices that refresh / take RowNorm, RowNorm row sums of squares, which are partial."""

    params: list[Tensor] = field(default_factory=list)
    weights: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    shards: list[RowShard | None] = field(default_factory=list)
    groups_of: list[dist.ProcessGroup | None] = field(default_factory=list)
    refresh: list[int] = field(default_factory=list)
    rownorm: list[int] = field(default_factory=list)
    sumsq: list[Tensor | None] = field(default_factory=list)
    partial: list[bool] = field(default_factory=list)
    early: list[bool] = field(default_factory=list)  # statistics needed before the all-reduce is launched
    drift_parts: list[list[Tensor]] = field(default_factory=list)  # adaptive: sums whose cross-rank total is needed
    drift: list[Tensor | None] = field(default_factory=list)  # adaptive: the step's drift, once reduced


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

    RowNorm normalizes the :math:`\min(m,n)` vectors along the longer axis, so its output has Frobenius norm exactly
    :math:`\sqrt{p}`, :math:`p = \min(m,n)`; NS5 leaves the singular values in roughly [0.7, 1.2], so its output
    is about :math:`0.87\sqrt{p}` (Gaussian matrices; 0.62–0.96 on digits momenta). :math:`\gamma` is therefore
    only roughly the RowNorm step's size relative to the refresh step (≈ 1.15γ in RMS; in spectral norm and in
    first-order descent the ratio depends on the momentum's spectrum). ``period=1`` is
    vanilla Muon (``torch.optim.Muon``'s update). Groups with ``use_muon=False`` run AdamW (``torch.optim.AdamW``'s
    update). The step counter :math:`t` is one per param group (``group["step"]``, an int saved with the optimizer
    state): all matrices of a group refresh on the same steps, and a resumed run takes the same branch sequence.
    ``step()`` may overwrite ``p.grad`` (RowNorm steps write the Nesterov look-ahead into it).

    Non-finite gradients (``nonfinite``): ``"skip"`` (default) decides on the device whether any gradient on any rank
    is NaN/inf and, if so, makes every write of the step an identity — no host synchronization, the verdict riding a
    collective the step runs anyway (the RowNorm statistics all-reduce, or a flag element in the first refresh
    bucket); ``nonfinite_steps_skipped`` reads the on-device count (that read synchronizes). ``"raise"`` raises
    ``FloatingPointError`` naming the parameter before anything is written (one host synchronization per step).
    ``"ignore"`` checks nothing (as torch's optimizers). The verdict is read from the row statistics and gradient
    norms, so a finite gradient whose squares overflow (:math:`|g| \gtrsim 10^{19}` in float32) counts as non-finite:
    RowNorm and AdamW would divide it by an infinite norm. A skipped step still counts in the refresh schedule and in
    AdamW's bias-correction step, so the schedule never waits on the device. AdamW groups are bit-identical to
    ``torch.optim.AdamW`` in every mode on finite steps.

    Args:
        params: parameters or param groups (e.g. from :func:`lightning_muon.muon_param_groups`); a group's
            ``use_muon`` (default ``True``) picks the branch. Named parameters ``(name, tensor)`` give errors names.
        lr: learning rate :math:`\eta` of Muon groups (a float or a 0-d tensor).
        period: :math:`K`, steps between NS5 refreshes (1 = vanilla Muon).
        rownorm_scale: :math:`\gamma`, the RowNorm step relative to the NS5 step.
        momentum: :math:`\beta` in [0, 1). AdamW groups expose their :math:`\beta_1` as ``group["momentum"]`` too
            (what torch's ``OneCycleLR`` / ``CyclicLR`` with ``cycle_momentum`` change); it wins over ``betas[0]``.
        nesterov: use the Nesterov look-ahead :math:`N_t`.
        weight_decay: decoupled weight decay :math:`\lambda` of Muon groups.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: one (a, b, c), a sequence of ``ns_steps`` triples, or a schedule name:
            ``"jordan"`` (the default triple), ``"polar_express"`` (one optimal quintic per iteration) or
            ``"turbo_muon"`` (Polar Express without its first triple, for ``ns_normalize="aol"`` with
            ``ns_steps=4``); see :class:`~lightning_muon.optim.kernels.Orthogonalizer`.
        ns_dtype: NS5 compute dtype (``torch.bfloat16``, ``torch.float32`` or their names); ``None`` picks per
            device with :func:`~lightning_muon.optim.kernels.default_ns_dtype` (bf16 on CUDA and bf16-capable CPUs).
        ns_eps: stabilizer of the NS5 normalization and of RowNorm (> 0).
        ns_normalize: ``"frobenius"`` (default, as torch.optim.Muon) or ``"aol"`` (Turbo-Muon's AOL rescaling,
            no extra matmul: closer to orthogonal before the first iteration, so one fewer iteration serves).
        ns_method: ``"standard"`` (default) or ``"gram"``: the Gram-space iteration on min(m, n)² matrices for
            rectangular matrices where it needs fewer FLOPs (≈ 0.6-0.7x at 4:1 and 6:1), equal in exact arithmetic.
        adjust_lr: shape factor :math:`s(m, n)`: ``"original"``, ``"match_rms_adamw"`` or ``"spectral_unclamped"``.
        schedule: when matrices refresh. ``"fixed"`` (default): every ``period`` steps, all matrices of a group
            together (layer-wise K and γ: give groups their own ``period`` / ``rownorm_scale``, e.g. through
            ``muon_param_groups(overrides={"attention": {"period": 2}})``). ``"adaptive"``: each matrix on its own,
            when the drift :math:`1 - \frac1p\sum_i \cos(n_i, r_i)` of the oriented rows of its look-ahead N from
            those of the look-ahead at its last refresh passed ``drift_threshold`` on the previous step (measured on
            RowNorm steps from sums that ride the statistics all-reduce: identical on every rank, no extra
            collective), bounded by ``min_period`` and ``max_period`` (``None``: ``period``) steps between refreshes.
            Adaptive matrices keep one more shard-sized buffer (that reference) and host counters, all checkpointed;
            :meth:`refresh_counts` reads how often each refreshed.
        drift_threshold / min_period / max_period: the adaptive schedule's bounds (above).
        adamw_lr: default lr of AdamW groups (``None``: ``lr``).
        betas: AdamW :math:`(\beta_1, \beta_2)`.
        eps: AdamW epsilon.
        adamw_weight_decay: default weight decay of AdamW groups (``None``: ``weight_decay``).
        nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"`` (above).
        foreach: multi-tensor elementwise kernels (``None``: on).
        fused: compile the RowNorm step (row statistics, momentum, weight decay, update) with ``torch.compile`` into
            two passes per matrix: ~4x less elementwise time on CPU, but the first step compiles (seconds to a
            minute, cached on disk afterwards) and needs a C++ compiler on CPU / triton on CUDA.
        refresh: how refresh steps get full matrices of FSDP2-sharded (DTensor) parameters. ``"scatter"`` (default):
            one owner rank per matrix runs NS5 once, shards and rows travel by all-to-all — NS5 work per rank ≈ 1/W,
            the same bytes on the wire as gathering, and the faster mode at every world size measured
            (``benchmarks/distributed_step.py``). ``"gather"``: bucketed all-gather, NS5 on every rank (the paper).
            Both write each bucket's update as soon as it is orthogonalized: extra memory ≈ a few buckets.
        bucket_mb: refresh bucket size in MiB (full matrices in the NS dtype).

    Attributes:
        last_branches: how many matrices took each branch in the last step, ``{"refresh": int, "rownorm": int}``.
        nonfinite_steps_skipped: steps skipped for non-finite gradients (``nonfinite="skip"``; reading syncs).
        last_ns_flops: NS5 FLOPs this rank ran in the last step.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float | Tensor = 0.02,
        period: int = 3,
        rownorm_scale: float = 0.15,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Sequence[float] | Sequence[Sequence[float]] = DEFAULT_NS_COEFFICIENTS,
        ns_dtype: torch.dtype | str | None = None,
        ns_eps: float = 1e-7,
        ns_normalize: str = "frobenius",
        ns_method: str = "standard",
        adjust_lr: str = "original",
        schedule: str = "fixed",
        drift_threshold: float = 0.05,
        min_period: int = 1,
        max_period: int | None = None,
        adamw_lr: float | Tensor | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        nonfinite: str = "skip",
        foreach: bool | None = None,
        fused: bool = False,
        refresh: str = "scatter",
        bucket_mb: float = 64.0,
    ) -> None:
        if refresh not in ("gather", "scatter"):
            raise ValueError(f"refresh must be 'gather' or 'scatter', got {refresh!r}.")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}.")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}.")
        self.refresh_mode, self.bucket_mb, self.nonfinite = refresh, bucket_mb, nonfinite
        self._muon_defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            period=period,
            rownorm_scale=rownorm_scale,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            ns_eps=ns_eps,
            ns_normalize=ns_normalize,
            ns_method=ns_method,
            adjust_lr=adjust_lr,
            schedule=schedule,
            drift_threshold=drift_threshold,
            min_period=min_period,
            max_period=max_period,
        )
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        )
        self.foreach = True if foreach is None else foreach
        self.fused = fused
        self.last_branches = {"refresh": 0, "rownorm": 0}
        self.last_ns_flops = 0
        self._skipped: Tensor | None = None
        self._drift_ready: dict[int, Any] = {}
        self._comm = CommStats()
        # "momentum" in the defaults tells torch's cyclic schedulers to cycle group["momentum"] (see ``momentum``)
        super().__init__(params, {"use_muon": True, "momentum": momentum})

    # ----------------------------------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; missing options are filled from the constructor values of its branch, then validated."""
        use_muon = param_group.setdefault("use_muon", True)
        if use_muon not in (True, False):
            raise ValueError(f"use_muon must be True or False, got {use_muon!r}.")
        allowed = {"params", "param_names", "use_muon", "step", *(MUON_KEYS if use_muon else ADAMW_KEYS)}
        unknown = sorted(set(param_group) - allowed)
        if unknown:
            branch = "Muon" if use_muon else "AdamW"
            raise ValueError(f"Unknown option(s) {unknown} for a {branch} group; allowed: {sorted(allowed)}.")
        for key, value in (self._muon_defaults if use_muon else self._adamw_defaults).items():
            param_group.setdefault(key, value)
        if not use_muon:
            param_group.setdefault("momentum", tuple(param_group["betas"])[0])
        param_group.setdefault("step", 0)
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
        self.__dict__.setdefault("nonfinite", "skip")
        self.__dict__.setdefault("foreach", True)
        self.__dict__.setdefault("fused", False)
        self.__dict__.setdefault("_skipped", None)
        self.__dict__.setdefault("_drift_ready", {})
        self.__dict__.setdefault("last_branches", {"refresh": 0, "rownorm": 0})
        self.__dict__.setdefault("last_ns_flops", 0)
        self.__dict__.setdefault("_comm", CommStats())
        self.__dict__.setdefault("refresh_mode", "scatter")
        self.__dict__.setdefault("bucket_mb", 64.0)
        for group in self.param_groups:
            _fill_group_defaults(group)

    @property
    def nonfinite_steps_skipped(self) -> int:
        """Steps skipped for a non-finite gradient (``nonfinite="skip"``); reading it synchronizes with the device."""
        return 0 if self._skipped is None else int(self._skipped)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict after checking all of it — the parameter layout, every group's hyperparameters (a
        foreign optimizer's, e.g. ``torch.optim.Muon``'s, lack ``period`` / ``rownorm_scale``), state shapes and
        finiteness — on copies: a rejected state dict leaves this optimizer as it was.

        Raises:
            ValueError: naming the first group or parameter whose branch, hyperparameter or state shape is wrong.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise ValueError("Not an optimizer state dict: expected a dict with a 'param_groups' list and 'state'.")
        self._check_layout(state_dict)
        for g, (saved, group) in enumerate(zip(state_dict["param_groups"], self.param_groups)):
            _check_saved_group(g, {**saved, "params": group["params"]})
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch moves loaded state to the parameter's device; these stay on the host
            for key in HOST_STATE:
                if key in state:
                    state[key] = state[key].cpu()
        for group in self.param_groups:
            _fill_group_defaults(group)
            group["step"] = int(group["step"])  # a distributed checkpoint may hand back a tensor
            (_validate_muon_group if group["use_muon"] else _validate_adamw_group)(group)  # ns_dtype by name

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
                raise ValueError(
                    f"Param group {g} has use_muon={group['use_muon']} but was saved with "
                    f"use_muon={saved.get('use_muon', True)}. " + hint
                )
            for i, (index, param) in enumerate(zip(saved["params"], group["params"])):
                for key, value in state_dict.get("state", {}).get(index, {}).items():
                    if isinstance(value, Tensor) and value.ndim > 0 and value.shape != param.shape:
                        raise ValueError(
                            f"Saved state {key!r} of {_param_name(group, i)} has shape {tuple(value.shape)}, "
                            f"the parameter has shape {tuple(param.shape)}. " + hint
                        )
                    if isinstance(value, Tensor) and value.is_floating_point() and not _all_finite(value):
                        raise ValueError(
                            f"Saved state {key!r} of {_param_name(group, i)} is not finite (NaN/inf): "
                            "the checkpoint is corrupt; resume from an earlier one."
                        )

    def _collect(self, group: dict[str, Any]) -> _Work:
        """Params with gradients, local views of them, their row sharding; creates missing state (zeros)."""
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
                if group["use_muon"]:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["schedule"] == "adaptive":  # host counters (as AdamW's step) and the last refresh's N
                        state["refresh_momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["refresh_age"] = torch.tensor(-1, dtype=torch.int64)
                        state["refresh_drift"] = torch.tensor(0.0, dtype=torch.float32)
                        state["refreshes"] = torch.tensor(0, dtype=torch.int64)
                else:  # as torch.optim.AdamW: a CPU step count, so bias corrections are host floats
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            work.params.append(p)
            work.weights.append(_local(p))
            work.grads.append(_local(p.grad))
            work.shards.append(row_shard(p) if group["use_muon"] else None)
            work.groups_of.append(_mesh_group(p))
        return work

    def _plan(self, group: dict[str, Any], work: _Work) -> None:
        """All matrices of a group refresh on the same steps, ``(t - 1) mod K == 0`` with the group's counter."""
        if not group["use_muon"] or not work.params:
            return
        index = list(range(len(work.params)))
        if group["schedule"] == "adaptive":
            due = {i for i in index if self._due(group, self.state[work.params[i]])}
            work.refresh, work.rownorm = sorted(due), [i for i in index if i not in due]
        else:
            refresh = group["step"] % group["period"] == 0
            work.refresh, work.rownorm = (index, []) if refresh else ([], index)
        work.partial = [row_norm_dim(work.shards[i].shape) == -2 and work.shards[i].sharded for i in work.rownorm]
        adaptive = group["schedule"] == "adaptive"
        work.early = [part or (adaptive and work.shards[i].sharded) for i, part in zip(work.rownorm, work.partial)]
        work.sumsq = [None] * len(work.rownorm)
        work.drift_parts = [[] for _ in work.rownorm]
        work.drift = [None] * len(work.rownorm)

    def _due(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        r"""Adaptive schedule: refresh when never refreshed, when ``max_period`` steps have passed, or when at least
        ``min_period`` have and the drift measured on the last step passed ``drift_threshold`` (host values: the
        drift was copied to the host on the step it was measured)."""
        age = int(state["refresh_age"])
        if age < 0 or age >= _max_period(group):
            return True
        if age < group["min_period"]:
            return False
        ready = self._drift_ready.pop(id(state), None)
        if ready is not None:
            ready.synchronize()
        return float(state["refresh_drift"]) > group["drift_threshold"]

    def _row_statistics(self, works: list[_Work], early: bool | None) -> None:
        """Read-only: Σ N² along each RowNorm matrix's reduction axis, for the matrices needed before the all-reduce
        (``early``), the others, or (None) all; adaptive matrices also their drift sums (:func:`drift_sums`)."""
        sumsq_fn = compiled_rownorm_kernels()[0] if self.fused else rownorm_sumsq
        for group, work in zip(self.param_groups, works):
            for j, (i, first) in enumerate(zip(work.rownorm, work.early)):
                if early is not None and first != early:
                    continue
                state = self.state[work.params[i]]
                buf, dim = _local(state["momentum_buffer"]), row_norm_dim(work.shards[i].shape)
                beta, nesterov = group["momentum"], group["nesterov"]
                if group["schedule"] != "adaptive":
                    work.sumsq[j] = sumsq_fn(buf, work.grads[i], beta, nesterov, dim)
                    continue
                ref = _local(state["refresh_momentum"])
                work.sumsq[j], dot, rr = drift_sums(buf, work.grads[i], ref, beta, nesterov, dim)
                # tall: per-column sums, partial over ranks; wide: whole rows, so the cosines add up here
                work.drift_parts[j] = [dot, rr] if dim == -2 else [_cosines(dot, work.sumsq[j], rr).sum()]

    def _finish_drift(self, works: list[_Work]) -> None:
        r"""Drift of each adaptive RowNorm matrix from its reduced sums: :math:`1 - \frac1p\sum_i \cos(n_i, r_i)`
        over the p oriented rows of N (the look-ahead) and R (the look-ahead of the last refresh)."""
        for work in works:
            for j, (i, parts) in enumerate(zip(work.rownorm, work.drift_parts)):
                if parts:
                    m, n = work.shards[i].shape
                    total = _cosines(parts[0], work.sumsq[j], parts[1]).sum() if len(parts) == 2 else parts[0]
                    work.drift[j] = 1 - total.float() / min(m, n)

    def _local_flag(self, works: list[_Work]) -> Tensor:
        """0 when every local gradient is finite, else NaN (float32, on the device): RowNorm matrices through their
        row statistics (already read), every other gradient through one multi-tensor norm."""
        stats = [sq.sum() for w in works for sq in w.sumsq if sq is not None]
        rest = [g for w in works for i, g in enumerate(w.grads) if i not in set(w.rownorm)]
        probes = stats + (list(torch._foreach_norm(rest)) if rest else [])
        device = next((g.device for w in works for g in w.grads), torch.device("cpu"))
        probe = torch.stack([p.float() for p in probes]).sum() if probes else torch.zeros((), device=device)
        return torch.where(probe.isfinite(), 0.0, float("nan")).to(device)

    def _statistics_and_verdict(self, works: list[_Work], rides_refresh: bool) -> tuple[Tensor | None, Tensor | None]:
        """Row statistics completed across ranks, and the step's non-finite verdict.

        Returns ``(ok, flag)``: ``ok`` a 0-d bool device tensor shared by all ranks (None when nothing is checked, or
        when ``flag`` — this rank's local verdict — rides the refresh pass instead). Sharded: at most ONE all-reduce,
        carrying every partial column-sum vector of tall matrices and the flag; none when no matrix has split rows
        and nothing is checked (or the flag rides the refresh's collectives).
        """
        checking = self.nonfinite != "ignore"
        partials_exist = any(any(w.early) for w in works)
        group = next((pg for w in works for pg in w.groups_of if pg is not None), None)
        if group is None or not (partials_exist or checking):
            self._row_statistics(works, early=None)
            self._finish_drift(works)
            return (flag_ok(self._local_flag(works)) if checking else None), None
        if checking:
            self._row_statistics(works, early=None)  # every gradient is read once, for statistics and the flag
            flag = self._local_flag(works)
            if rides_refresh and not partials_exist:
                self._finish_drift(works)
                return None, flag
        else:
            self._row_statistics(works, early=True)
        partials = [
            t
            for w in works
            for sq, part, first, parts in zip(w.sumsq, w.partial, w.early, w.drift_parts)
            for t in ([sq] if part else []) + (parts if first else [])
        ]
        extra = [flag.reshape(1)] if checking else []
        flat = torch.cat([t.reshape(-1).float() for t in partials] + extra)
        handle = dist.all_reduce(flat, group=group, async_op=True)
        branch = "rownorm" if any(w.rownorm for w in works) else "refresh"
        self._comm.add(branch, flat.numel() * flat.element_size(), flat.numel() * flat.element_size())
        if not checking:
            self._row_statistics(works, early=False)  # overlapped with the all-reduce
        handle.wait()
        for t, reduced in zip(partials, flat[: flat.numel() - len(extra)].split([t.numel() for t in partials])):
            t.copy_(reduced.view_as(t))
        self._finish_drift(works)
        return (flag_ok(flat[-1:]) if checking else None), None

    def _raise_if_nonfinite(self, works: list[_Work], ok: Tensor) -> None:
        """``nonfinite="raise"``: one host synchronization; the error names a parameter whose gradient is NaN/inf or
        whose sum of squares overflows (the statistics the verdict is read from)."""
        if bool(ok):
            return
        culprit = "Non-finite (NaN or inf) or overflowing gradient in a parameter on another rank"
        for group, w in zip(self.param_groups, works):
            names = {id(p): _param_name(group, i) for i, p in enumerate(group["params"])}
            bad = next((p for p, g in zip(w.params, w.grads) if not _all_finite(g)), None)
            sums = [_local(g).float().square().sum() for g in w.grads]
            big = next((p for p, sq in zip(w.params, sums) if not _all_finite(sq)), None)
            if bad is not None or big is not None:
                culprit = (
                    f"Non-finite (NaN or inf) gradient in {names[id(bad)]}"
                    if bad is not None
                    else f"Gradient of {names[id(big)]} is finite, but its squares overflow float32 (|g| > ~1e19)"
                )
                break
        raise FloatingPointError(
            f"{culprit}. Lower the learning rate, enable gradient clipping or loss scaling, or use nonfinite='skip' "
            "to skip such steps."
        )

    # ---------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step (all groups; every write an identity when a gradient is non-finite and
        ``nonfinite="skip"``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        works = [self._collect(group) for group in self.param_groups]
        for group, work in zip(self.param_groups, works):
            self._plan(group, work)
        items = [it for group, work in zip(self.param_groups, works) for it in self._refresh_items(group, work)]
        sharded_items = [it for it in items if it.shard.sharded]
        ok, flag = self._statistics_and_verdict(works, rides_refresh=bool(sharded_items))
        raising = self.nonfinite == "raise"
        if raising and ok is not None:
            self._raise_if_nonfinite(works, ok)
        on_verdict = (lambda verdict: self._raise_if_nonfinite(works, verdict)) if raising else None
        self.last_ns_flops = 0
        if sharded_items:
            run = gather_refresh if self.refresh_mode == "gather" else scatter_refresh
            ok, flops = run(
                sharded_items, _orthogonalize_items, int(self.bucket_mb * 2**20), self._comm, ok, flag, on_verdict
            )
            self.last_ns_flops += flops
        masked = ok if self.nonfinite == "skip" else None
        local_items = [it for it in items if not it.shard.sharded]
        if local_items:
            self.last_ns_flops += local_refresh(local_items, _orthogonalize_items, int(self.bucket_mb * 2**20), masked)
        self.last_branches = {"refresh": len(items), "rownorm": sum(len(w.rownorm) for w in works)}
        for group, work in zip(self.param_groups, works):
            if work.params and group["use_muon"]:
                self._rownorm(group, work, masked)
                if group["schedule"] == "adaptive":
                    self._advance_schedule(group, work, masked)
            elif work.params:
                self._adamw_step(group, work, masked)
            if work.params:
                group["step"] += 1
        if masked is not None:
            if self._skipped is None:
                self._skipped = torch.zeros((), dtype=torch.int64, device=masked.device)
            self._skipped += (~masked).long()
        return loss

    def _advance_schedule(self, group: dict[str, Any], work: _Work, ok: Tensor | None) -> None:
        """Adaptive schedule after the step: refreshed matrices keep their look-ahead N as the new reference (age 1,
        drift 0); the others age by one and hand their measured drift to the host (asynchronously on CUDA: read at
        the next step's plan). A skipped step keeps the old reference and drift."""
        for i in work.refresh:
            state = self.state[work.params[i]]
            ref, buf, grad = _local(state["refresh_momentum"]), _local(state["momentum_buffer"]), work.grads[i]
            n = torch.lerp(grad, buf, group["momentum"]) if group["nesterov"] else buf  # buf already holds M_t
            ref.copy_(n if ok is None else torch.where(ok, n, ref))
            state["refresh_age"].fill_(1)
            state["refresh_drift"].zero_()
            state["refreshes"].add_(1)
        for i, drift in zip(work.rownorm, work.drift):
            state = self.state[work.params[i]]
            state["refresh_age"].add_(1)
            if ok is not None:
                drift = torch.where(ok, drift, state["refresh_drift"].to(drift.device))
            if drift.is_cuda:
                host = torch.empty((), dtype=torch.float32, pin_memory=True)
                host.copy_(drift, non_blocking=True)
                self._drift_ready[id(state)] = event = torch.cuda.Event()
                event.record()
                state["refresh_drift"] = host
            else:
                state["refresh_drift"].copy_(drift)

    def refresh_counts(self) -> dict[str, int]:
        """Refreshes so far: ``"group<i>"`` the total over the matrices of Muon group i, and every matrix by name
        (adaptive groups: its own counter; fixed: the refresh steps of its group). Host values: no synchronization."""
        counts = {}
        for g, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            names = group.get("param_names") or [f"group{g}.{i}" for i in range(len(group["params"]))]
            fixed = 0 if group["step"] == 0 else (group["step"] - 1) // group["period"] + 1
            per_matrix = {
                name: int(self.state[p]["refreshes"]) if "refreshes" in self.state.get(p, {}) else fixed
                for name, p in zip(names, group["params"])
            }
            counts[f"group{g}"] = sum(per_matrix.values())
            counts.update(per_matrix)
        return counts

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes sent / received and collectives issued by this rank per branch (``"refresh"``, ``"rownorm"``)
        since the last call. The per-step all-reduce counts under ``"rownorm"`` when any matrix took RowNorm."""
        return self._comm.pop()

    def _scales(self, group: dict[str, Any], shape: tuple[int, int]) -> tuple[float | Tensor, float | Tensor]:
        """``(decay, -lr·s(m,n))`` of a matrix: floats, or 0-d tensors with a tensor lr."""
        lr = group["lr"]
        return 1 - lr * group["weight_decay"], -lr * shape_factor(shape, group["adjust_lr"])

    def _refresh_items(self, group: dict[str, Any], work: _Work) -> list[RefreshItem]:
        if not work.refresh:
            return []
        ortho = _orthogonalizer(group, _ns_dtype(group, work.weights[0].device))
        items = []
        for i in work.refresh:
            decay, scale = self._scales(group, work.shards[i].shape)
            buf = _local(self.state[work.params[i]]["momentum_buffer"])
            items.append(
                RefreshItem(
                    work.shards[i],
                    work.weights[i],
                    buf,
                    work.grads[i],
                    group["momentum"],
                    group["nesterov"],
                    decay,
                    scale,
                    ortho,
                )
            )
        return items

    def _rownorm(self, group: dict[str, Any], work: _Work, ok: Tensor | None) -> None:
        """W ← W(1 - lr·wd) - lr·γ·s·RowNorm(N) with the planned row statistics, one fused pass per matrix."""
        update_fn = compiled_rownorm_kernels()[1] if self.fused else rownorm_update_
        for i, sumsq in zip(work.rownorm, work.sumsq):
            decay, scale = self._scales(group, work.shards[i].shape)
            buf = _local(self.state[work.params[i]]["momentum_buffer"])
            update_fn(
                work.weights[i],
                buf,
                work.grads[i],
                sumsq,
                group["momentum"],
                group["nesterov"],
                decay,
                scale * group["rownorm_scale"],
                group["ns_eps"],
                ok,
            )

    def _adamw_step(self, group: dict[str, Any], work: _Work, ok: Tensor | None) -> None:
        """Decoupled-weight-decay Adam, op for op as ``torch.optim.AdamW`` (bit-identical on finite steps), on local
        shards. With a device verdict ``ok``, three ``torch.where`` make a skipped step an identity."""
        params, grads = work.weights, work.grads
        states = [self.state[p] for p in work.params]
        exp_avgs = [_local(s["exp_avg"]) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
        steps = [s["step"] for s in states]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = _scalar(group["momentum"]), _scalar(tuple(group["betas"])[1])
        group["betas"] = (beta1, beta2)  # momentum (what cyclic schedulers change) is beta1
        lerp_to, sq_of, moment = grads, grads, exp_avgs
        if ok is not None:
            lerp_to = [torch.where(ok, g, m) for g, m in zip(grads, exp_avgs)]  # lerp(m, m) = m
            sq_of = [torch.where(ok, g, 0) for g in grads]  # v·1 + (1-β2)·0·0 = v
        _add_(steps, 1.0, self.foreach)
        if wd != 0:
            decay = 1 - lr * wd
            scale_(params, decay, ok)
        _lerp_(exp_avgs, lerp_to, 1 - beta1, self.foreach)
        scale_(exp_avg_sqs, beta2, ok)
        if self.foreach:
            torch._foreach_addcmul_(exp_avg_sqs, sq_of, sq_of, 1 - beta2)
        else:
            for v, g in zip(exp_avg_sqs, sq_of):
                v.addcmul_(g, g, value=1 - beta2)
        if ok is not None:
            moment = [torch.where(ok, m, 0) for m in exp_avgs]  # the weight moves by step_size · 0 / denom
        step_size = [-lr / (1 - beta1 ** t.item()) for t in steps]  # CPU step counts: no device sync
        bias_correction2_sqrt = [(1 - beta2 ** t.item()) ** 0.5 for t in steps]
        if self.foreach and not isinstance(lr, Tensor):
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, moment, denom, step_size)
        else:
            for p, m, v, size, bc2 in zip(params, moment, exp_avg_sqs, step_size, bias_correction2_sqrt):
                if isinstance(size, Tensor):
                    p.add_(m / (v.sqrt() / bc2).add_(eps) * size)
                else:
                    p.addcdiv_(m, (v.sqrt() / bc2).add_(eps), value=size)


# ------------------------------------------------------------------------------------------------------- helpers
def _lerp_(xs: list[Tensor], ys: list[Tensor], weight: float, foreach: bool) -> None:
    if foreach:
        torch._foreach_lerp_(xs, ys, weight)
    else:
        for x, y in zip(xs, ys):
            x.lerp_(y, weight)


def _add_(xs: list[Tensor], value: float, foreach: bool) -> None:
    if foreach:
        torch._foreach_add_(xs, value)
    else:
        for x in xs:
            x.add_(value)


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view: in-place ops update the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _orthogonalize_items(matrices: list[Tensor], items: Sequence[RefreshItem]) -> list[Tensor]:
    """Orthogonalize each matrix with its item's :class:`Orthogonalizer`; same-shape matrices with equal ones are
    stacked (cast in the same copy) into batched calls."""
    results: list[Tensor | None] = [None] * len(matrices)
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, (x, item) in enumerate(zip(matrices, items)):
        buckets[(tuple(x.shape), x.device, item.ortho)].append(i)
    for (shape, device, ortho), index in buckets.items():
        per_batch = max(1, MAX_NS_BATCH_BYTES // max(1, math.prod(shape) * ortho.dtype.itemsize))
        for start in range(0, len(index), per_batch):
            chunk = index[start : start + per_batch]
            X = torch.empty((len(chunk), *shape), dtype=ortho.dtype, device=device)
            for j, i in enumerate(chunk):
                X[j].copy_(matrices[i])
            for i, o in zip(chunk, ortho(X).unbind(0)):
                results[i] = o
    return results


def _mesh_group(p: Tensor) -> dist.ProcessGroup | None:
    """The process group a DTensor parameter is sharded over (None for plain or replicated tensors)."""
    if not isinstance(p, DTensor):
        return None
    dims = [i for i, placement in enumerate(p.placements) if placement.is_shard()]
    return p.device_mesh.get_group(dims[0]) if dims else None


def _all_finite(t: Tensor) -> bool:
    """Host check (synchronizes): every entry of the local tensor is finite."""
    return bool(torch.isfinite(_local(t)).all())


def _param_name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    shape = tuple(group["params"][index].shape)
    return f"parameter {names[index]!r} {shape}" if names else f"parameter {index} {shape} of its group"


def _ns_dtype(group: dict[str, Any], device: torch.device) -> torch.dtype:
    return default_ns_dtype(device) if group["ns_dtype"] is None else NS_DTYPES[group["ns_dtype"]]


def _max_period(group: dict[str, Any]) -> int:
    return group["period"] if group["max_period"] is None else group["max_period"]


def _cosines(dot: Tensor, nn: Tensor, rr: Tensor) -> Tensor:
    """Cosines of oriented rows from their sums N·R, N², R² (0 where either row is zero)."""
    return dot / (nn * rr).sqrt().clamp_min(1e-30)


def _orthogonalizer(group: dict[str, Any], dtype: torch.dtype) -> Orthogonalizer:
    """The group's refresh orthogonalizer (raises ValueError naming a bad ``ns_*`` option)."""
    return make_orthogonalizer(
        group["ns_coefficients"], group["ns_steps"], group["ns_eps"], dtype, group["ns_normalize"], group["ns_method"]
    )


#: group options without a default for state dicts saved before they existed
REQUIRED_KEYS = {
    True: ("lr", "momentum", "nesterov", "weight_decay", "period", "rownorm_scale", "ns_steps", "adjust_lr"),
    False: ("lr", "betas", "eps", "weight_decay"),
}


def _fill_group_defaults(group: dict[str, Any]) -> None:
    """Options added after a state dict was saved take their defaults (``__setstate__`` and ``load_state_dict``)."""
    group.setdefault("use_muon", True)
    group.setdefault("step", 0)
    if group["use_muon"]:
        defaults = dict(ns_eps=1e-7, ns_coefficients=DEFAULT_NS_COEFFICIENTS, ns_dtype=None, ns_normalize="frobenius")
        defaults.update(ns_method="standard", schedule="fixed", drift_threshold=0.05, min_period=1, max_period=None)
        for key, value in defaults.items():
            group.setdefault(key, value)
    elif isinstance(group.get("betas"), (tuple, list)) and group["betas"]:
        group.setdefault("momentum", group["betas"][0])


def _check_saved_group(index: int, group: dict[str, Any]) -> None:
    """Validate a copy of a saved param group (with this optimizer's params) before anything is loaded."""
    use_muon = group.get("use_muon", True)
    missing = sorted(set(REQUIRED_KEYS[bool(use_muon)]) - set(group))  # extra keys are allowed: lr schedulers add some
    if missing:
        raise ValueError(
            f"Param group {index} of the state dict lacks {missing}: it was not saved by PeriodicRowwiseMuon "
            "(torch.optim.Muon's has no period or rownorm_scale). Load a state dict this optimizer saved, or start "
            "the optimizer fresh."
        )
    _fill_group_defaults(group)
    step = group["step"]
    step = int(step) if isinstance(step, Tensor) and step.numel() == 1 and not step.is_floating_point() else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"Param group {index} was saved with step={step!r}; expected an integer >= 0.")
    try:
        (_validate_muon_group if use_muon else _validate_adamw_group)(group)
    except (ValueError, TypeError) as err:
        raise ValueError(f"Param group {index} of the loaded state: {err}") from err


def _validate_muon_group(group: dict[str, Any]) -> None:
    """Check a Muon group's options and parameters; stores ``ns_dtype`` by name ("bfloat16", ...)."""
    _check_nonnegative(group, "lr", "weight_decay", "rownorm_scale", "ns_eps")
    if not group["ns_eps"] > 0:
        raise ValueError(f"ns_eps must be > 0 (NS5 and RowNorm of a zero matrix stay finite), got {group['ns_eps']}.")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}.")
    period = group["period"]
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period (K) must be an integer >= 1 (1 = vanilla Muon), got {period!r}.")
    if group["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {group['schedule']!r}.")
    if group["schedule"] == "adaptive":
        low, high = group["min_period"], _max_period(group)
        if any(isinstance(k, bool) or not isinstance(k, int) for k in (low, high)) or not 1 <= low <= high:
            raise ValueError(
                f"The adaptive schedule needs integers 1 <= min_period <= max_period, got min_period={low!r} and "
                f"max_period={group['max_period']!r} (None: period={period!r})."
            )
        if not 0.0 < group["drift_threshold"] < 2.0:
            raise ValueError(f"drift_threshold must be in (0, 2) (1 - cosine), got {group['drift_threshold']!r}.")
    if group["adjust_lr"] not in ADJUST_LR_CHOICES:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {group['adjust_lr']!r}.")
    _orthogonalizer(group, torch.float32)
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
    """Check an AdamW group's options (betas as torch.optim.AdamW takes them: two floats or two 1-element tensors)."""
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be two values in [0, 1), got {betas!r}.")
    if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
        raise ValueError("betas must be either both floats or both Tensors.")
    if isinstance(betas[0], Tensor) and not all(b.numel() == 1 for b in betas):
        raise ValueError("Tensor betas must be 1-element.")
    if not all(0.0 <= _scalar(b) < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas!r}.")
    _check_nonnegative(group, "lr", "weight_decay", "eps", "momentum")


def _scalar(x: float | Tensor) -> float:
    """A Python number from a float or a 1-element tensor (a tensor beta: read once per step, as torch's AdamW)."""
    return x.item() if isinstance(x, Tensor) else x


def _check_nonnegative(group: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = group[key]
        if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)  # a tensor lr (checked once, here)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0 or math.isinf(value):
            raise ValueError(f"{key} must be a finite number >= 0, got {value!r}.")
