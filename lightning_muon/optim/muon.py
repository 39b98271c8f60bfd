"""Periodic Row-wise Muon: NS5 every K steps, RowNorm of the momentum in between, AdamW for everything else.

The class is the step's outline; each concept lives in one module it calls, and data flows one way:

- options, defaults, validation: :mod:`~lightning_muon.optim.config`;
- when matrices refresh: :mod:`~lightning_muon.optim.schedules`;
- the non-finite verdict: :mod:`~lightning_muon.optim.nonfinite`;
- the step's plan (which matrices refresh, which take RowNorm; their shards): :mod:`~lightning_muon.optim.plan`;
- the refresh (items, write, single-device pass): :mod:`~lightning_muon.optim.refresh`, sharded through
  :mod:`~lightning_muon.optim.transport` (every collective), both on :mod:`~lightning_muon.optim.kernels`;
- the AdamW branch: :mod:`~lightning_muon.optim.adamw`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_muon.optim.adamw import adamw_step
from lightning_muon.optim.config import (
    LAYOUT_DEFAULTS,
    branch_defaults,
    check_group,
    check_layout,
    check_saved_group,
    check_step_options,
    fill_group_defaults,
    param_name,
    prepare_group,
)
from lightning_muon.optim.fused import compiled_rownorm_kernels
from lightning_muon.optim.kernels import (
    DEFAULT_NS_COEFFICIENTS,
    Coefficients,
    rownorm_update_,
)
from lightning_muon.optim.nonfinite import NonFiniteGradient, culprit, flags_ok, local_flag
from lightning_muon.optim.plan import RowNormItem, Work, plan_group, refresh_items, step_scales
from lightning_muon.optim.refresh import RefreshItem, local_refresh, rownorm_gamma, write_refresh
from lightning_muon.optim.schedules import HOST_STATE, AdaptiveSchedule, FixedSchedule, refresh_counts
from lightning_muon.optim.shards import local, mesh_group
from lightning_muon.optim.transport import CommStats, gather_refresh, owned_flops, scatter_refresh, start_all_reduce

__all__ = ["PeriodicRowwiseMuon"]


class PeriodicRowwiseMuon(Optimizer):
    r"""Periodic Row-wise Muon (arXiv 2608.20818) for 2-D hidden weights, AdamW for all other parameters.

    For a matrix :math:`W \in \mathbb{R}^{m \times n}` with gradient :math:`G_t` at step :math:`t = 1, 2, \dots`:

    .. math::
        M_t &= \beta M_{t-1} + (1-\beta) G_t, \qquad
        N_t = \beta M_t + (1-\beta) G_t \ \text{(nesterov) or } M_t \\
        U_t &= \begin{cases}
            s(m,n)\,\mathrm{NS5}(N_t) & (t-1) \bmod K = 0 \text{ or } t \le t_w \quad\text{(refresh)} \\
            \gamma\, s(m,n)\,\mathrm{RowNorm}(N_t) & \text{otherwise}
        \end{cases} \\
        W &\leftarrow W (1 - \eta\lambda) - \eta U_t

    RowNorm normalizes the :math:`\min(m,n)` vectors along the longer axis, so its output has Frobenius norm exactly
    :math:`\sqrt{p}`, :math:`p = \min(m,n)`; NS5 leaves the singular values in roughly [0.7, 1.2], so its output
    is about :math:`0.87\sqrt{p}` (Gaussian matrices). :math:`\gamma` is therefore only roughly the RowNorm step's
    size relative to the refresh step (≈ 1.15γ in RMS; in spectral norm and in first-order descent the ratio depends
    on the momentum's spectrum). ``period=1`` is vanilla Muon (``torch.optim.Muon``'s update); groups with
    ``use_muon=False`` run AdamW (``torch.optim.AdamW``'s update). The step counter :math:`t` is one per param group
    (``group["step"]``, saved with the state): all matrices of a group refresh on the same steps (``schedule=
    "fixed"``), and a resumed run takes the same branch sequence. ``step()`` may overwrite ``p.grad``.

    Non-finite gradients (``nonfinite``): ``"skip"`` (default) decides on the device whether any gradient on any rank
    is NaN/inf (or its squares overflow float32) and, if so, makes every write of the step an identity — no host
    synchronization, the verdict riding a collective the step runs anyway; ``nonfinite_steps_skipped`` reads the
    count (that read synchronizes). ``"raise"`` raises :class:`~lightning_muon.optim.nonfinite.NonFiniteGradient`
    (a ``FloatingPointError``) naming the parameter before anything is written. ``"ignore"`` checks nothing. A
    skipped step still counts in the refresh schedule and in AdamW's bias correction.

    Args:
        params: parameters or param groups (e.g. from :func:`lightning_muon.muon_param_groups`); a group's
            ``use_muon`` (default ``True``) picks the branch and its keys override the defaults below (Muon groups:
            :class:`~lightning_muon.optim.MuonConfig`, AdamW groups: :class:`~lightning_muon.optim.AdamWConfig`).
            Named parameters ``(name, tensor)`` give errors names.
        lr: learning rate :math:`\eta` of Muon groups (a float or a 0-d tensor).
        period: :math:`K`, steps between NS5 refreshes (1 = vanilla Muon).
        rownorm_scale: :math:`\gamma`, the RowNorm step relative to the NS5 step, or ``"auto"`` / ``"auto_rms"``
            (each matrix calibrates its own at its refreshes).
        momentum: :math:`\beta` in [0, 1).
        nesterov: use the Nesterov look-ahead :math:`N_t`.
        weight_decay: decoupled weight decay :math:`\lambda` of Muon groups.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: one (a, b, c), a sequence of ``ns_steps`` triples, or a schedule name (``"jordan"``,
            ``"polar_express"``, ``"turbo_muon"``).
        ns_dtype: NS5 compute dtype or its name; ``None`` picks per device (bf16 where it is native, else fp32).
        ns_eps: stabilizer of the NS5 normalization and of RowNorm (> 0).
        ns_normalize: ``"frobenius"`` (as torch.optim.Muon) or ``"aol"`` (Turbo-Muon).
        ns_method: ``"standard"`` or ``"gram"`` (Gram-space iteration where it needs fewer FLOPs).
        adjust_lr: shape factor :math:`s(m, n)`: ``"original"``, ``"match_rms_adamw"`` or ``"spectral_unclamped"``.
        schedule: when matrices refresh: ``"fixed"`` (every ``period`` steps) or ``"adaptive"`` (per matrix, on
            momentum drift).
        drift_threshold: the adaptive schedule's drift that triggers a refresh.
        min_period: the adaptive schedule's fewest steps between refreshes.
        max_period: the adaptive schedule's most steps between refreshes (``None``: ``period``).
        auto_scale_multiplier: the tunable factor on a calibrated γ (``rownorm_scale="auto"``).
        refresh_warmup: :math:`t_w`, the first steps that all refresh (K = 1) before either schedule takes over.
        adamw_lr: learning rate of AdamW groups (``None``: ``lr``).
        betas: AdamW's :math:`(\beta_1, \beta_2)`.
        eps: AdamW's :math:`\varepsilon`.
        adamw_weight_decay: weight decay of AdamW groups (``None``: ``weight_decay``).
        nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"`` (above).
        foreach: multi-tensor elementwise kernels (``None``: on).
        fused: compile the RowNorm step with ``torch.compile`` into two passes per matrix (the first step compiles;
            needs a C++ compiler on CPU / triton on CUDA).
        refresh: how refresh steps get full matrices of FSDP2-sharded (DTensor) parameters: ``"scatter"`` (NS5 once
            per matrix on an owner rank, ≈ 1/W of it per rank) or ``"gather"`` (the paper: NS5 on every rank); see
            :mod:`~lightning_muon.optim.transport`.
        bucket_mb: refresh bucket size in MiB (full matrices in the NS dtype).

    Attributes:
        last_branches: how many matrices took each branch in the last step, ``{"refresh": int, "rownorm": int}``.
        nonfinite_steps_skipped: steps skipped for non-finite gradients (``nonfinite="skip"``; reading syncs).
        last_ns_flops: NS5 FLOPs this rank ran in the last step.
        measure_scales: also measure the γ candidates of fixed-γ groups at refreshes (``OptimizerTelemetry`` sets it).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float | Tensor = 0.02,
        period: int = 3,
        rownorm_scale: float | str = 0.15,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
        ns_dtype: torch.dtype | str | None = None,
        ns_eps: float = 1e-7,
        ns_normalize: str = "frobenius",
        ns_method: str = "standard",
        adjust_lr: str = "original",
        schedule: str = "fixed",
        drift_threshold: float = 0.05,
        min_period: int = 1,
        max_period: int | None = None,
        auto_scale_multiplier: float = 1.0,
        refresh_warmup: int = 0,
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
        check_step_options(refresh, nonfinite, bucket_mb)
        self._defaults_of = branch_defaults(locals())
        self.refresh_mode, self.bucket_mb, self.nonfinite = refresh, bucket_mb, nonfinite
        self.foreach, self.fused = (True if foreach is None else foreach), fused
        self.__setstate__({})
        # "momentum" in the defaults tells torch's cyclic schedulers to cycle group["momentum"] (AdamWConfig.momentum)
        super().__init__(params, {"use_muon": True, "momentum": momentum})

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state:
            super().__setstate__(state)
        runtime = dict(nonfinite="skip", foreach=True, fused=False, refresh_mode="scatter", bucket_mb=64.0,
                       measure_scales=False, _skipped=None, last_branches={"refresh": 0, "rownorm": 0},
                       last_ns_flops=0, _comm=CommStats(),
                       _schedules={"fixed": FixedSchedule(), "adaptive": AdaptiveSchedule()})  # fmt: skip
        for key, value in runtime.items():
            self.__dict__.setdefault(key, value)
        for group in self.__dict__.get("param_groups", []):
            fill_group_defaults(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; missing options are filled from the constructor values of its branch, then validated."""
        prepare_group(param_group, self._defaults_of)
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict after checking all of it — the parameter layout, every group's hyperparameters (a
        foreign optimizer's, e.g. ``torch.optim.Muon``'s, lack ``period`` / ``rownorm_scale``), state shapes and
        finiteness — on copies: a rejected state dict leaves this optimizer as it was.

        Raises:
            ValueError: naming the first group or parameter whose branch, hyperparameter or state shape is wrong.
        """
        check_layout(state_dict, self.param_groups)
        self._schedules["adaptive"].forget()
        # which matrices a parameter holds is the model's fact, not a saved hyperparameter (older states lack it)
        layouts = [{key: group[key] for key in LAYOUT_DEFAULTS if key in group} for group in self.param_groups]
        for g, (saved, group, layout) in enumerate(zip(state_dict["param_groups"], self.param_groups, layouts)):
            changed = sorted(key for key, value in layout.items() if saved.get(key, value) != value)
            if changed:
                was, now = {k: saved[k] for k in changed}, {k: layout[k] for k in changed}
                raise ValueError(
                    f"Param group {g} was saved with {was}, this one has {now}: the checkpoint belongs to another "
                    "parameter grouping."
                )
            check_saved_group(g, {**saved, "params": group["params"], **layout})
        super().load_state_dict(state_dict)
        for group, layout in zip(self.param_groups, layouts):
            group.update(layout)
        for state in self.state.values():  # torch moves loaded state to the parameter's device; these stay on the host
            state.update({key: state[key].cpu() for key in HOST_STATE if key in state})
        for group in self.param_groups:
            fill_group_defaults(group)
            group["step"] = int(group["step"])  # a distributed checkpoint may hand back a tensor
            check_group(group)  # ns_dtype by name

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, after the adaptive schedule's drifts still on their way to the host have landed."""
        self._schedules["adaptive"].settle_all(self.state.values())
        return super().state_dict()

    @property
    def nonfinite_steps_skipped(self) -> int:
        """Steps skipped for a non-finite gradient (``nonfinite="skip"``); reading it synchronizes with the device."""
        return 0 if self._skipped is None else int(self._skipped)

    def refresh_counts(self) -> dict[str, int]:
        """Refreshes so far per Muon group and per matrix (:func:`~lightning_muon.optim.schedules.refresh_counts`)."""
        return refresh_counts(self.param_groups, self.state)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes sent / received and collectives of this rank per branch since the last call (:class:`CommStats`)."""
        return self._comm.pop()

    # ---------------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimization step: plan, row statistics and verdict, refresh, RowNorm, AdamW, advance."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        works = [plan_group(group, self.state, self._schedules) for group in self.param_groups]
        items = [it for w in works for it in refresh_items(w, self.measure_scales)]
        sharded = [it for it in items if it.shard.sharded]
        ok, flag = self._statistics(works, flag_rides_refresh=bool(sharded))
        if self.nonfinite == "raise" and ok is not None and not bool(ok):
            raise NonFiniteGradient(culprit(_named_grads(works)))
        self.last_ns_flops = 0
        ok = self._sharded_refresh(works, sharded, ok, flag) if sharded else ok
        ok = ok if self.nonfinite == "skip" else None  # "raise" got here only with a True verdict
        local_items = [it for it in items if not it.shard.sharded]
        self.last_ns_flops += local_refresh(local_items, int(self.bucket_mb * 2**20), ok) if local_items else 0
        self.last_branches = {"refresh": len(items), "rownorm": sum(len(w.rownorm) for w in works)}
        for work in (w for w in works if w.params):
            if work.schedule is not None:
                self._rownorm(work, ok)
                refreshed = [(work.states[i], work.grads[i]) for i in work.refresh]
                measured = [(work.states[r.index], r.drift) for r in work.rownorm]
                work.schedule.advance(work.group, refreshed, measured, ok)
            else:
                adamw_step(work.group, work.weights, work.grads, work.states, self.foreach, ok)
            work.group["step"] += 1
        if ok is not None:
            self._skipped = (0 if self._skipped is None else self._skipped) + (~ok).long()
        return loss

    def _statistics(self, works: list[Work], flag_rides_refresh: bool) -> tuple[Tensor | None, Tensor | None]:
        """Row statistics of every RowNorm matrix, completed across ranks, and the step's verdict.

        Returns ``(ok, flag)``: the verdict shared by all ranks (None: unchecked, or ``flag`` — this rank's — rides
        the refresh instead). At most ONE all-reduce carries every partial sum and the flag; when nothing is
        checked, statistics that need no reduction are computed while it is in flight.
        """
        checking = self.nonfinite != "ignore"
        matrices = [(w, r) for w in works for r in w.rownorm]
        group = next((g for g in (mesh_group(p) for w in works for p in w.params) if g is not None), None)
        crossing = any(r.crosses_ranks for _, r in matrices)
        reduce = group is not None and (crossing or (checking and not flag_rides_refresh))
        overlap = reduce and not checking
        for w, r in matrices:
            if not overlap or r.crosses_ranks:
                self._measure(w, r)
        flag = local_flag(
            [r.sumsq for _, r in matrices],
            [g for w in works for i, g in enumerate(w.grads) if i not in {r.index for r in w.rownorm}],
            next((g.device for w in works for g in w.grads), torch.device("cpu")),
        ) if checking else None  # fmt: skip
        if reduce:
            branch = "rownorm" if matrices else "refresh"
            partials = [t for _, r in matrices for t in r.partials()]
            pending = start_all_reduce(partials, [flag] if checking else [], group, self._comm, branch)
            for w, r in matrices:
                if overlap and not r.crosses_ranks:
                    self._measure(w, r)
            flag = pending.wait() if checking else None
        for w, r in matrices:
            if r.drift_sums:
                r.drift = w.schedule.drift(r.drift_sums, r.sumsq, w.layout.rows(w.shards[r.index].shape))
        if group is None or reduce:
            return (flags_ok(flag) if checking else None), None
        return None, flag

    def _measure(self, work: Work, r: RowNormItem) -> None:
        """Read-only: Σ N² along the matrix's reduction axis (and its schedule's sums) from the old momentum."""
        buf = local(work.states[r.index]["momentum_buffer"])
        r.sumsq, r.drift_sums = work.schedule.statistics(
            work.group, work.states[r.index], buf, work.grads[r.index], r.dim, self.fused
        )

    def _sharded_refresh(
        self, works: list[Work], items: list[RefreshItem], ok: Tensor | None, flag: Tensor | None
    ) -> Tensor | None:
        """Every sharded refresh of the step through the transport, each bucket written as it arrives."""
        transport = gather_refresh if self.refresh_mode == "gather" else scatter_refresh
        bucket_bytes, raising = int(self.bucket_mb * 2**20), self.nonfinite == "raise"
        try:
            for bucket, m_news, orthos, verdict, scales in transport(
                items, bucket_bytes, self._comm, ok, flag, raising
            ):
                write_refresh(bucket, m_news, orthos, verdict, scales)
                ok = verdict
        except NonFiniteGradient:
            raise NonFiniteGradient(culprit(_named_grads(works))) from None
        shard = items[0].shard
        self.last_ns_flops += (
            owned_flops(items, shard.world, shard.rank)
            if transport is scatter_refresh
            else sum(it.flops for it in items)
        )
        return ok

    def _rownorm(self, work: Work, ok: Tensor | None) -> None:
        """W ← W(1 - lr·wd) - lr·γ·s·RowNorm(N) with the measured row statistics, one fused pass per matrix."""
        update = compiled_rownorm_kernels()[1] if self.fused else rownorm_update_
        group = work.group
        for r in work.rownorm:
            decay, scale = step_scales(group, work.layout, work.shards[r.index].shape)
            state, weight = work.states[r.index], work.weights[r.index]
            gamma = rownorm_gamma(group, state, weight)
            update(weight, local(state["momentum_buffer"]), work.grads[r.index], r.sumsq, group["momentum"],
                   group["nesterov"], decay, scale, group["ns_eps"], ok, gamma)  # fmt: skip


def _named_grads(works: list[Work]) -> list[tuple[str, Tensor]]:
    return [(param_name(w.group, i), g) for w in works for i, g in zip(w.indices, w.grads)]
