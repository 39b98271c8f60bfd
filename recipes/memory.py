"""Per-GPU memory of a config under muon_fsdp: training state from the real parameter shapes, plus what else sits on
every GPU (frozen encoders) and an activation estimate — and the peak of an evaluation, which brings its networks.

    python -m lightning_muon.recipes.memory recipes/configs/dit_xl2_imagenet256.yaml
    python -m lightning_muon.recipes.memory recipes/configs/t2i_base.yaml+recipes/configs/t2i_15b.yaml

(``a.yaml+b.yaml`` stacks configs like ``--config a.yaml --config b.yaml``.) What is counted, per GPU:

- **states**, sharded over all GPUs: fp32 parameters, fp32 gradients, the EMA copy (fp32), optimizer state (Muon: one
  momentum per matrix; AdamW: two moments).
- **FSDP**: the unsharded bf16 parameters of two blocks (FSDP2 prefetches the next block) and one block's unsharded
  fp32 gradient before its reduce-scatter.
- **refresh**: the NS5 working set of a refresh: the buckets in flight at once — ``scatter`` (the optimizer's
  default): one travelling to its owners, one in NS5, one's rows travelling back; ``gather``: one in NS5 while the next
  is gathered — each ``bucket_mb``, plus NS5 temporaries of the largest matrix (X, A = XXᵀ, B, in bf16).
- **adaptive**: the adaptive refresh schedule's reference momentum per matrix (fp32, sharded), when configured.
- **telemetry**: ``OptimizerTelemetry`` on its logging steps — an fp32 copy of every shard before the step and the
  step's change after it (two copies), when the callback is configured.
- **frozen**: the VAE and text encoder, replicated in bf16 (nominal sizes of the published checkpoints, below).
- **activations**: per block ``34·s·b·h`` bytes (self-attention + MLP with fused attention, bf16; Korthikanti et al.
  2022, without the s² term) plus ``10·s·b·h + 4·L·b·h`` for PixArt's cross-attention over L caption tokens; with
  ``gradient_checkpointing`` one bf16 input per block plus one block's activations. s tokens, b per-GPU batch, h
  hidden width.
- **total**: the sum of the above — training. Evaluation networks are not in it: ``GenerationEvaluation`` keeps them
  on the CPU between evaluations.
- **eval**: the metric networks of ``GenerationEvaluation`` (nominal sizes): fp32, the GenEval 2 judge in bf16.
- **eval peak**: what an evaluation holds at once — states, the two unsharded blocks, the frozen encoders, the metric
  networks, and one block's activations for a sampling batch (the callback's ``batch_size``, doubled under
  classifier-free guidance; no activation is kept for a backward pass).

An estimate: allocator fragmentation, the VAE decode at evaluation and sampler buffers are not in it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lightning_muon.parallelize import block_modules
from lightning_muon.param_groups import muon_param_groups
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.networks import build_transformer
from lightning_muon.recipes.shipped import load_config

#: Parameter counts of the published weights the configs point at (frozen models and metric networks).
NOMINAL_PARAMS = {
    "vae_path": 83.65e6,  # SD VAE (kl-f8, sd-vae-ft-ema)
    "text_encoder_path": 4.762e9,  # T5-v1.1-XXL encoder
    "dinov2": 304.4e6,  # DINOv2 ViT-L/14
    "inception": 23.9e6,  # torch-fidelity InceptionV3 (FID)
    "clip": 427.9e6,  # OpenAI CLIP ViT-L/14@336 (image and text towers)
    "hps": 986.1e6,  # open_clip ViT-H-14 (HPS v2.1)
    "judge": 8.767e9,  # Qwen3-VL-8B-Instruct (GenEval 2's Soft-TIFA judge)
}
METRIC_NETWORKS = {
    "fd_dinov2": "dinov2",
    "prdc_dinov2": "dinov2",
    "fid": "inception",
    "kid": "inception",
    "is": "inception",
    "sfid": "inception",
    "cmmd": "clip",
    "hpsv2": "hps",
    "geneval2": "judge",
}
#: bytes per parameter of each evaluation network on the GPU (the judge loads in bf16 there, the others in fp32)
NETWORK_BYTES = {**dict.fromkeys(NOMINAL_PARAMS, 4), "judge": 2}
GIB = 2**30


def _evaluation(config: dict) -> dict:
    """The init args of the config's ``GenerationEvaluation``, its ``suite`` and ``sampling`` fields among them ({}
    without one; flat, as configs of before wrote them, works too)."""
    for callback in config.get("trainer", {}).get("callbacks") or []:
        if str(callback.get("class_path", "")).endswith("GenerationEvaluation"):
            args = dict(callback.get("init_args") or {})
            return {**args.pop("suite", {}), **args.pop("sampling", {}), **args}
    return {}


#: buckets a sharded refresh holds at once, by transport (``lightning_muon.optim.transport``)
BUCKETS_IN_FLIGHT = {"scatter": 3, "gather": 2}


def _has_callback(config: dict, name: str) -> bool:
    callbacks = config.get("trainer", {}).get("callbacks") or []
    return any(str(c.get("class_path", "")).endswith(name) for c in callbacks)


def memory_per_gpu(config: dict, bucket_mb: float = 64.0, refresh: str = "scatter") -> dict[str, float]:
    """Bytes per GPU (as GiB) of each part listed in the module docstring, for a loaded (stacked) config."""
    trainer, model_cfg = config.get("trainer", {}), config["model"]
    gpus = trainer.get("devices", 1) * trainer.get("num_nodes", 1)
    arch, net = model_cfg.get("architecture", "dit"), model_cfg["model_config"]
    with torch.device("meta"):
        model = build_transformer(arch, net)
    strategy = trainer.get("strategy")
    blocks = strategy.get("init_args", {}).get("blocks") if isinstance(strategy, dict) else None  # muon_fsdp's
    groups = muon_param_groups(model, blocks=blocks)
    matrices = [p for g in groups if g["use_muon"] for p in g["params"]]
    muon, total = sum(p.numel() for p in matrices), sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in m.parameters()) for m in block_modules(model, blocks))
    ema = total if model_cfg.get("ema_decay", 0.999) > 0 else 0
    states = (4 * total + 4 * total + 4 * ema + 4 * muon + 8 * (total - muon)) / gpus
    fsdp = 2 * 2 * block + 4 * block
    largest = max(matrices, key=lambda p: p.numel())
    p_small = min(largest.shape)
    refresh = BUCKETS_IN_FLIGHT[refresh] * bucket_mb * 2**20 + 2 * (2 * largest.numel() + 2 * p_small * p_small)
    schedule = DiTModule.upgrade_hparams(model_cfg).get("muon", {}).get("schedule")
    adaptive = 4 * muon / gpus if schedule == "adaptive" else 0
    telemetry = 2 * 4 * total / gpus if _has_callback(config, "OptimizerTelemetry") else 0
    frozen = sum(2 * NOMINAL_PARAMS[k] for k in ("vae_path", "text_encoder_path") if model_cfg.get(k))
    evaluation_args = _evaluation(config)
    networks = {METRIC_NETWORKS[m] for m in evaluation_args.get("metrics", []) if m in METRIC_NETWORKS}
    evaluation = sum(NETWORK_BYTES[n] * NOMINAL_PARAMS[n] for n in networks)
    batch = config.get("data", {}).get("init_args", {}).get("batch_size", 1)
    s = (net.get("sample_size", 32) // net.get("patch_size", 2)) ** 2
    h = net["num_attention_heads"] * net["attention_head_dim"]
    layers = net.get("num_layers", 28)

    def block_activations(b: int) -> int:
        extra = 10 * s * b * h + 4 * model_cfg.get("max_caption_length", 120) * b * h if arch == "pixart" else 0
        return 34 * s * b * h + extra

    checkpointing = bool(model_cfg.get("gradient_checkpointing"))
    per_block = block_activations(batch)
    activations = layers * 2 * s * batch * h + per_block if checkpointing else layers * per_block
    parts = {"states": states, "fsdp": fsdp, "refresh": refresh, "adaptive": adaptive, "telemetry": telemetry}
    parts |= {"frozen": frozen, "activations": activations}
    sampling = evaluation_args.get("batch_size", 250) * (2 if evaluation_args.get("guidance_scale", 1.0) != 1 else 1)
    eval_peak = states + fsdp + frozen + evaluation + block_activations(sampling) if evaluation_args else 0
    return {
        "params_B": total / 1e9,
        "gpus": gpus,
        "batch": batch,
        "checkpointing": checkpointing,
        **{k: v / GIB for k, v in parts.items()},
        "total": sum(parts.values()) / GIB,
        "eval": evaluation / GIB,
        "eval peak": eval_peak / GIB,
    }


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="config files; a+b stacks b on a")
    args = parser.parse_args(argv)
    columns = ("states", "fsdp", "refresh", "adaptive", "telemetry", "frozen", "activations", "total", "eval")
    columns += ("eval peak",)
    print("| config | params | GPUs | batch/GPU | ckpt | " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|:---:|" + "---:|" * len(columns))
    for spec in args.configs:
        r = memory_per_gpu(load_config(*spec.split("+")))
        name = spec.split("+")[-1].rsplit("/", 1)[-1]
        cells = " | ".join(f"{r[c]:.2f} GiB" for c in columns)
        print(
            f"| {name} | {r['params_B']:.2f}B | {r['gpus']} | {r['batch']} | {'yes' if r['checkpointing'] else 'no'} "
            f"| {cells} |"
        )


if __name__ == "__main__":
    sys.exit(main())
