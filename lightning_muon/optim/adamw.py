r"""The AdamW branch: decoupled-weight-decay Adam, op for op as ``torch.optim.AdamW`` (bit-identical on finite steps).

.. math::
    W \leftarrow W(1 - \eta\lambda), \quad m \leftarrow \beta_1 m + (1-\beta_1) g, \quad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2, \quad
    W \leftarrow W - \frac{\eta}{1-\beta_1^t} \cdot \frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \varepsilon}
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_muon.optim.config import scalar
from lightning_muon.optim.kernels import scale_
from lightning_muon.optim.shards import local

__all__ = ["adamw_step", "init_adamw_state"]


def init_adamw_state(state: dict[str, Any], param: Tensor) -> None:
    """As torch.optim.AdamW: a CPU step count (bias corrections are host floats), two moments like the parameter."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def adamw_step(
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Any]],
    foreach: bool,
    ok: Tensor | None,
) -> None:
    """One AdamW step in place on (local) tensors with the group's options (``group["momentum"]`` is β1: what
    cyclic schedulers change; ``betas`` is rewritten to match). With a device verdict ``ok``, three ``torch.where``
    make a step whose verdict is False an identity (the step counts still advance, as the refresh schedule does)."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = scalar(group["momentum"]), scalar(tuple(group["betas"])[1])
    group["betas"] = (beta1, beta2)
    exp_avgs = [local(s["exp_avg"]) for s in states]
    exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]
    steps = [s["step"] for s in states]
    lerp_to, sq_of, moment = grads, grads, exp_avgs
    if ok is not None:
        lerp_to = [torch.where(ok, g, m) for g, m in zip(grads, exp_avgs)]  # lerp(m, m) = m
        sq_of = [torch.where(ok, g, 0) for g in grads]  # v·1 + (1-β2)·0·0 = v
    _add_(steps, 1.0, foreach)
    if weight_decay != 0:
        scale_(params, 1 - lr * weight_decay, ok)
    _lerp_(exp_avgs, lerp_to, 1 - beta1, foreach)
    scale_(exp_avg_sqs, beta2, ok)
    if foreach:
        torch._foreach_addcmul_(exp_avg_sqs, sq_of, sq_of, 1 - beta2)
    else:
        for v, g in zip(exp_avg_sqs, sq_of):
            v.addcmul_(g, g, value=1 - beta2)
    if ok is not None:
        moment = [torch.where(ok, m, 0) for m in exp_avgs]  # the weight moves by step_size · 0 / denom
    step_size = [-lr / (1 - beta1 ** t.item()) for t in steps]  # CPU step counts: no device sync
    bias_correction2_sqrt = [(1 - beta2 ** t.item()) ** 0.5 for t in steps]
    if foreach and not isinstance(lr, Tensor):
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
