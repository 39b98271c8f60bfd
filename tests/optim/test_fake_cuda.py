"""The optimizer step on a fake CUDA device: no host synchronization, no CPU/CUDA mix, no pageable
host-to-device copy, same-dtype multi-tensor calls, collectives on CUDA tensors only — single-device and sharded
over an 8-rank fake process group, in every mode. Each kind of finding has a control that makes it happen."""

import pytest
import torch
import torch.distributed as dist
from fake_cuda import CUDA, fake_cuda, fake_process_group
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError

import lightning_muon.optim.muon as muon_module
from lightning_muon import PeriodicRowwiseMuon

SHAPES = [(64, 32), (32, 64), (40, 40), (3, 64), (1, 48)]  # tall, wide, square, fewer rows than 8 ranks, one row
MODES = {
    "K=3": dict(period=3),
    "K=1": dict(period=1),
    "adaptive": dict(schedule="adaptive", period=2, max_period=4, drift_threshold=0.01),
    "auto": dict(rownorm_scale="auto"),
    "auto_rms": dict(rownorm_scale="auto_rms", auto_scale_multiplier=0.5),
    "ignore": dict(nonfinite="ignore"),
    "tensor lr": dict(weight_decay=0.1),  # and every group's lr a 0-d device tensor after construction
}


def make(params, mode, **kwargs):
    opt = PeriodicRowwiseMuon(params, ns_dtype=torch.bfloat16, **MODES[mode], **kwargs)
    if mode == "tensor lr":  # the value is checked at construction (one read), then a scheduler drives the tensor
        for group in opt.param_groups:
            group["lr"] = torch.full((), group["lr"], device=CUDA)
    return opt


def params_on(device, shapes=SHAPES):
    return [nn.Parameter(torch.randn(s, device=device)) for s in shapes]


def run_steps(opt, params, steps=5, grad=None):
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) if grad is None else grad(p)
        opt.step()


def adamw_group(device):
    return {"params": [nn.Parameter(torch.randn(48, device=device))], "use_muon": False}


@pytest.mark.parametrize("mode", MODES)
def test_a_step_on_cuda_never_synchronizes_copies_or_mixes_devices(monkeypatch, mode):
    """Single device: 5 steps (refreshes and RowNorm steps) with a bf16 NS5 and an AdamW group."""
    with fake_cuda(monkeypatch) as findings:
        params = params_on(CUDA)
        opt = make([{"params": params}, adamw_group(CUDA)], mode)
        run_steps(opt, params + opt.param_groups[1]["params"])
    assert findings.clean(), findings


def sharded_params(world_size):
    """FSDP2 ``fully_shard`` over a fake ``cuda`` mesh of ``world_size`` ranks (uneven and empty shards included)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (world_size,))  # outside the fake mode: the mesh is host data
    return mesh, fully_shard


@pytest.mark.parametrize("rank", [0, 7])
@pytest.mark.parametrize("refresh", ["gather", "scatter"])
@pytest.mark.parametrize("mode", ["K=3", "K=1", "adaptive", "auto", "tensor lr"])
def test_a_sharded_step_at_8_ranks_traces_clean(monkeypatch, refresh, mode, rank):
    """FSDP2-sharded matrices over a fake 8-rank process group: every collective on CUDA tensors, no host sync."""
    with fake_process_group(8, rank):
        mesh, fully_shard = sharded_params(8)
        with fake_cuda(monkeypatch) as findings:
            module = nn.Module()
            module.weights = nn.ParameterList(params_on(CUDA))
            fully_shard(module, mesh=mesh)
            params = list(module.weights)
            opt = make(params, mode, refresh=refresh, bucket_mb=0.002)
            run_steps(opt, params, steps=4, grad=lambda p: p.detach().clone())
            stats = opt.comm_stats()
    assert findings.clean(), findings
    assert stats["refresh"]["collectives"] > 0
    assert stats["rownorm"]["collectives"] > 0 or mode == "K=1"  # the tall matrix's column sums cross ranks


def test_raise_keeps_its_one_documented_synchronization(monkeypatch):
    """``nonfinite="raise"`` reads the verdict on the host once per step, in ``step``: the only sync."""
    with fake_cuda(monkeypatch), pytest.raises(DataDependentOutputException) as caught:
        params = params_on(CUDA)
        run_steps(PeriodicRowwiseMuon(params, nonfinite="raise", ns_dtype=torch.bfloat16), params)
    ours = [entry for entry in caught.traceback if "lightning_muon" in str(entry.path)]
    assert ours[-1].name == "step" and str(ours[-1].path).endswith("optim/muon.py")


# ------------------------------------------------------------------------------------------------------- controls
def test_control_a_host_synchronization_in_the_step_is_caught(monkeypatch):
    verdict = muon_module.flags_ok
    monkeypatch.setattr(muon_module, "flags_ok", lambda flags: torch.tensor(bool(verdict(flags)), device=CUDA))
    with fake_cuda(monkeypatch), pytest.raises(DataDependentOutputException):
        params = params_on(CUDA)
        run_steps(PeriodicRowwiseMuon(params, ns_dtype=torch.bfloat16), params)


def test_control_a_pageable_copy_in_the_step_is_caught(monkeypatch):
    flag = muon_module.local_flag
    monkeypatch.setattr(muon_module, "local_flag", lambda *args: flag(*args) + torch.zeros(()).to(CUDA))
    with fake_cuda(monkeypatch) as findings:
        params = params_on(CUDA)
        run_steps(PeriodicRowwiseMuon(params, ns_dtype=torch.bfloat16), params, steps=1)
    assert findings.pageable_copies


def test_control_a_device_mix_a_mixed_foreach_and_a_host_collective_are_caught(monkeypatch):
    with fake_cuda(monkeypatch), pytest.raises(FakeTensorDeviceMismatchError):
        params = params_on(CUDA)
        opt = PeriodicRowwiseMuon(params, ns_dtype=torch.bfloat16)
        run_steps(opt, params, steps=1)
        opt.state[params[0]]["momentum_buffer"] = torch.zeros(params[0].shape)  # state left on the host
        run_steps(opt, params, steps=1)
    with fake_process_group(2, 0), fake_cuda(monkeypatch) as findings:
        torch._foreach_add_([torch.zeros(3, device=CUDA)], [torch.zeros(3, device=CUDA, dtype=torch.bfloat16)])
        dist.all_reduce(torch.zeros(3))
    assert findings.mixed_foreach and findings.host_collectives
