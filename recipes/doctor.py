"""``lightning-muon doctor``: a pre-flight check of a GPU node before a long job (on a CPU, the parts that apply).

Each check prints one table row (``ok``, ``skipped`` with the reason, or ``FAILED`` with what differs) and all rows go
to a JSON file:

- **versions**: Python, torch, CUDA, NCCL, Lightning, diffusers, the devices.
- **bf16**: whether the device multiplies bf16 natively (the optimizer's default NS5 dtype there).
- **optimizer**: ``PeriodicRowwiseMuon(period=1)`` against ``torch.optim.Muon`` on the device (6 steps, to 1e-4
  relative), and on CUDA a Periodic (K=3) run on the device against the same run on the CPU (fp32 NS5 on both).
- **ns5**: NS5 time of one matrix pair of a block (h × h, 4h × h) at each hidden width, ours against
  ``torch.optim.Muon``'s: ours in bf16 (fp32 on a CPU without native bf16, where torch's always-bf16 NS5 is
  emulated and slow).
- **collectives**: NCCL all-reduce, all-gather and all-to-all bus bandwidth among the visible GPUs (skipped with
  fewer than two).
- **fused**: the ``torch.compile``-d RowNorm step (``fused=True``) against the eager one.
- **train step**: one optimizer step of the DiT-XL/2 config with two of its 28 blocks (full width, its per-GPU
  batch under bf16 autocast; batch 2 on a CPU).
- **memory** (CUDA): the same step's ``max_memory_allocated`` and that of sampling a batch with guidance (an
  evaluation's generation), each against :mod:`lightning_muon.recipes.memory`'s estimate of the same model on one
  GPU; ``FAILED`` above 1.25×.
- **sharded fit**: ``muon_fsdp`` on 2 ranks under torchrun (the node's GPUs with NCCL and bf16-mixed; gloo CPU
  ranks on a CPU), K+1 steps in scatter and in gather mode with a NaN planted on one rank at step 2 (every rank must
  skip it), a distributed checkpoint, and resumes on 2 and on 1 rank; compared with one rank and with an
  uninterrupted run (bf16 tolerance on CUDA) — :mod:`lightning_muon.recipes.doctor_worker`.
- **transports**: both sharded refresh transports (gather, scatter) as rank 0 of 8 over torch's fake process group
  in one process — real kernels on this device, collectives without data — under
  ``torch.cuda.set_sync_debug_mode("error")`` on CUDA: on a single GPU too, where the multi-rank checks are skipped.
- **no host sync** (CUDA): the loop users run — ``lightning-muon fit`` of the default recipe with every callback the
  CLI adds, ``muon_fsdp`` on the node's GPUs (up to 2) — with its typical steps (not logging, evaluating, saving or
  validating) under ``torch.cuda.set_sync_debug_mode("error")``.
- **evaluate**: ``lightning-muon evaluate`` under torchrun on 2 ranks of the sharded fit's checkpoint, 5 samples
  (not divisible by the world size), against the same evaluation in one process.
- **failure**: one of 2 ranks raises; the seconds until every rank has exited, its error in the output.

    lightning-muon doctor                       # all checks, JSON to lightning_logs/doctor.json
    lightning-muon doctor --skip fused          # leave a check out
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_muon.recipes.flags import plain_help
from lightning_muon.recipes.shipped import CONFIGS, load_config

CHECKS = (
    "versions",
    "bf16",
    "optimizer",
    "ns5",
    "collectives",
    "fused",
    "train step",
    "memory",
    "sharded fit",
    "transports",
    "no host sync",
    "evaluate",
    "failure",
)
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
    import lightning

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
    from lightning_muon.optim.kernels import default_ns_dtype

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
    from lightning_muon import PeriodicRowwiseMuon

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
    from lightning_muon.compat import torch_muon_orthogonalize
    from lightning_muon.optim.kernels import DEFAULT_NS_COEFFICIENTS, default_ns_dtype, newton_schulz

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
    import torch.distributed as dist

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


def _free_port() -> int:
    """A free TCP port on 127.0.0.1 for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collectives(device: torch.device, mib: int = 64) -> Result:
    world = torch.cuda.device_count() if device.type == "cuda" else 0
    if world < 2:
        return Result("collectives", "skipped", "fewer than 2 GPUs" if world else "no CUDA (NCCL)")
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rates.json")
        mp.spawn(_collective_worker, args=(world, _free_port(), mib, out), nprocs=world)
        figures = json.loads(Path(out).read_text())
    detail = f"{world} GPUs, {mib} MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
    return Result("collectives", "ok", detail, figures)


