"""Every private Lightning / torch API the package uses (``lightning_muon.compat``) still does what we rely on, on the
installed versions — CI runs this file on the newest and on the declared lower bounds (``.ci/run``). And no other
module of the package reaches a private name of either library (the control: one planted import is found)."""

import ast
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_muon import compat
from lightning_muon.parallelize import free_port

PACKAGE = [Path(__file__).parents[1] / d for d in ("lightning_muon", "callbacks", "metrics", "recipes")]


def test_materialize_and_optimizer_state_to_device():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    compat.materialize_distributed_module(net, torch.device("cpu"))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in net.parameters())
    assert not torch.equal(net[0].weight, torch.zeros_like(net[0].weight))  # reset_parameters ran
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    compat.optimizers_to_device([optimizer], torch.device("cpu"))
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())


def test_set_sampler_epoch_reaches_a_distributed_sampler():
    data = torch.utils.data.TensorDataset(torch.arange(8))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    compat.set_sampler_epoch(torch.utils.data.DataLoader(data, sampler=sampler), 7)
    assert sampler.epoch == 7


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 1)
        self.seen: list[int] = []
        self.logging: list[bool] = []

    def training_step(self, batch, i):
        self.seen.append(compat.batches_that_stepped(self.trainer))
        self.logging.append(compat.logging_this_step(self.trainer))
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)


def test_trainer_internals(tmp_path):
    from lightning.pytorch.plugins.environments import LightningEnvironment

    module = _Tiny()
    written: list[int] = []

    class Written(L.Callback):  # the steps Lightning's loop wrote the loggers at
        def on_train_batch_end(self, trainer, *args):
            trainer._logger_connector.log_metrics = lambda metrics, step=None: written.append(trainer.global_step)

    trainer = L.Trainer(
        max_steps=4, default_root_dir=tmp_path, logger=False, enable_checkpointing=False, log_every_n_steps=2,
        callbacks=[Written()],
    )  # fmt: skip
    trainer.fit(module)
    assert module.seen == [0, 1, 2, 3]  # the logger step of each batch: the optimizer steps before it
    # asked inside training_step, the decision the loop makes after it (steps 2 and 4); control: not every step
    assert module.logging == [False, True, False, True] and written[:2] == [2, 4]  # then the epoch end's
    sigterm_checks: list[int] = []
    loop = trainer.fit_loop.epoch_loop
    if hasattr(type(loop), "_broadcast_sigterm_tensor"):  # Lightning >= 2.6
        loop._broadcast_sigterm_tensor = lambda: sigterm_checks.append(1)
        loop._broadcast_sigterm_tensor()
        compat.skip_sigterm_broadcast(trainer)
        loop._broadcast_sigterm_tensor()
        assert sigterm_checks == [1]  # control: the planted check ran before the switch
    else:
        compat.skip_sigterm_broadcast(trainer)  # nothing to switch off
    assert compat.restarted_mid_epoch(trainer.fit_loop) is False
    assert isinstance(compat.cluster_environment(trainer), LightningEnvironment)
    assert compat.hpc_save_path(trainer) == tmp_path / "hpc_ckpt_1.ckpt"
    mesh = object()
    compat.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh


def test_process_group_internals():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x, out = torch.arange(3.0), torch.empty(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecation on this torch
            compat.all_gather_single(out, x)
        assert torch.equal(out, x)
        # the control: the call it replaces is an error under the test run's filters (pyproject filterwarnings;
        # PYTHONWARNINGS in the processes tests start) where torch deprecates it
        if hasattr(dist, "all_gather_single"):
            ours = {"__name__": "lightning_muon.optim.transport", "dist": dist, "out": out, "x": x}
            with pytest.raises(FutureWarning, match="all_gather_into_tensor` is deprecated"):
                exec("dist.all_gather_into_tensor(out, x)", ours)
        compat.abort_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fake_process_group():
    compat.init_fake_process_group(rank=5, world_size=8)
    try:
        x = torch.ones(3)
        dist.all_reduce(x)  # returns at once, without data
        assert (dist.get_rank(), dist.get_world_size()) == (5, 8) and torch.equal(x, torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_torch_muon_orthogonalize_matches_ours():
    from lightning_muon.optim.kernels import DEFAULT_NS_COEFFICIENTS, newton_schulz

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    theirs = compat.torch_muon_orthogonalize(x, tuple(DEFAULT_NS_COEFFICIENTS), 5)  # always in bf16
    assert torch.allclose(newton_schulz(x, dtype=torch.bfloat16).float(), theirs.float(), atol=2e-2)
    assert isinstance(compat.cpu_has_native_bf16(), bool)


def test_dcp_set_element_places_a_value_in_a_nested_dict():
    root = {"a": {"b": 1}}
    compat.dcp_set_element(root, ("a", "c"), 2)
    assert root == {"a": {"b": 1, "c": 2}}


def private_imports(paths: list[Path]) -> list[str]:
    """``file:line name`` for every private name of torch or lightning imported or accessed as an attribute of
    ``trainer``/``lightning``/``torch`` outside ``compat.py`` (``torch._foreach_*`` allowed)."""
    found = []
    for path in (p for root in paths for p in root.rglob("*.py")):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "lightning"):
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("torch", "dist", "trainer", "L", "lightning"):
                    names = [node.attr]
            private = [n for n in names if any(p.startswith("_") and not p.startswith("__") for p in n.split("."))]
            private = [n for n in private if not n.startswith("_foreach_")]
            found += [f"{path.name}:{node.lineno} {n}" for n in private]
    return found


def test_no_private_api_outside_compat(tmp_path):
    assert private_imports(PACKAGE) == []
    planted = tmp_path / "planted.py"  # the control
    planted.write_text("from lightning.fabric.utilities.init import _materialize_distributed_module\n")
    assert private_imports([tmp_path]) == ["planted.py:1 _materialize_distributed_module"]


def test_own_deprecations_are_errors_in_the_processes_tests_start():
    import os
    import subprocess
    import sys

    assert "error::FutureWarning:lightning_muon.optim.transport" in os.environ["PYTHONWARNINGS"]
    warn = "import warnings; warnings.warn_explicit('going away', FutureWarning, 'f.py', 1, module={!r})"
    ours = subprocess.run([sys.executable, "-c", warn.format("lightning_muon.optim.transport")], capture_output=True)
    theirs = subprocess.run([sys.executable, "-c", warn.format("somebody_else")], capture_output=True)
    assert ours.returncode != 0 and b"FutureWarning: going away" in ours.stderr
    assert theirs.returncode == 0  # the control: another library's deprecation stays a warning
