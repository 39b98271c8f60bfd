"""The checks of ``lightning-muon doctor`` that run in this process (one device; NCCL bandwidth spawns its own
workers): versions, bf16, the optimizer against ``torch.optim.Muon``, NS5 time, collectives, the compiled RowNorm
step, one training step and its memory. Each returns a :class:`Result` row; :mod:`~lightning_muon.recipes.doctor`
runs them with the multi-process checks.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_muon import PeriodicRowwiseMuon
from lightning_muon.compat import torch_muon_orthogonalize
from lightning_muon.optim.kernels import DEFAULT_NS_COEFFICIENTS, default_ns_dtype, newton_schulz
from lightning_muon.parallelize import free_port
from lightning_muon.recipes.memory import GIB, memory_per_gpu
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.shipped import CONFIGS, load_config

#: the largest ratio of measured peak memory to the estimate that passes
MEMORY_SLACK = 1.25


@dataclass
class Result:
    """One check: ``status`` ok / skipped / FAILED, a one-line ``detail`` and its measured ``figures``."""

    name: str
    status: str
    detail: str
    figures: dict[str, float | str] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Best of ``repeats`` timings after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def versions(device: torch.device) -> Result:
    import diffusers

    figures: dict[str, float | str] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "diffusers": diffusers.__version__,
        "cuda": torch.version.cuda or "none",
    }
    if device.type == "cuda":
        figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        figures["gpus"] = torch.cuda.device_count()
        figures["device"] = torch.cuda.get_device_name(device)
    else:
        figures["device"] = platform.processor() or platform.machine()
    return Result("versions", "ok", ", ".join(f"{k} {v}" for k, v in figures.items()), figures)


def bf16(device: torch.device) -> Result:
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else default_ns_dtype(device) == torch.bfloat16
    detail = "native bf16 matmul: NS5 runs in bf16" if native else "no native bf16: NS5 runs in fp32"
    return Result("bf16", "ok", detail, {"native_bf16": float(native)})


def _matrices(device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(96, 32), (32, 96), (64, 64), (192, 32)]
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in shapes]


def _run(opt_fn: Callable, params: list[torch.Tensor], steps: int, seed: int = 1) -> list[torch.Tensor]:
    opt = opt_fn(params)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        opt.step()
    return [p.detach().cpu() for p in params]


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))


def optimizer(device: torch.device, **options: object) -> Result:
    """``options`` go to our optimizer only (a test passes a wrong one to see this check fail)."""
    shared = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)  # stated: the two defaults differ
    vanilla = {"period": 1, "ns_eps": 1e-7, "ns_dtype": torch.bfloat16, **shared, **options}
    ours = _run(lambda ps: PeriodicRowwiseMuon(ps, **vanilla), _matrices(device), 6)
    ref = _run(lambda ps: torch.optim.Muon(ps, eps=1e-7, **shared), _matrices(device), 6)
    figures = {"vs_torch_muon_rel": _max_rel(ours, ref)}
    if device.type == "cuda":
        periodic = dict(lr=0.02, period=3, rownorm_scale=0.15, ns_dtype=torch.float32)
        on_device = _run(lambda ps: PeriodicRowwiseMuon(ps, **periodic), _matrices(device), 6)
        on_cpu = _run(lambda ps: PeriodicRowwiseMuon(ps, **periodic), _matrices(torch.device("cpu")), 6)
        figures["device_vs_cpu_rel"] = _max_rel(on_device, on_cpu)
    # bf16 NS5 as one batched matmul (ours) or one matmul (torch) may round differently (2e-5 seen on a CPU); a 5%
    # change of lr, momentum or weight decay moves the weights by ~1e-3, one NS iteration fewer by 4e-3
    bounds = {"vs_torch_muon_rel": 1e-4, "device_vs_cpu_rel": 1e-4}
    bad = [f"{k} {v:.2e} > {bounds[k]:.0e}" for k, v in figures.items() if not v <= bounds[k]]
    detail = ", ".join(f"{k} {v:.2e}" for k, v in figures.items())
    return Result("optimizer", "FAILED" if bad else "ok", "; ".join(bad) or detail, figures)


def ns5(device: torch.device, hiddens: list[int]) -> Result:
    dtype = default_ns_dtype(device)
    figures: dict[str, float | str] = {"dtype": str(dtype).removeprefix("torch.")}
    coefficients = tuple(DEFAULT_NS_COEFFICIENTS)
    for h in hiddens:
        pair = [torch.randn(h, h, device=device), torch.randn(4 * h, h, device=device)]

        def ours(pair: list[torch.Tensor] = pair) -> list[torch.Tensor]:
            return [newton_schulz(x, dtype=dtype) for x in pair]

        def theirs(pair: list[torch.Tensor] = pair) -> list[torch.Tensor]:
            return [torch_muon_orthogonalize(x.to(dtype), coefficients, 5) for x in pair]

        t_ours, t_torch = _seconds(ours, device), _seconds(theirs, device)
        figures.update({f"ours_ms_{h}": 1e3 * t_ours, f"torch_ms_{h}": 1e3 * t_torch, f"ratio_{h}": t_ours / t_torch})
    detail = ", ".join(f"h={h}: {figures[f'ours_ms_{h}']:.1f} ms ({figures[f'ratio_{h}']:.2f}× torch)" for h in hiddens)
    return Result("ns5", "ok", f"ours in {figures['dtype']}, torch.optim.Muon in bfloat16 (always): {detail}", figures)


def _collective_worker(rank: int, world: int, port: int, mib: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    n = mib * 2**20 // 4
    x, gathered = torch.ones(n, device="cuda"), torch.empty(n * world, device="cuda")
    ops = {
        "all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world),
        "all_gather": (lambda: dist.all_gather_into_tensor(gathered, x), (world - 1) / world),
        "all_to_all": (lambda: dist.all_to_all_single(torch.empty_like(x), x), (world - 1) / world),
    }
    rates = {}
    for name, (op, factor) in ops.items():
        seconds = _seconds(op, torch.device("cuda", rank), repeats=5)
        rates[f"{name}_GBps"] = factor * 4 * n * (world if name == "all_gather" else 1) / seconds / 1e9
    if rank == 0:
        Path(out).write_text(json.dumps(rates))
    dist.destroy_process_group()


def collectives(device: torch.device, mib: int = 64) -> Result:
    world = torch.cuda.device_count() if device.type == "cuda" else 0
    if world < 2:
        return Result("collectives", "skipped", "fewer than 2 GPUs" if world else "no CUDA (NCCL)")

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rates.json")
        mp.spawn(_collective_worker, args=(world, free_port(), mib, out), nprocs=world)
        figures = json.loads(Path(out).read_text())
    detail = f"{world} GPUs, {mib} MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
    return Result("collectives", "ok", detail, figures)


def fused(device: torch.device) -> Result:
    options = dict(lr=0.02, period=3, rownorm_scale=0.15, ns_dtype=torch.float32)
    start = time.perf_counter()
    compiled = _run(lambda ps: PeriodicRowwiseMuon(ps, fused=True, **options), _matrices(device), 6)
    seconds = time.perf_counter() - start
    eager = _run(lambda ps: PeriodicRowwiseMuon(ps, **options), _matrices(device), 6)
    rel = _max_rel(compiled, eager)
    figures = {"fused_vs_eager_rel": rel, "compile_and_run_s": seconds}
    status = "ok" if rel <= 1e-5 else "FAILED"
    return Result("fused", status, f"compiled RowNorm vs eager {rel:.2e} (compile + 6 steps {seconds:.1f} s)", figures)


def _shrunk_step(device: torch.device, config: str | None) -> tuple[dict, Any, dict]:
    """The DiT config cut to two blocks (``None`` for a text-to-image config), one optimizer step of it at its per-GPU
    batch on CUDA (2 on a CPU): ``(model options, module, figures)``."""
    full = load_config(config or CONFIGS / "dit_xl2_imagenet256.yaml")
    model = {k: v for k, v in full["model"].items() if k not in ("vae_path", "text_encoder_path")}
    if model.get("architecture", "dit") != "dit":
        return model, None, {}
    model["model_config"] = {**model["model_config"], "num_layers": 2}
    batch = full["data"]["init_args"]["batch_size"] if device.type == "cuda" else 2
    net = model["model_config"]
    torch.manual_seed(0)
    module = DiTModule(**model)
    module.configure_model()
    module.to(device)
    opt = module.configure_optimizers()["optimizer"]
    size, channels = net["sample_size"], net["in_channels"]
    data = {
        "latents": torch.randn(batch, channels, size, size, device=device),
        "labels": torch.randint(0, model["num_classes"], (batch,), device=device),
    }
    start = time.perf_counter()
    with (
        warnings.catch_warnings(),  # self.log() outside a Trainer
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"),
    ):
        warnings.filterwarnings("ignore", message=".*self.trainer` reference is not registered")
        loss = module.training_step(data, 0)
    loss.backward()
    opt.step()
    _sync(device)
    figures = {"loss": loss.item(), "seconds": time.perf_counter() - start, "batch": batch, "layers": 2}
    figures["of_layers"] = full["model"]["model_config"].get("num_layers", 28)
    return model, module, figures


def train_step(device: torch.device, config: str | None = None) -> Result:
    """One step of the shrunken config."""
    _, module, figures = _shrunk_step(device, config)
    if module is None:
        return Result("train step", "skipped", "only class-conditional DiT configs (no text encoder weights here)")
    if not torch.isfinite(torch.tensor(figures["loss"])):
        return Result("train step", "FAILED", f"non-finite loss {figures['loss']}", figures)
    blocks = f"2 of {figures['of_layers']} blocks, batch {figures['batch']}"
    detail = f"{blocks}: loss {figures['loss']:.3f}, {figures['seconds']:.1f} s"
    return Result("train step", "ok", detail, figures)


def _score_with_metric_networks(images: torch.Tensor, device: torch.device, chunk: int = 32) -> None:
    """What an evaluation adds to sampling: FD-DINOv2's ViT-L/14 and FID's InceptionV3 on the device, in fp32 (their
    architectures, random weights: the memory is the same), features of ``images`` in chunks of ``chunk``."""
    import torchvision
    from transformers import Dinov2Config, Dinov2Model

    vit_l = Dinov2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    networks = [
        (Dinov2Model(vit_l).to(device).eval(), 224),
        (torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=False).to(device).eval(), 299),
    ]
    rgb = images[:, :1].float().div(255).expand(-1, 3, -1, -1)  # any channel count (latents without a VAE)
    with torch.no_grad():
        for network, size in networks:
            for part in rgb.split(chunk):
                network(torch.nn.functional.interpolate(part.to(device), size=(size, size), mode="bilinear"))


def memory(device: torch.device, config: str | None = None, guidance: float = 1.5) -> Result:
    """Peak memory of the shrunken config's training step and of an evaluation — sampling one batch with guidance,
    then FD-DINOv2's and FID's networks on it — against the estimate of the same model on one GPU (states + refresh
    + telemetry + activations; states + the metric networks + one block's sampling activations)."""
    if device.type != "cuda":
        return Result("memory", "skipped", "max_memory_allocated needs CUDA")

    torch.cuda.reset_peak_memory_stats(device)
    model, module, figures = _shrunk_step(device, config)
    if module is None:
        return Result("memory", "skipped", "only class-conditional DiT configs (no text encoder weights here)")
    train_peak = torch.cuda.max_memory_allocated(device) / GIB
    batch = figures["batch"]
    module.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        images = module.generate(
            torch.arange(batch) % model["num_classes"], list(range(batch)), 2, guidance, batch_size=batch
        )
    _score_with_metric_networks(images, device)
    eval_peak = torch.cuda.max_memory_allocated(device) / GIB
    sampling = {
        "class_path": "GenerationEvaluation",
        "init_args": {
            "sampling": {"batch_size": batch, "guidance_scale": guidance},
            "suite": {"metrics": ["fd_dinov2", "fid"]},
        },
    }
    shrunk = {
        "trainer": {"devices": 1, "callbacks": [sampling]},
        "model": model,
        "data": {"init_args": {"batch_size": batch}},
    }
    estimate = memory_per_gpu(shrunk)
    figures = {
        "train_peak_GiB": train_peak,
        "train_estimate_GiB": sum(estimate[k] for k in ("states", "refresh", "adaptive", "telemetry", "activations")),
        "eval_peak_GiB": eval_peak,
        "eval_estimate_GiB": estimate["eval peak"] - estimate["fsdp"],  # one GPU: no unsharded copies
    }
    ratios = {k: figures[f"{k}_peak_GiB"] / figures[f"{k}_estimate_GiB"] for k in ("train", "eval")}
    figures.update({f"{k}_ratio": v for k, v in ratios.items()})
    detail = "; ".join(
        f"{k} peak {figures[f'{k}_peak_GiB']:.2f} GiB vs estimate {figures[f'{k}_estimate_GiB']:.2f} GiB ({v:.2f}×)"
        for k, v in ratios.items()
    )
    bad = [k for k, v in ratios.items() if v > MEMORY_SLACK]
    if bad:
        return Result("memory", "FAILED", f"{', '.join(bad)} above {MEMORY_SLACK}×: {detail}", figures)
    return Result("memory", "ok", detail, figures)
