"""The recipe on a fake CUDA device: a DiT training step makes its random draws on the GPU, evaluation
networks sit on the GPU only while an evaluation runs, and ``evaluate`` under torchrun binds each rank to its GPU."""

import os

import lightning as L
import pytest
import torch
from fake_cuda import CUDA, fake_cuda
from torch import nn

from lightning_muon.callbacks import GenerationEvaluation
from lightning_muon.metrics.evaluation import metrics_on
from lightning_muon.metrics.features import FeatureExtractor
from lightning_muon.metrics.generation import FrechetDistance
from lightning_muon.recipes import evaluate
from lightning_muon.recipes.module import DiTModule


def module_on_cuda():
    """A tiny DiTModule whose network is built on ``cuda:0`` (no EMA copy: deep-copying fake tensors makes a second
    fake mode). ``_device`` is what Lightning's ``.to()`` records (fake parameters cannot be swapped by ``_apply``)."""
    module = DiTModule(muon={"ns_dtype": "bfloat16"}, ema_decay=0.0)
    with CUDA:
        module.configure_model()
    module._device = CUDA
    return module


def batch_on_cuda():
    return {"images": torch.randn(4, 1, 8, 8, device=CUDA), "labels": torch.randint(0, 10, (4,), device=CUDA)}


class DrawsOnHost(DiTModule):
    """Control: the training step's draws as at 9ea84c0 — CPU generator, then a pageable copy of each."""

    def training_step(self, batch, batch_idx):
        x0 = self._clean(batch)
        g = torch.Generator().manual_seed(1_000_003 * self.global_step)
        mask = torch.rand(len(x0), generator=g).to(self.device) < self.hparams.cfg_dropout
        noise = torch.randn(x0.shape, generator=g).to(x0)
        from diffusers.training_utils import compute_density_for_timestep_sampling

        t = compute_density_for_timestep_sampling("logit_normal", len(x0), 0.0, 1.0, generator=g).to(self.device)
        labels = torch.where(mask, self.hparams.num_classes, batch["labels"])
        return self.loss(self.model, x0, {"labels": labels}, t, noise)


@pytest.mark.filterwarnings("ignore:.*self.trainer` reference is not registered")
def test_a_dit_training_step_and_its_optimizer_step_stay_on_the_gpu(monkeypatch):
    """No pageable host-to-device copy, no host sync, no device mix in ``training_step`` (three copies at 9ea84c0:
    CFG mask, noise, timesteps) nor in the optimizer step over its Muon and AdamW groups. Control: the old draws."""
    with fake_cuda(monkeypatch) as findings:
        module = module_on_cuda()
        opt = module.configure_optimizers()["optimizer"]
        findings.pageable_copies.clear()  # set-up (position tables, stand-in parameters) is not the step
        loss = module.training_step(batch_on_cuda(), 0)
        assert loss.device == CUDA
        for p in module.parameters():
            p.grad = torch.randn_like(p)  # the backward pass needs a real CUDA context
        opt.step()
    assert findings.clean(), findings
    with fake_cuda(monkeypatch) as findings:
        control = DrawsOnHost(muon={"ns_dtype": "bfloat16"}, ema_decay=0.0)
        with CUDA:
            control.configure_model()
        control._device = CUDA
        findings.pageable_copies.clear()
        control.training_step(batch_on_cuda(), 0)
    assert len(findings.pageable_copies) == 3, findings


def test_the_draws_on_a_cpu_are_the_cpu_generators_draws():
    """On a CPU the device generator is the CPU generator: the same losses as the 9ea84c0 draws."""
    torch.manual_seed(0)
    new = DiTModule(ema_decay=0.0, cfg_dropout=0.5)
    new.configure_model()
    old = DrawsOnHost(ema_decay=0.0, cfg_dropout=0.5)
    old.configure_model()
    old.model.load_state_dict(new.model.state_dict())
    batch = {"images": torch.randn(4, 1, 8, 8), "labels": torch.arange(4)}
    assert torch.equal(new.training_step(batch, 0), old.training_step(batch, 0))


class TinyFeatures(FeatureExtractor):
    name, num_features = "tiny", 4

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 4)

    def features(self, images):
        return self.net(images.float().mean((2, 3)))


def placement(metric):
    tensors = [*metric.parameters(), *(getattr(metric, s) for s in metric._defaults), *metric.reference.values()]
    return {t.device for t in tensors}


@pytest.mark.gpu
def test_evaluation_networks_sit_on_the_gpu_only_during_an_evaluation():
    """``metrics_on`` on a real GPU (torchmetrics cannot build a Metric under the fake mode: it deep-copies its
    defaults): network, states and reference statistics on the GPU inside, on the CPU after — also after an error —
    and the GPU memory they took is free again. Control: a reference kept in a plain attribute stays behind."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    metric = FrechetDistance(TinyFeatures())
    metric.set_reference({"mu": torch.zeros(4), "sigma": torch.eye(4), "n": torch.tensor(10)})
    before = torch.cuda.memory_allocated()
    with metrics_on({"fd": metric}, cuda):
        assert placement(metric) == {cuda}
    assert placement(metric) == {torch.device("cpu")} and torch.cuda.memory_allocated() == before
    with pytest.raises(KeyError), metrics_on({"fd": metric}, cuda):
        raise KeyError("a failing evaluation")
    assert placement(metric) == {torch.device("cpu")}
    plain = nn.Module()
    plain.reference = {"mu": torch.zeros(4)}
    assert plain.to(cuda).reference["mu"].device.type == "cpu"


def test_the_callback_leaves_its_networks_off_the_training_gpu(tmp_path, monkeypatch):
    """``setup`` builds the metrics and leaves them on the CPU while the module is on the GPU (at 9ea84c0 it moved
    them to the module's device: a real CUDA call, which fails here)."""
    from helpers import image_folder, tiny_dinov2

    image_folder(tmp_path / "real", 4, size=8)
    dinov2 = str(tiny_dinov2(tmp_path / "dinov2"))
    callback = GenerationEvaluation(
        suite={"metrics": ["fd_dinov2"], "dinov2_weights": dinov2},
        sampling={"num_samples": 4},
        real_images_dir=str(tmp_path / "real"),
    )
    with fake_cuda(monkeypatch):
        module = module_on_cuda()
    callback.setup(L.Trainer(logger=False, enable_checkpointing=False), module, "fit")
    assert {p.device.type for m in callback.metrics.values() for p in m.parameters()} == {"cpu"}


def test_evaluate_under_torchrun_binds_each_rank_to_its_gpu(monkeypatch):
    """``evaluate``'s set-up on rank 3 of 8 (LOCAL_RANK 3): this rank's GPU is the current device before the NCCL
    group exists, and the group is bound to it. The CUDA runtime and the group's creation are recorded, not run."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: calls.append(("init", a, k)))
    device = evaluate._init_distributed(None)
    assert device == torch.device("cuda", 3)
    assert calls[0] == ("set_device", torch.device("cuda", 3))
    assert calls[1][0] == "init" and calls[1][1] == ("nccl",) and calls[1][2]["device_id"] == torch.device("cuda", 3)
    assert os.environ["LOCAL_RANK"] == "3"