def fused(device: torch.device) -> Result:
    from lightning_muon import PeriodicRowwiseMuon

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
    from lightning_muon.recipes.module import DiTModule

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
    from lightning_muon.recipes.memory import GIB, memory_per_gpu

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
        "init_args": {"batch_size": batch, "guidance_scale": guidance, "metrics": ["fd_dinov2", "fid"]},
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


def _ranks(device: torch.device) -> int:
    """Ranks of the multi-process checks: 2 GPUs (0 when fewer), or 2 gloo CPU ranks."""
    if device.type != "cuda":
        return 2
    return 2 if torch.cuda.device_count() >= 2 else 0


def _torchrun(nproc: int, module: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node nproc -m module args`` on 127.0.0.1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", module, *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _worker(nproc: int, out: Path, *args: str) -> dict:
    """One doctor_worker fit: its full parameters and what each rank saw; raises with the output's tail on failure."""
    proc = _torchrun(nproc, "lightning_muon.recipes.doctor_worker", ["fit", "--out", str(out), *args])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args) or 'fit'} on {nproc} ranks exited {proc.returncode}: {_tail(proc)}")
    return {
        "params": torch.load(out / "params.pt", weights_only=True),
        **json.loads((out / "ranks.json").read_text()),
    }


def _tail(proc: subprocess.CompletedProcess) -> str:
    """The child's error line (not torchrun's own ChildFailedError), else the output's end."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [x for x in lines if re.search(r"\w(Error|Exception): |^No ", x) and "ChildFailedError" not in x]
    return (errors[-1] if errors else "\n".join(lines[-3:])).strip()[:300]


def _params_rel(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all parameters together (per tensor, the key biases — zero gradient in exact arithmetic,
    so AdamW normalizes rounding noise — would dominate)."""
    diff = sum(float((a[k] - b[k]).square().sum()) for k in b)
    return (diff / max(sum(float(b[k].square().sum()) for k in b), 1e-30)) ** 0.5


def sharded_fit(device: torch.device, work: Path) -> Result:
    """K+1 steps on 2 ranks in scatter and gather mode and on 1 rank, each skipping the planted NaN step on every
    rank; resumes of the scatter run's checkpoint on 2 and 1 ranks against an uninterrupted run."""
    world = _ranks(device)
    if not world:
        return Result("sharded fit", "skipped", "fewer than 2 GPUs")
    tol = 2e-2 if device.type == "cuda" else 1e-4  # bf16-mixed on CUDA (backward not bit-deterministic); fp32
    steps, more = "4", "6"  # K + 1 with K = 3, then two more after a resume
    scatter = _worker(world, work / "scatter", "--steps", steps, "--save")
    gather = _worker(world, work / "gather", "--steps", steps, "--refresh", "gather")
    single = _worker(1, work / "single", "--steps", steps)
    straight = _worker(world, work / "straight", "--steps", more)
    ckpt = str(work / "scatter" / "last.ckpt")
    resumed = {n: _worker(n, work / f"resumed{n}", "--steps", more, "--ckpt-path", ckpt) for n in (world, 1)}
    runs = {"scatter": scatter, "gather": gather, "single": single}
    skipped = {run: [r["skipped"] for r in out["ranks"]] for run, out in runs.items()}
    figures: dict[str, float | str] = {
        "world": world,
        "gather_vs_scatter_rel": _params_rel(gather["params"], scatter["params"]),
        "single_vs_sharded_rel": _params_rel(single["params"], scatter["params"]),
        f"resumed_{world}_vs_straight_rel": _params_rel(resumed[world]["params"], straight["params"]),
        "resumed_1_vs_straight_rel": _params_rel(resumed[1]["params"], straight["params"]),
    }
    bad = [f"{k} {v:.2e} > {tol:.0e}" for k, v in figures.items() if k.endswith("_rel") and not v <= tol]
    bad += [f"{run}: steps skipped per rank {s} (want 1 each)" for run, s in skipped.items() if set(s) != {1}]
    detail = f"{world} ranks, NaN step skipped on every rank; " + ", ".join(
        f"{k} {v:.1e}" for k, v in figures.items() if k.endswith("_rel")
    )
    return Result("sharded fit", "FAILED" if bad else "ok", "; ".join(bad) or detail, figures)


