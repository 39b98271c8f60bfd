"""Every shipped paper-scale config end to end, as a user with real weights runs it: encode_latents → fit (2 CPU
ranks, muon_fsdp, evaluation at a step, distributed checkpoints) → ``lightning-muon evaluate``.

Only the config's paths (pointed at tiny random-init weights of the same classes, saved with ``save_pretrained``) and
its sizes (model width/depth, steps, sample counts, batch sizes) are changed; everything else is the shipped YAML,
stacked with ``--config`` as the README says.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml
from fixtures import geneval2_benchmark, random_inception_state_dict, tiny_open_clip_config, tiny_vlm_judge
from helpers import (
    image_folder,
    tiny_dinov2,
    tiny_text_encoder,
    tiny_vae,
)

from lightning_muon.parallelize import free_port
from lightning_muon.recipes.shipped import SHIPPED_CONFIGS, load_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PAPER_CONFIGS = [name for name in SHIPPED_CONFIGS if name != "digits_tiny"]
#: configs whose checkpoints also go through ``lightning-muon evaluate`` (the other t2i sizes differ from t2i_1p3b only
#: in the transformer's size, which evaluate reads from the checkpoint; their training runs evaluate in-loop)
EVALUATED = ("dit_xl2_imagenet256", "t2i_1p3b")
CAPTIONS = ["a red cat", "a dog", "two birds", "a blue car", "a cat"]
SHRINK = {
    "dit": {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2, "sample_size": 8},
    "pixart": {
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "num_layers": 2,
        "sample_size": 8,
        "cross_attention_dim": 16,
        "caption_channels": 12,
    },
}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run(cmd, cwd, timeout=900):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def torchrun(nproc):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        nproc,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        free_port(),
    ]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny stand-ins for every weight file and data path the shipped configs name, and the latents encoded from
    the image folders (t2i on 2 processes; ImageNet-style with --flip)."""
    root = tmp_path_factory.mktemp("assets")
    inception = root / "pt_inception-2015-12-05-6726825d.pth"
    torch.save(random_inception_state_dict(), inception)
    _, clip = tiny_open_clip_config(root)
    (root / "prompts.txt").write_text("\n".join(CAPTIONS))
    a = {
        "vae": tiny_vae(root / "vae"),
        "clip_model": root / "tiny-test-clip.json",
        "t2i_images": image_folder(root / "t2i_images", 24, captions=CAPTIONS),
        "cls_images": image_folder(root / "cls_images", 12, classes=2),
    }
    tiny_text_encoder(root / "t5")
    paths = {
        "/models/sd-vae-ft-ema": a["vae"],
        "/models/t5-v1_1-xxl": root / "t5",
        "/models/dinov2-large": tiny_dinov2(root / "dinov2"),
        "/models/pt_inception-2015-12-05-6726825d.pth": inception,
        "/models/ViT-L-14-336px.pt": clip,
        "/models/HPS_v2.1_compressed.pt": clip,
        "/data/eval/prompts.txt": root / "prompts.txt",
        "/data/eval/geneval2_data.jsonl": geneval2_benchmark(root / "geneval2_data.jsonl"),
        "/models/Qwen3-VL-8B-Instruct": tiny_vlm_judge(root / "judge"),
        "/data/eval/images": a["t2i_images"],
        "/data/imagenet/val": a["cls_images"],
        "/data/latents/t2i_512": root / "latents_t2i",
        "/data/latents/imagenet256": root / "latents_cls",
    }
    encode = [
        "-m",
        "lightning_muon.recipes.encode_latents",
        "--vae",
        a["vae"],
        "--image-size",
        16,
        "--shard-size",
        5,
        "--batch-size",
        4,
        "--device",
        "cpu",
    ]
    proc = run(
        [
            *torchrun(2),
            *encode,
            "--images",
            a["t2i_images"],
            "--text-encoder",
            root / "t5",
            "--out",
            root / "latents_t2i",
        ],
        root,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run([sys.executable, *encode, "--images", a["cls_images"], "--flip", "--out", root / "latents_cls"], root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a["paths"] = {k: str(v) for k, v in paths.items()}
    return a


def localize(value, paths):
    """The config value with every /models/… and /data/… path replaced by its tiny stand-in (an unknown one fails:
    the mapping must cover every path a shipped config names)."""
    if isinstance(value, dict):
        return {k: localize(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [localize(v, paths) for v in value]
    if isinstance(value, str) and value.startswith(("/models/", "/data/")):
        return paths[value]
    return value


def user_override(name, assets):
    """The override a user writes: local paths, a 2-rank CPU launch, a tiny model, a few steps and samples."""
    cfg = load_config(*SHIPPED_CONFIGS[name])
    callbacks = localize(cfg["trainer"]["callbacks"], assets["paths"])
    for callback in callbacks:
        init = callback.setdefault("init_args", {})
        if callback["class_path"].endswith("ModelCheckpoint"):
            init["every_n_train_steps"] = 2
        if callback["class_path"].endswith("GenerationEvaluation"):
            init.update(every_n_steps=2, real_image_size=16, progress=False)
            init["sampling"] = {
                **init.get("sampling", {}),
                "num_samples": 10,
                "batch_size": 4,
                "num_inference_steps": 2,
            }
            clip = str(assets["clip_model"])
            init["suite"] = {**init["suite"], "clip_model": clip, "hps_model": clip}
            # (num_samples 10: the Inception Score's 10 splits need 10)
    model = {k: localize(v, assets["paths"]) for k, v in cfg["model"].items() if k.endswith("_path")}
    model["model_config"] = {**cfg["model"]["model_config"], **SHRINK[cfg["model"]["architecture"]]}
    model["warmup_steps"] = 1
    data = {
        "class_path": cfg["data"]["class_path"],
        "init_args": {
            **localize(cfg["data"]["init_args"], assets["paths"]),
            "batch_size": 2,
            "num_workers": 0,
            "val_fraction": 0.25,
        },
    }
    trainer = {
        "accelerator": "cpu",
        "devices": 2,
        "num_nodes": 1,
        "max_steps": 4,
        "val_check_interval": 2,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "callbacks": callbacks,
    }
    return {"trainer": trainer, "model": model, "data": data}


def fit(name, assets, workdir, **model_overrides):
    override = user_override(name, assets)
    override["model"].update(model_overrides)
    path = workdir / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    configs = [arg for p in SHIPPED_CONFIGS[name] for arg in ("--config", p)]
    return run([sys.executable, "-m", "lightning_muon.recipes.cli", "fit", *configs, "--config", path], workdir)


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_shipped_config_end_to_end(name, assets, tmp_path):
    proc = fit(name, assets, tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    rows = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    evaluation = next(
        c
        for c in load_config(*SHIPPED_CONFIGS[name])["trainer"]["callbacks"]
        if c["class_path"].endswith("GenerationEvaluation")
    )
    metrics = evaluation["init_args"]["suite"]["metrics"]
    assert [r["step"] for r in rows] == [2, 4]
    keys = {k for k in rows[0] if k.startswith("eval/") and k != "eval/seconds"}
    assert len(keys) >= len(metrics) and all(math.isfinite(r[k]) for r in rows for k in keys), rows

    from torch.distributed.checkpoint import FileSystemReader

    saved = set(FileSystemReader(str(checkpoints / "epoch=0-step=2.ckpt")).read_metadata().state_dict_metadata)
    assert any(k.startswith("state_dict.model.") for k in saved) and any(k.startswith("state_dict.ema.") for k in saved)
    frozen = [k for k in saved if "vae" in k or "text_encoder" in k or "encoder.block" in k]
    assert not frozen, frozen[:5]  # frozen encoders are reloaded from their paths, never checkpointed

    if name not in EVALUATED:
        return
    paths = assets["paths"]
    t2i = name.startswith("t2i")
    real = paths["/data/eval/images"] if t2i else paths["/data/imagenet/val"]
    weights = [
        *("--dinov2-weights", paths["/models/dinov2-large"]),
        *("--inception-weights", paths["/models/pt_inception-2015-12-05-6726825d.pth"]),
        *("--clip-weights", paths["/models/ViT-L-14-336px.pt"]),
        *("--hps-weights", paths["/models/HPS_v2.1_compressed.pt"]),
        *("--clip-model", assets["clip_model"], "--hps-model", assets["clip_model"]),
    ]
    prompts = ["--prompts-file", paths["/data/eval/prompts.txt"]] if t2i else []
    if "geneval2" in metrics:
        prompts += ["--geneval2-prompts", paths["/data/eval/geneval2_data.jsonl"]]
        prompts += ["--geneval2-judge", paths["/models/Qwen3-VL-8B-Instruct"]]
    cmd = [
        *torchrun(2),
        "-m",
        "lightning_muon.recipes.cli",
        "evaluate",
        tmp_path / "lightning_logs",
        "--out",
        tmp_path / "eval",
        "--metrics",
        *metrics,
        "--real",
        real,
        "--image-size",
        16,
        "--num-samples",
        10,
        "--batch-size",
        4,
        "--num-inference-steps",
        2,
        *weights,
        *prompts,
    ]
    proc = run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    import csv

    evaluated = list(csv.DictReader((tmp_path / "eval" / "results.csv").open()))
    assert sorted(int(r["step"]) for r in evaluated) == [2, 4]
    assert all(math.isfinite(float(r[k])) for r in evaluated for k in keys), evaluated


def test_a_latent_config_without_vae_path_fails_before_training(assets, tmp_path):
    """The control: the same run with ``vae_path`` dropped stops at the dry run, naming the key to set."""
    proc = fit("t2i_1p3b", assets, tmp_path, vae_path=None)
    assert proc.returncode != 0 and "set vae_path" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "lightning_logs" / "version_0" / "checkpoints").exists()  # no step was trained
