"""The options of the optimizer's two branches, their defaults and their validation, each in one place.

A param group stays a plain dict (lr schedulers write ``group["lr"]``); :class:`MuonConfig` and :class:`AdamWConfig`
define which keys a group of each branch has, their defaults, and what values are valid. The optimizer, its
``__setstate__`` / ``load_state_dict`` and :class:`~lightning_muon.recipes.DiTModule` all read them from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from lightning_muon.optim.kernels import (
    ADJUST_LR_CHOICES,
    AUTO_SCALES,
    DEFAULT_NS_COEFFICIENTS,
    AdjustLR,
    AutoScale,
    NSMethod,
    NSNormalize,
    NSPreset,
    Orthogonalizer,
    default_ns_dtype,
    make_orthogonalizer,
)
from lightning_muon.optim.matrices import MatrixLayout
from lightning_muon.optim.shards import local

__all__ = [
    "AdamWConfig",
    "MuonConfig",
    "check_group",
    "check_layout",
    "check_saved_group",
    "fill_group_defaults",
    "orthogonalizer",
    "param_name",
]

NonFinite = Literal["skip", "raise", "ignore"]
RefreshSchedule = Literal["fixed", "adaptive"]
NSDtype = Literal["bfloat16", "float32", "float64"]
NONFINITE_MODES, SCHEDULES = get_args(NonFinite), get_args(RefreshSchedule)
#: per-matrix state whose shape is not the parameter's (the others, moments and buffers, are shaped like it)
STATE_SHAPES = {"refresh_scales": (2,)}
#: per-parameter facts of a Muon group, not hyperparameters (:class:`~lightning_muon.optim.matrices.MatrixLayout`):
#: :func:`~lightning_muon.muon_param_groups` sets them from the layer (transformers ``Conv1D``, fused projections)
LAYOUT_DEFAULTS = {"transposed": False, "pieces": 1}
NS_DTYPES = dict(zip(get_args(NSDtype), (torch.bfloat16, torch.float32, torch.float64), strict=True))


@dataclass(frozen=True)
class MuonConfig:
    r"""Options of a Muon group (2-D hidden weights): what ``PeriodicRowwiseMuon``'s keyword arguments default to,
    and what ``DiTModule(muon=...)`` / ``--model.muon.<option>`` take whole. The annotations are plain data (the
    CLI and checkpoints carry them); the optimizer's groups also accept a 0-d tensor ``lr`` and a ``torch.dtype``.

    Attributes:
        lr: learning rate :math:`\eta`.
        momentum: :math:`\beta` in [0, 1).
        nesterov: use the Nesterov look-ahead :math:`N_t = \beta M_t + (1-\beta) G_t`.
        weight_decay: decoupled weight decay :math:`\lambda`.
        period: :math:`K`, steps between NS5 refreshes (1 = vanilla Muon).
        rownorm_scale: :math:`\gamma`, the RowNorm step relative to the NS5 step; or ``"auto"`` / ``"auto_rms"``:
            each matrix calibrates its own γ at every refresh, descent- or RMS-matched to that refresh's NS5 step
            (:func:`~lightning_muon.optim.kernels.refresh_scales`), times ``auto_scale_multiplier``, and keeps it
            (in its state) until its next refresh.
        auto_scale_multiplier: the tunable factor on a calibrated γ.
        ns_steps: Newton–Schulz iterations.
        ns_coefficients: one (a, b, c), a sequence of ``ns_steps`` triples, or a schedule name: ``"jordan"`` (the
            default triple), ``"polar_express"`` or ``"turbo_muon"`` (Polar Express without its first triple, for
            ``ns_normalize="aol"`` with ``ns_steps=4``); see :class:`~lightning_muon.optim.kernels.Orthogonalizer`.
        ns_dtype: NS5 compute dtype by name (``"bfloat16"``, ``"float32"``, ``"float64"``; a group stores it so);
            ``None`` picks per device with :func:`~lightning_muon.optim.kernels.default_ns_dtype`.
        ns_eps: stabilizer of the NS5 normalization and of RowNorm (> 0).
        ns_normalize: ``"frobenius"`` (as torch.optim.Muon) or ``"aol"`` (Turbo-Muon's AOL rescaling).
        ns_method: ``"standard"`` or ``"gram"`` (Gram-space iteration where it needs fewer FLOPs; equal in exact
            arithmetic).
        adjust_lr: shape factor :math:`s(m, n)`: ``"original"``, ``"match_rms_adamw"`` or ``"spectral_unclamped"``.
        schedule: when matrices refresh, ``"fixed"`` or ``"adaptive"`` (:mod:`~lightning_muon.optim.schedules`).
        drift_threshold: the adaptive schedule's drift that triggers a refresh.
        min_period: the adaptive schedule's fewest steps between refreshes.
        max_period: the adaptive schedule's most steps between refreshes (``None``: ``period``).
        refresh_warmup: :math:`t_w`, the first steps that all refresh (K = 1) before either schedule takes over.
    """

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    period: int = 3
    rownorm_scale: float | AutoScale = 0.15
    ns_steps: int = 5
    ns_coefficients: NSPreset | tuple[float, float, float] | tuple[tuple[float, float, float], ...] = (
        DEFAULT_NS_COEFFICIENTS
    )
    ns_dtype: NSDtype | None = None
    ns_eps: float = 1e-7
    ns_normalize: NSNormalize = "frobenius"
    ns_method: NSMethod = "standard"
    adjust_lr: AdjustLR = "original"
    schedule: RefreshSchedule = "fixed"
    drift_threshold: float = 0.05
    min_period: int = 1
    max_period: int | None = None
    auto_scale_multiplier: float = 1.0
    refresh_warmup: int = 0

    #: keys every saved Muon group has had (the others take their defaults when an older state dict is loaded)
    REQUIRED: ClassVar[tuple[str, ...]] = (
        "lr", "momentum", "nesterov", "weight_decay", "period", "rownorm_scale", "ns_steps", "adjust_lr"
    )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.rownorm_scale, str) and self.rownorm_scale not in AUTO_SCALES:
            raise ValueError(
                f"rownorm_scale must be a number >= 0 or one of {sorted(AUTO_SCALES)}, got {self.rownorm_scale!r}."
            )
        numbers = ("lr", "weight_decay", "ns_eps", "auto_scale_multiplier")
        _check_nonnegative(self, *numbers, *(() if isinstance(self.rownorm_scale, str) else ("rownorm_scale",)))
        if not self.ns_eps > 0:
            raise ValueError(f"ns_eps must be > 0 (NS5 and RowNorm of a zero matrix stay finite), got {self.ns_eps}.")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}.")
        if not _is_int(self.period) or self.period < 1:
            raise ValueError(f"period (K) must be an integer >= 1 (1 = vanilla Muon), got {self.period!r}.")
        if not _is_int(self.refresh_warmup) or self.refresh_warmup < 0:
            raise ValueError(
                f"refresh_warmup (steps that all refresh before the schedule takes over) must be an integer >= 0, "
                f"got {self.refresh_warmup!r}."
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}.")
        if self.schedule == "adaptive":
            low, high = self.min_period, self.longest_period
            if not (_is_int(low) and _is_int(high)) or not 1 <= low <= high:
                raise ValueError(
                    f"The adaptive schedule needs integers 1 <= min_period <= max_period, got min_period={low!r} and "
                    f"max_period={self.max_period!r} (None: period={self.period!r})."
                )
            if not 0.0 < self.drift_threshold < 2.0:
                raise ValueError(f"drift_threshold must be in (0, 2) (1 - cosine), got {self.drift_threshold!r}.")
        if self.adjust_lr not in ADJUST_LR_CHOICES:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {self.adjust_lr!r}.")
        make_orthogonalizer(self.ns_coefficients, self.ns_steps, self.ns_eps, torch.float32, self.ns_normalize,
                            self.ns_method)  # raises naming a bad ns_* option  # fmt: skip
        names = {v: k for k, v in NS_DTYPES.items()}
        if self.ns_dtype in names:  # stored by name: distributed checkpoints take strings, not torch.dtype
            object.__setattr__(self, "ns_dtype", names[self.ns_dtype])
        if self.ns_dtype is not None and self.ns_dtype not in NS_DTYPES:
            raise ValueError(
                f"ns_dtype must be one of {sorted(NS_DTYPES)} (or the torch dtype) or None, got {self.ns_dtype!r}."
            )

    @property
    def longest_period(self) -> int:
        return self.period if self.max_period is None else self.max_period


@dataclass(frozen=True)
class AdamWConfig:
    r"""Options of an AdamW group (``use_muon=False``), as ``torch.optim.AdamW`` takes them.

    Attributes:
        lr / eps / weight_decay: as torch.optim.AdamW.
        betas: :math:`(\beta_1, \beta_2)`, two floats or two 1-element tensors.
        momentum: :math:`\beta_1` again (what torch's ``OneCycleLR`` / ``CyclicLR`` with ``cycle_momentum`` change);
            it wins over ``betas[0]``. ``None``: ``betas[0]``.
    """

    lr: float | Tensor = 0.02
    betas: tuple[float, float] | tuple[Tensor, Tensor] = (0.9, 0.95)
    momentum: float | None = None
    eps: float = 1e-8
    weight_decay: float = 0.0

    REQUIRED: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay")

    def __post_init__(self) -> None:
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {betas!r}.")
        if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
            raise ValueError("betas must be either both floats or both Tensors.")
        if isinstance(betas[0], Tensor) and not all(b.numel() == 1 for b in betas):
            raise ValueError("Tensor betas must be 1-element.")
        if not all(0.0 <= scalar(b) < 1.0 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {betas!r}.")
        if self.momentum is None:
            object.__setattr__(self, "momentum", betas[0])
        _check_nonnegative(self, "lr", "weight_decay", "eps", "momentum")


def check_step_options(refresh: str, nonfinite: str, bucket_mb: float) -> None:
    """The optimizer-wide options (not per group)."""
    if refresh not in ("gather", "scatter"):
        raise ValueError(f"refresh must be 'gather' or 'scatter', got {refresh!r}.")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}.")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}.")


def branch_defaults(given: dict[str, Any]) -> dict[bool, dict[str, Any]]:
    """Group defaults of each branch (``use_muon`` True / False) from the optimizer's arguments, checked per group
    (:func:`check_group`): AdamW's lr and weight decay are ``adamw_lr`` / ``adamw_weight_decay``, else the Muon ones;
    its momentum is its group's betas[0]."""
    adamw_lr, adamw_wd = given["adamw_lr"], given["adamw_weight_decay"]
    adamw = dict(lr=given["lr"] if adamw_lr is None else adamw_lr, betas=given["betas"], eps=given["eps"])
    adamw["weight_decay"] = given["weight_decay"] if adamw_wd is None else adamw_wd
    return {True: {key: given[key] for key in keys(MuonConfig)}, False: adamw}


def prepare_group(group: dict[str, Any], defaults_of: dict[bool, dict[str, Any]]) -> None:
    """Fill a new param group's missing options from its branch's defaults; reject unknown options and a parameter
    listed twice (the values are checked by :func:`check_group` once torch has checked the parameters)."""
    use_muon = group.setdefault("use_muon", True)
    if use_muon not in (True, False):
        raise ValueError(f"use_muon must be True or False, got {use_muon!r}.")
    allowed = {"params", "param_names", "use_muon", "step", "momentum", *defaults_of[use_muon]}
    allowed |= set(LAYOUT_DEFAULTS) if use_muon else set()
    unknown = sorted(set(group) - allowed)
    if unknown:
        branch = "Muon" if use_muon else "AdamW"
        raise ValueError(f"Unknown option(s) {unknown} for a {branch} group; allowed: {sorted(allowed)}.")
    for key, value in defaults_of[use_muon].items():
        group.setdefault(key, value)
    fill_group_defaults(group)  # AdamW: momentum = betas[0]
    params = group["params"]
    if not isinstance(params, (Tensor, set)):  # torch rejects sets itself
        group["params"] = params = list(params)
        ids = [id(p[1] if isinstance(p, tuple) else p) for p in params]
        if len(set(ids)) != len(ids):
            raise ValueError("A parameter appears twice in one param group; list each parameter once.")


def config_of(group: dict[str, Any]) -> MuonConfig | AdamWConfig:
    """The validated options of a param group (raises ValueError naming the bad one)."""
    kind = MuonConfig if group.get("use_muon", True) else AdamWConfig
    return kind(**{key: group[key] for key in keys(kind) if key in group})


def keys(kind: type[MuonConfig] | type[AdamWConfig]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


def check_group(group: dict[str, Any]) -> None:
    """Validate a param group's options (storing ``ns_dtype`` by name) and, for Muon, that every parameter is a
    matrix (2-D, or 3-D experts) that fits the group's :class:`~lightning_muon.optim.matrices.MatrixLayout`."""
    config = config_of(group)
    if isinstance(config, MuonConfig):
        group["ns_dtype"] = config.ns_dtype
        if not isinstance(group["transposed"], bool):
            raise ValueError(f"transposed must be True or False, got {group['transposed']!r}.")
        layout = MatrixLayout.of(group)
        for i, p in enumerate(group["params"]):
            problem = None if p.ndim in (2, 3) else f"is not a 2-D matrix ({p.ndim}-D)"
            problem = problem or layout.check(tuple(p.shape))
            if problem:
                raise ValueError(
                    f"{param_name(group, i)} is in a Muon group but {problem}. Muon takes 2-D weights (and 3-D "
                    "expert weights (E, out, in)); put biases, norms, embeddings and convolutions in an AdamW group "
                    "(use_muon=False), e.g. with lightning_muon.muon_param_groups."
                )


def fill_group_defaults(group: dict[str, Any]) -> None:
    """Options added after a state dict was saved take their defaults (``__setstate__`` and ``load_state_dict``)."""
    group.setdefault("use_muon", True)
    group.setdefault("step", 0)
    if group["use_muon"]:
        for f in fields(MuonConfig):
            if f.name not in MuonConfig.REQUIRED:
                group.setdefault(f.name, f.default)
        for key, value in LAYOUT_DEFAULTS.items():
            group.setdefault(key, value)
    elif isinstance(group.get("betas"), (tuple, list)) and group["betas"]:
        group.setdefault("momentum", group["betas"][0])


def check_saved_group(index: int, group: dict[str, Any]) -> None:
    """Validate a copy of a saved param group (with this optimizer's params) before anything is loaded."""
    kind = MuonConfig if group.get("use_muon", True) else AdamWConfig
    missing = sorted(set(kind.REQUIRED) - set(group))  # extra keys are allowed: lr schedulers add some
    if missing:
        raise ValueError(
            f"Param group {index} of the state dict lacks {missing}: it was not saved by PeriodicRowwiseMuon "
            "(torch.optim.Muon's has no period or rownorm_scale). Load a state dict this optimizer saved, or start "
            "the optimizer fresh."
        )
    fill_group_defaults(group)
    step = group["step"]
    step = int(step) if isinstance(step, Tensor) and step.numel() == 1 and not step.is_floating_point() else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"Param group {index} was saved with step={step!r}; expected an integer >= 0.")
    try:
        check_group(group)
    except (ValueError, TypeError) as err:
        raise ValueError(f"Param group {index} of the loaded state: {err}") from err


def orthogonalizer(group: dict[str, Any], device: torch.device) -> Orthogonalizer:
    """A Muon group's refresh orthogonalizer, in its ``ns_dtype`` (None: :func:`default_ns_dtype` of ``device``)."""
    dtype = default_ns_dtype(device) if group["ns_dtype"] is None else NS_DTYPES[group["ns_dtype"]]
    return make_orthogonalizer(
        group["ns_coefficients"], group["ns_steps"], group["ns_eps"], dtype, group["ns_normalize"], group["ns_method"]
    )


def check_layout(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """A state dict fits these param groups: as many groups, parameters and branches, state of the parameters'
    shapes, and finite (a NaN moment would poison every later step)."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
        raise ValueError("Not an optimizer state dict: expected a dict with a 'param_groups' list and 'state'.")
    saved_groups = state_dict["param_groups"]
    hint = "Load the checkpoint into the model and parameter grouping it was saved with."
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"Optimizer state has {len(saved_groups)} param groups, this optimizer has {len(param_groups)}. " + hint
        )
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"Param group {g} has {len(group['params'])} parameters, the saved one {len(saved['params'])}. " + hint
            )
        if saved.get("use_muon", True) != group["use_muon"]:
            raise ValueError(
                f"Param group {g} has use_muon={group['use_muon']} but was saved with "
                f"use_muon={saved.get('use_muon', True)}. " + hint
            )
        for i, (index, param) in enumerate(zip(saved["params"], group["params"])):
            for key, value in state_dict.get("state", {}).get(index, {}).items():
                if not isinstance(value, Tensor):
                    continue
                want = STATE_SHAPES.get(key, tuple(param.shape))
                if value.ndim > 0 and tuple(value.shape) != want:
                    raise ValueError(
                        f"Saved state {key!r} of {param_name(group, i)} has shape {tuple(value.shape)}, "
                        f"expected {want} (the parameter has shape {tuple(param.shape)}). " + hint
                    )
                if value.is_floating_point() and not bool(torch.isfinite(local(value)).all()):
                    raise ValueError(
                        f"Saved state {key!r} of {param_name(group, i)} is not finite (NaN/inf): "
                        "the checkpoint is corrupt; resume from an earlier one."
                    )


def param_name(group: dict[str, Any], index: int) -> str:
    """How errors name parameter ``index`` of a group: by name when the group has ``param_names``."""
    names = group.get("param_names")
    shape = tuple(group["params"][index].shape)
    return f"parameter {names[index]!r} {shape}" if names else f"parameter {index} {shape} of its group"


def scalar(x: float | Tensor) -> float:
    """A Python number from a float or a 1-element tensor (a tensor beta: read once per step, as torch's AdamW)."""
    return x.item() if isinstance(x, Tensor) else x


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_nonnegative(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)  # a tensor lr (checked once, here)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0.0 or math.isinf(value):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