def transports(device: torch.device, work: Path) -> Result:
    out = work / "transports"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_muon.recipes.doctor_worker", "transports", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return Result("transports", "FAILED", _tail(proc))
    counts = json.loads((out / "transports.json").read_text())["collectives"]
    watched = "under set_sync_debug_mode('error')" if device.type == "cuda" else "(the sync check needs CUDA)"
    detail = f"gather and scatter, 4 steps as rank 0 of 8 {watched}: collectives {counts}"
    figures = {f"{t}_{b}_collectives": n for t, c in counts.items() for b, n in c.items()}
    return Result("transports", "ok", detail, figures)


#: the default recipe's busy steps in the "no host sync" run: logging 5, evaluation 8, checkpoints 10, validation 12
BUSY_EVERY = (5, 8, 10, 12)
SYNC_DEBUG_RUN = f"""
trainer:
  accelerator: gpu
  strategy: muon_fsdp
  max_steps: 16
  log_every_n_steps: {BUSY_EVERY[0]}
  val_check_interval: {BUSY_EVERY[3]}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{every_n_train_steps: {BUSY_EVERY[2]}, save_last: true}}
    - class_path: lightning_muon.callbacks.GenerationEvaluation
      init_args: {{every_n_steps: {BUSY_EVERY[1]}, num_samples: 101, num_inference_steps: 3, batch_size: 32}}
    - class_path: lightning_muon.callbacks.OptimizerTelemetry
    - class_path: lightning.pytorch.callbacks.LearningRateMonitor
      init_args: {{logging_interval: step}}
    - class_path: lightning_muon.recipes.doctor_worker.SyncDebug
      init_args: {{busy_every: {list(BUSY_EVERY)}}}
"""


def no_host_sync(device: torch.device, work: Path) -> Result:
    if device.type != "cuda":
        return Result("no host sync", "skipped", "CUDA's sync debug mode needs a GPU")

    world = min(torch.cuda.device_count(), 2)
    run = work / "sync_debug"
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.yaml").write_text(SYNC_DEBUG_RUN + f"  devices: {world}\n  default_root_dir: {run}\n")
    args = ["fit", "--config", str(CONFIGS / "digits_tiny.yaml"), "--config", str(run / "run.yaml")]
    proc = _torchrun(world, "lightning_muon.recipes.cli", args)
    if proc.returncode != 0:
        return Result("no host sync", "FAILED", f"exited {proc.returncode}: {_tail(proc)}")
    detail = f"lightning-muon fit on {world} GPU(s): the typical steps of 16 under set_sync_debug_mode('error')"
    return Result("no host sync", "ok", detail, {"world": world})


def evaluate_check(device: torch.device, work: Path) -> Result:
    """``evaluate`` of the sharded fit's checkpoint under torchrun (5 samples on 2 ranks) and in one process."""
    world = _ranks(device)
    ckpt = work / "scatter" / "last.ckpt"
    if not world or not ckpt.exists():
        return Result("evaluate", "skipped", "needs the sharded fit's checkpoint (2 ranks)")
    values = {}
    for n in (world, 1):
        out = work / f"evaluate{n}"
        args = ["evaluate", str(ckpt), "--num_samples", "5", "--num_inference_steps", "2", "--metrics", "fd_digits",
                "--out", str(out)]  # fmt: skip
        proc = _torchrun(n, "lightning_muon.recipes.cli", args)
        if proc.returncode != 0:
            return Result("evaluate", "FAILED", f"on {n} ranks exited {proc.returncode}: {_tail(proc)}")
        with (out / "results.csv").open() as f:
            values[n] = float(next(csv.DictReader(f))["eval/fd_digits"])
    rel = abs(values[world] - values[1]) / max(abs(values[1]), 1e-12)
    figures = {"fd_ranks": values[world], "fd_single": values[1], "rel": rel}
    detail = f"5 samples, FD {values[world]:.4g} on {world} ranks, {values[1]:.4g} in one process"
    return Result("evaluate", "ok" if rel <= 1e-3 else "FAILED", detail, figures)


def failure(device: torch.device, work: Path, limit: float = 60.0) -> Result:
    world = _ranks(device)
    if not world:
        return Result("failure", "skipped", "fewer than 2 GPUs")
    out = work / "failure"
    proc = _torchrun(world, "lightning_muon.recipes.doctor_worker", ["fail", "--out", str(out)])
    ended = time.time()
    raised = out / "raised.txt"
    if proc.returncode == 0 or not raised.is_file():
        return Result("failure", "FAILED", f"exit code {proc.returncode}; the planted error was not raised")
    seconds = ended - float(raised.read_text())
    figures = {"seconds_to_exit": seconds, "exit_code": proc.returncode}
    bad = [f"{seconds:.1f} s > {limit:.0f} s"] if seconds > limit else []
    if "fails on purpose" not in proc.stderr:
        bad.append("the rank's error is missing from the output")
    detail = f"one of {world} ranks raised: all exited {seconds:.1f} s later (exit code {proc.returncode})"
    return Result("failure", "FAILED" if bad else "ok", "; ".join(bad) or detail, figures)


def run_checks(
    device: torch.device, hiddens: list[int], skip: set[str], config: str | None = None, work: Path | None = None
) -> list[Result]:
    """Every check not in ``skip``; an exception in one is its FAILED row, the others still run. ``work``: where the
    multi-process checks write (a temporary directory by default)."""
    import tempfile

    work = Path(work or tempfile.mkdtemp(prefix="lightning_muon_doctor_"))
    checks: dict[str, Callable[[], Result]] = {
        "versions": lambda: versions(device),
        "bf16": lambda: bf16(device),
        "optimizer": lambda: optimizer(device),
        "ns5": lambda: ns5(device, hiddens),
        "collectives": lambda: collectives(device),
        "fused": lambda: fused(device),
        "train step": lambda: train_step(device, config),
        "memory": lambda: memory(device, config),
        "sharded fit": lambda: sharded_fit(device, work),
        "transports": lambda: transports(device, work),
        "no host sync": lambda: no_host_sync(device, work),
        "evaluate": lambda: evaluate_check(device, work),
        "failure": lambda: failure(device, work),
    }
    results = []
    for name, check in checks.items():
        if name in skip:
            results.append(Result(name, "skipped", "--skip"))
            continue
        try:
            results.append(check())
        except Exception as err:  # a pre-flight check reports every failure and goes on to the next check
            results.append(Result(name, "FAILED", f"{type(err).__name__}: {err}".splitlines()[0][:200]))
    return results


def table(results: list[Result]) -> str:
    lines = ["| check | status | detail |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.detail} |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-muon doctor",
        description=plain_help(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda, cuda:N or cpu (default: cuda if any)",
    )
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=None, help="NS5 timing widths (default 2048 4096; 256 512 on a CPU)"
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=CHECKS, metavar="CHECK", help=f"of {CHECKS}")
    parser.add_argument("--config", default=None, help="config of the train step (default: dit_xl2_imagenet256.yaml)")
    parser.add_argument("--out", default="lightning_logs/doctor.json", help="JSON with every figure")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    hiddens = args.hidden or ([2048, 4096] if device.type == "cuda" else [256, 512])
    results = run_checks(device, hiddens, set(args.skip), args.config)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"Figures: {out}")
    return 1 if any(r.status == "FAILED" for r in results) else 0
