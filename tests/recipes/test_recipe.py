"""The DiT recipe: CLI default run, optimizer selection, generation, EMA, resume, data errors, configs."""

import json
import os
import re
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import SMALL_DIT, tiny_text_encoder, tiny_vae
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_muon.recipes.data import (
    DigitsDataModule,
    ImageFolder,
    LatentShardsDataModule,
    write_latent_shard,
    write_manifest,
)
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.networks import build_transformer
from lightning_muon.recipes.shipped import CONFIGS, SHIPPED_CONFIGS, load_config


def scalars(event_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_cli_default_fit_writes_logs_and_checkpoint_and_learns(tmp_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")  # reference statistics and the digits classifier: outside the run
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LIGHTNING_MUON_CACHE": str(cache)}
    cmd = [
        sys.executable,
        "-m",
        "lightning_muon.recipes.cli",
        "fit",
        "--trainer.max_steps",
        "120",
        "--trainer.val_check_interval",
        "60",
        "--trainer.log_every_n_steps",
        "10",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # stdout is a pipe, as in a Slurm log: progress comes as lines, evaluations too, and no escape codes
    assert "step 50/120 (41%) | " in proc.stdout and "step 120/120 (100%) | " in proc.stdout
    assert "evaluation at step 120: eval/fd_digits=" in proc.stdout and "\x1b[" not in proc.stdout
    version = tmp_path / "lightning_logs" / "version_0"
    assert list(version.glob("events.out.tfevents.*"))
    assert list((version / "checkpoints").glob("*.ckpt"))
    loss = [v for _, v in scalars(version, "train/loss")]
    assert len(loss) >= 10
    assert sum(loss[-5:]) / 5 < 0.8 * sum(loss[:5]) / 5  # the training loss falls on digits
    assert (version / "config.yaml").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(version))
    events.Reload()
    lr_tags = [t for t in events.Tags()["scalars"] if t.startswith("lr-PeriodicRowwiseMuon")]
    assert lr_tags and len(scalars(version, lr_tags[0])) >= 10  # the default config's learning-rate monitor
    noise = proc.stdout + proc.stderr
    assert "LeafSpec" not in noise and "litlogger" not in noise and "logging interval" not in noise
    summary = proc.stdout[proc.stdout.index("Trained 120 steps.") :]
    assert "eval/fd_digits: last" in summary and "checkpoint" in summary
    assert f"tensorboard --logdir {version.resolve()}" in summary or f"tensorboard --logdir {version}" in summary

    last = version / "checkpoints" / "last.ckpt"
    quick = ["--ckpt_path", str(last), "--trainer.enable_progress_bar", "false"]
    for subcommand in ("validate",):  # `test` is the same LightningCLI path (Trainer.test: tests/core/test_strategy.py)
        proc = subprocess.run(
            [*cmd[:3], subcommand, *quick], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"{'val' if subcommand == 'validate' else 'test'}/loss" in proc.stdout
    predict = [*cmd[:3], "predict", *quick, "--data.init_args.predict_samples", "12", "--model.predict_steps", "2"]
    proc = subprocess.run(predict, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = tmp_path / "lightning_logs" / "samples"
    pngs = sorted(p.name for p in samples.glob("*.png"))
    assert pngs == [f"{i:06d}_class{i % 10}.png" for i in range(12)]
    assert f"Predicted samples: {samples.resolve()}" in proc.stdout + proc.stderr
    evaluate = [*cmd[:3], "evaluate", "lightning_logs/version_0", "--num-samples", "40", "--num-inference-steps", "2"]
    proc = subprocess.run(evaluate, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "lightning_logs" / "eval" / "results.csv").is_file()
    assert "kept in float32" not in proc.stdout + proc.stderr  # diffusers' warning about an empty list, silenced
    assert [p.name for p in tmp_path.iterdir()] == ["lightning_logs"]  # everything a run writes is under its logs
    assert (cache / "eval_reference").is_dir()


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "lightning_muon.recipes.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_help_lists_options(capsys):
    """In this process (the entry point's ``main``, as ``lightning-muon`` calls it): four interpreter starts cost 45 s
    on a 2-core machine; that the installed command starts is the default-fit test's."""
    from lightning_muon.recipes.cli import main

    def help_of(*args):
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        return exit_info.value.code, capsys.readouterr().out

    code, out = help_of("fit", "--help")
    assert code == 0 and "--model.optimizer" in out and "--model.muon.period" in out
    _, listed = help_of("--help")
    assert all(sub in listed for sub in ("fit", "validate", "test", "predict", "evaluate", "doctor"))
    code, out = help_of("evaluate", "--help")
    assert code == 0 and "--metrics" in out
    code, out = help_of("doctor", "--help")
    assert code == 0 and "--skip" in out and "pre-flight" in out
    assert "lightning_muon.recipes.doctor_worker" in out  # a role's target, as plain text
    for command in ("evaluate", "doctor"):  # help reads as text: no reStructuredText markup
        assert not re.search(r":[a-z]+:`|``|\*\*", help_of(command, "--help")[1])
    assert re.search(
        r":[a-z]+:`", import_module("lightning_muon.recipes.doctor").__doc__
    )  # the control: the source has it


@pytest.mark.parametrize(
    ("name", "period", "has_muon"), [("adamw", None, False), ("muon", 1, True), ("periodic_muon", 3, True)]
)
def test_optimizer_names_give_the_right_groups(name, period, has_muon):
    module = DiTModule(model_config=SMALL_DIT, optimizer=name)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    muon_groups = [g for g in opt.param_groups if g["use_muon"]]
    assert bool(muon_groups) == has_muon
    if has_muon:
        assert {g["period"] for g in muon_groups} == {period}
        names = {n for g in muon_groups for n in g["param_names"]}
        assert "transformer_blocks.0.attn1.to_q.weight" in names and "pos_embed.proj.weight" not in names
    covered = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert covered == sum(p.numel() for p in module.model.parameters())


def test_bad_names_and_hyperparameters_are_clear_errors():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        DiTModule(optimizer="sgd")
    with pytest.raises(ValueError, match="objective must be one of"):
        DiTModule(objective="edm")
    with pytest.raises(ValueError, match="period"):  # optimizer options are checked at construction, not later
        DiTModule(model_config=SMALL_DIT, muon={"period": 0})


@pytest.mark.parametrize("objective", ["flow", "ddpm"])
def test_generate_is_deterministic_and_batch_independent(objective):
    torch.manual_seed(0)
    module = DiTModule(model_config=SMALL_DIT, objective=objective)
    module.configure_model()
    labels, seeds = [3, 1, 4, 1, 5], [10, 11, 12, 13, 14]
    a = module.generate(labels, seeds, num_inference_steps=4, guidance_scale=2.0, batch_size=5)
    b = module.generate(labels, seeds, num_inference_steps=4, guidance_scale=2.0, batch_size=2)
    single = module.generate(labels[2:3], seeds[2:3], num_inference_steps=4, guidance_scale=2.0)
    assert a.dtype == torch.uint8 and a.shape == (5, 1, 8, 8)
    assert (a.int() - b.int()).abs().max() <= 1 and (a[2:3].int() - single.int()).abs().max() <= 1
    other = module.generate(labels, [20, 11, 12, 13, 14], num_inference_steps=4, guidance_scale=2.0)
    assert not torch.equal(other[0], a[0]) and (other[1:].int() - a[1:].int()).abs().max() <= 1


def test_generation_uses_ema_weights():
    module = DiTModule(model_config=SMALL_DIT)
    module.configure_model()
    with torch.no_grad():
        for p in module.ema.parameters():
            p.mul_(0.5)
    ema = module.generate([1, 2], [0, 1], num_inference_steps=3)
    raw = module.generate([1, 2], [0, 1], num_inference_steps=3, use_ema=False)
    assert not torch.equal(ema, raw)
    for p in module.ema.parameters():
        assert not p.requires_grad


class LossRecorder(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append((trainer.global_step, float(outputs["loss"])))


class StopAt(Callback):
    """A run interrupted at ``step`` (it keeps the lr schedule of the full run, as a crashed job would)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def fit_digits(tmp_path, max_steps, ckpt_path=None, stop_at=None):
    L.seed_everything(0)
    recorder = LossRecorder()
    extra = [StopAt(stop_at)] if stop_at else []
    callbacks = [recorder, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=10), *extra]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(DiTModule(model_config=SMALL_DIT), DigitsDataModule(batch_size=64), ckpt_path=ckpt_path)
    return recorder.losses


def test_resume_continues_the_same_loss_curve(tmp_path):
    """Interrupted mid-epoch (24 steps per epoch) at step 10, resumed to step 48: the same batches, noise and
    updates as one uninterrupted run, through the epoch boundary."""
    straight = fit_digits(tmp_path / "a", 48)
    assert [v for _, v in fit_digits(tmp_path / "b", 48, stop_at=10)] == [v for _, v in straight[:10]]
    resumed = fit_digits(tmp_path / "c", 48, ckpt_path=tmp_path / "b" / "ckpt" / "last.ckpt")
    assert [s for s, _ in resumed] == list(range(11, 49))
    assert [v for _, v in resumed] == pytest.approx([v for _, v in straight[10:]], rel=1e-6)


class LrRecorder(Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit_schedule(root, max_steps, schedule, ckpt_path=None, save_at=None):
    """``(losses, lrs)`` of a digits fit under ``schedule`` (warm-up 5, WSD decay over 1/4 of the steps); with
    ``save_at`` it writes ``root/branch.ckpt`` at that step, as the frontier study's stable runs do."""
    L.seed_everything(0)
    recorder, lrs = LossRecorder(), LrRecorder()
    callbacks = [recorder, lrs]
    if save_at is not None:

        class Save(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == save_at:
                    trainer.save_checkpoint(root / "branch.ckpt")

        callbacks.append(Save())
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    module = DiTModule(model_config=SMALL_DIT, schedule=schedule, warmup_steps=5, decay_fraction=0.25)
    trainer.fit(module, DigitsDataModule(batch_size=64), ckpt_path=ckpt_path)
    return [v for _, v in recorder.losses], lrs.lrs


def test_wsd_decays_linearly_over_its_last_steps_and_branches_from_a_constant_run(tmp_path):
    """WSD of 32 steps: warm-up 5, stable to step 24, then lr·(32 − step)/8. A constant-lr run checkpointed at step
    24 and resumed as WSD with max_steps=32 is the straight WSD run (the frontier study's branches). Control:
    resumed as cosine, it is not."""
    lr = 0.02
    losses, lrs = fit_schedule(tmp_path / "wsd", 32, "wsd")
    assert lrs[:5] == pytest.approx([lr * (s + 1) / 5 for s in range(5)])
    assert lrs[5:24] == pytest.approx([lr] * 19) and lrs[24:] == pytest.approx(
        [lr * (32 - s) / 8 for s in range(24, 32)]
    )
    stable, stable_lrs = fit_schedule(tmp_path / "constant", 24, "constant", save_at=24)
    assert stable_lrs == pytest.approx(lrs[:24]) and stable == losses[:24]
    branch, branch_lrs = fit_schedule(tmp_path / "b", 32, "wsd", ckpt_path=tmp_path / "constant" / "branch.ckpt")
    assert branch_lrs == pytest.approx(lrs[24:]) and branch == pytest.approx(losses[24:], rel=1e-6)
    cosine, _ = fit_schedule(tmp_path / "c", 32, "cosine", ckpt_path=tmp_path / "constant" / "branch.ckpt")
    assert cosine != pytest.approx(losses[24:], rel=1e-6)
    with pytest.raises(ValueError, match="decay_fraction"):
        DiTModule(schedule="wsd", decay_fraction=0.0)


def test_seeds_set_the_data_order_and_the_training_draws():
    """``DigitsDataModule(seed=)`` sets the order and ``DiTModule(noise_seed=)`` the noise and timesteps: the same seed
    draws the same (what pairs the frontier study's arms), another seed draws otherwise; seed 0 is the order and the
    draws of every run before the options existed (control: the loss of a step under another noise seed differs)."""

    def first_batch(seed: int) -> torch.Tensor:
        data = DigitsDataModule(batch_size=16, seed=seed)
        data.setup("fit")
        return next(iter(data.train_dataloader()))["labels"]

    assert torch.equal(first_batch(3), first_batch(3)) and not torch.equal(first_batch(3), first_batch(0))
    data = DigitsDataModule(batch_size=16)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    perm = torch.randperm(len(data.train_set), generator=torch.Generator().manual_seed(0))[:16]
    assert torch.equal(batch["labels"], data.train_set[perm]["labels"])

    def step_loss(noise_seed: int) -> float:
        torch.manual_seed(0)
        module = DiTModule(model_config=SMALL_DIT, noise_seed=noise_seed)
        module.configure_model()
        module.log = lambda *args, **kwargs: None  # no Trainer attached
        return module.training_step(batch, 0).item()

    assert step_loss(5) == step_loss(5) and step_loss(5) != step_loss(0)
    with pytest.raises(ValueError, match="noise_seed"):
        DiTModule(noise_seed=-1)


def test_image_folder_errors_name_the_corrupt_file(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (20, 12), color=(i * 100, 50, 200)).save(tmp_path / cls / f"{i}.png")
    (tmp_path / "dog" / "broken.png").write_bytes(b"not a png")
    data = ImageFolder(tmp_path, size=8)
    item = data[0]
    assert item["images"].shape == (3, 8, 8) and item["images"].min() >= -1 and data.classes == ["cat", "dog"]
    broken = data.files.index(tmp_path / "dog" / "broken.png")
    with pytest.raises(OSError, match=r"broken\.png"):
        data[broken]
    tolerant = ImageFolder(tmp_path, size=8, skip_corrupt=True)
    assert tolerant[broken]["images"].shape == (3, 8, 8) and tolerant.skipped == 1


def test_latent_shards_round_trip(tmp_path):
    write_latent_shard(tmp_path / "a.safetensors", torch.randn(3, 4, 8, 8), labels=torch.arange(3))
    write_latent_shard(tmp_path / "b.safetensors", torch.randn(2, 4, 8, 8), labels=torch.arange(2))
    write_manifest(tmp_path)
    dm = LatentShardsDataModule(str(tmp_path), batch_size=5, num_workers=0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["latents"].shape == (5, 4, 8, 8) and batch["labels"].shape == (5,)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        LatentShardsDataModule(str(tmp_path / "empty")).setup()


@pytest.mark.parametrize(
    ("config", "billions"),
    [("dit_xl2_imagenet256", 0.675), ("t2i_1p3b", 1.3), ("t2i_4b", 4.0), ("t2i_9b", 9.0), ("t2i_15b", 15.0)],
)
def test_paper_configs_match_their_names(config, billions):
    cfg = load_config(*SHIPPED_CONFIGS[config])
    with torch.device("meta"):
        model = build_transformer(cfg["model"]["architecture"], cfg["model"]["model_config"])
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(count - billions) <= 0.15 * billions, count
    assert (
        cfg["trainer"]["strategy"] == "muon_fsdp" and cfg["model"]["muon"]["period"] == 3 and cfg["model"]["vae_path"]
    )
    if config.startswith("t2i"):
        assert cfg["trainer"]["precision"] == "bf16-mixed" and cfg["model"]["muon"]["rownorm_scale"] == 0.15
        assert cfg["trainer"]["num_nodes"] > 1 and cfg["trainer"]["val_check_interval"] == 5000


def test_all_configs_parse_with_the_cli():
    from lightning_muon.recipes.cli import main

    assert {p.name for stack in SHIPPED_CONFIGS.values() for p in stack} == {p.name for p in CONFIGS.glob("*.yaml")}
    for name, stack in SHIPPED_CONFIGS.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", *[arg for p in stack for arg in ("--config", str(p))], "--print_config"])
        assert exit_info.value.code == 0, name


@pytest.mark.distributed
@pytest.mark.slow  # the same 2-rank CLI fit with evaluation runs in the default set as the step census's
def test_cli_muon_fsdp_two_devices_with_evaluation_and_telemetry(tmp_path):
    """The default recipe on 2 CPU ranks with muon_fsdp: distributed sampling, sharded evaluation, DCP checkpoints,
    communication counted by the telemetry."""
    override = Path(__file__).parents[1] / "scripts" / "muon_fsdp_two_devices.yaml"
    cmd = [
        sys.executable,
        "-m",
        "lightning_muon.recipes.cli",
        "fit",
        "--config",
        str(CONFIGS / "digits_tiny.yaml"),
        "--config",
        str(override),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = tmp_path / "lightning_logs" / "version_0"
    rows = [yaml.safe_load(line) for line in (version / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20] and all(r["eval/fd_digits"] > 0 for r in rows)
    assert (version / "checkpoints" / "epoch=0-step=10.ckpt").is_dir()  # distributed checkpoint
    sent = dict(scalars(version, "optim/rownorm_bytes_sent"))
    refresh = dict(scalars(version, "optim/refresh"))
    # optimizer step t at logger step t - 1; RowNorm steps all-reduce column statistics
    assert refresh[0] == 1.0 and refresh[1] == 0.0 and sent[1] > 0


def test_pixart_with_a_text_encoder_trains_and_generates(tmp_path):
    tiny_text_encoder(tmp_path / "t5")
    pixart = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=3,
        out_channels=3,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
    )
    module = DiTModule(
        architecture="pixart", model_config=pixart, text_encoder_path=str(tmp_path / "t5"), max_caption_length=6
    )
    module.configure_model()
    batch = {"images": torch.rand(4, 3, 8, 8) * 2 - 1, "caption": ["a red cat", "a dog", "two birds", "a blue car"]}
    loss = module.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and module.model.caption_projection.linear_1.weight.grad is not None
    assert module.text_encoder.encoder.shared.weight.grad is None  # the text encoder is frozen
    a = module.generate(["a red cat", "a dog"], [1, 2], num_inference_steps=3, guidance_scale=3.0)
    b = module.generate(["a red cat", "a dog"], [1, 2], num_inference_steps=3, guidance_scale=3.0, batch_size=1)
    assert a.shape == (2, 3, 8, 8) and (a.int() - b.int()).abs().max() <= 1
    with pytest.raises(FileNotFoundError, match="text_encoder_path"):
        DiTModule(
            architecture="pixart", model_config=pixart, text_encoder_path=str(tmp_path / "none")
        ).configure_model()


def test_encode_latents_script_feeds_latent_shards(tmp_path):
    from PIL import Image

    from lightning_muon.recipes.encode_latents import main as encode

    tiny_vae(tmp_path / "vae")
    tiny_text_encoder(tmp_path / "t5")
    images = tmp_path / "images"
    images.mkdir()
    lines = []
    for i, caption in enumerate(["a red cat", "a dog", "two birds", "a blue car", "a cat"]):
        Image.new("RGB", (24, 20), color=(40 * i, 90, 200)).save(images / f"{i}.png")
        lines.append(json.dumps({"file": f"{i}.png", "caption": caption}))
    (images / "captions.jsonl").write_text("\n".join(lines))
    shards = encode(
        [
            "--images",
            str(images),
            "--vae",
            str(tmp_path / "vae"),
            "--text-encoder",
            str(tmp_path / "t5"),
            "--out",
            str(tmp_path / "latents"),
            "--image-size",
            "16",
            "--shard-size",
            "3",
            "--max-caption-length",
            "6",
            "--batch-size",
            "2",
            "--device",
            "cpu",
        ]
    )
    assert len(shards) == 2
    dm = LatentShardsDataModule(str(tmp_path / "latents"), batch_size=5, num_workers=0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["latents"].shape == (5, 4, 8, 8) and batch["caption_embeds"].shape == (5, 6, 12)
    pixart = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
    )
    module = DiTModule(architecture="pixart", model_config=pixart)
    module.configure_model()
    assert torch.isfinite(module.training_step(batch, 0))


def test_memory_estimate_counts_every_part_and_the_big_configs_fit_an_80gb_gpu():
    from lightning_muon.recipes.memory import memory_per_gpu

    for name in ("t2i_9b", "t2i_15b"):
        config = load_config(*SHIPPED_CONFIGS[name])
        r = memory_per_gpu(config)
        parts = ("states", "fsdp", "refresh", "adaptive", "telemetry", "frozen", "activations")
        assert r["total"] == pytest.approx(sum(r[p] for p in parts)) and r["total"] < 75, r
        # telemetry's two fp32 copies of the shards on its logging steps; the adaptive schedule's reference momenta
        assert r["telemetry"] == pytest.approx(8 * r["params_B"] * 1e9 / r["gpus"] / 2**30) and r["adaptive"] == 0
        adaptive = {**config, "model": {**config["model"], "refresh_schedule": "adaptive"}}
        assert 0 < memory_per_gpu(adaptive)["adaptive"] < r["telemetry"] / 2
        # scatter holds three buckets at once, gather two (64 MiB each)
        assert memory_per_gpu(config, refresh="scatter")["refresh"] - memory_per_gpu(config, refresh="gather")[
            "refresh"
        ] == pytest.approx(64 / 1024)
        assert r["frozen"] > 8.5  # T5-XXL in bf16
        # DINOv2-L, Inception, CLIP-L and ViT-H in fp32 (6.5 GiB) and the 8B judge in bf16 (16.3 GiB)
        assert r["eval"] == pytest.approx((4 * (304.4e6 + 23.9e6 + 427.9e6 + 986.1e6) + 2 * 8.767e9) / 2**30)
        assert r["states"] + r["frozen"] + r["eval"] < r["eval peak"] < 75, r
        without_judge = {**config, "trainer": {**config["trainer"], "callbacks": []}}
        assert memory_per_gpu(without_judge)["eval peak"] == 0  # the control: no evaluation, no evaluation peak
        strategy = {"class_path": "lightning_muon.MuonFSDPStrategy", "init_args": {"blocks": "BasicTransformerBlock"}}
        named = {**config, "trainer": {**config["trainer"], "strategy": strategy}}
        assert memory_per_gpu(named) == r  # the strategy's block definition: PixArt's blocks by class name
        strategy["init_args"]["blocks"] = "NoSuchBlock"  # the control: the estimate reads it
        with pytest.raises(ValueError, match="No parameter of PixArtTransformer2DModel goes to Muon"):
            memory_per_gpu(named)
        config["model"]["gradient_checkpointing"] = False  # the control: without recomputation it does not fit
        assert memory_per_gpu(config)["activations"] > 50


def test_schedule_and_orthogonalizer_options_reach_the_optimizer(capsys):
    """Layer-wise K, the adaptive schedule, a refresh warm-up and an opt-in orthogonalizer, set from the command line,
    end up in the optimizer's groups (attention at K=2, the other matrices at the config's K=3)."""
    import yaml

    from lightning_muon.recipes.cli import main

    flags = {
        "muon.schedule": "adaptive",
        "muon.drift_threshold": "0.3",
        "muon.max_period": "6",
        "param_overrides": '{"attention": {"period": 2}}',
        "muon.ns_method": "gram",
        "muon.ns_coefficients": "polar_express",
        "muon.refresh_warmup": "5",
    }
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *[arg for k, v in flags.items() for arg in (f"--model.{k}", v)], "--print_config"])
    assert exit_info.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)["model"]
    assert cfg["param_overrides"] == {"attention": {"period": 2}} and cfg["muon"]["drift_threshold"] == 0.3
    module = DiTModule(model_config=SMALL_DIT, muon=cfg["muon"], param_overrides=cfg["param_overrides"])
    module.configure_model()
    groups = [g for g in module.configure_optimizers()["optimizer"].param_groups if g["use_muon"]]
    attention = next(g for g in groups if "transformer_blocks.0.attn1.to_q.weight" in g["param_names"])
    assert attention["period"] == 2 and {g["period"] for g in groups} == {2, 3}
    assert all(g["schedule"] == "adaptive" and g["ns_method"] == "gram" and g["max_period"] == 6 for g in groups)
    assert all(g["ns_coefficients"] == "polar_express" and g["refresh_warmup"] == 5 for g in groups)


@pytest.mark.parametrize("quiet", [pytest.param(False, marks=pytest.mark.slow), True])  # the control (False): slow set
def test_lightning_notices_are_dropped_by_the_cli(quiet, tmp_path):
    """The litlogger tip and the LeafSpec deprecation print without ``quiet_lightning_notices`` (the control) and not
    with it."""
    code = f"""
import logging, warnings
import lightning as L
import torch
from lightning.pytorch.utilities import _pytree
from lightning_muon.recipes.cli import quiet_lightning_notices
logging.basicConfig(level=logging.INFO)
warnings.simplefilter("default")
if {quiet}:
    quiet_lightning_notices()
L.Trainer(accelerator="cpu", enable_progress_bar=False, default_root_dir=".")
_pytree._tree_flatten(torch.zeros(1))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert ("litlogger" in out, "LeafSpec" in out) == ((False, False) if quiet else (True, True)), out


@pytest.mark.parametrize(
    ("mistake", "named"),
    [
        (["--model.muon.period", "0"], "period"),
        (["--model.muon.lr", "-1"], "lr"),
        (["--data.batch_size", "0"], "batch_size"),
        (["--model.optimizer", "sgd"], "model.optimizer"),
        (["--trainer.max_step", "20"], "--trainer.max_step"),  # no abbreviation of max_steps
        # LightningCLI's own optimizer would replace configure_optimizers and skip muon_param_groups silently
        (["--optimizer", "Adam"], "--optimizer"),
        (["--lr_scheduler", "StepLR"], "--lr_scheduler"),
    ],
)
def test_a_command_line_mistake_is_a_short_error_naming_the_option(mistake, named, capsys, tmp_path, monkeypatch):
    from lightning_muon.recipes.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as control:  # a valid value parses (--print_config exits 0)
        main(["fit", "--model.muon.period", "2", "--print_config"])
    assert control.value.code in (0, None) and "period: 2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *mistake])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0 and named in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 15, err
    assert list(tmp_path.iterdir()) == []  # refused before anything is built: no empty lightning_logs/version_N


def test_a_shipped_config_by_name_from_any_directory(tmp_path, monkeypatch, capsys):
    """``--config NAME`` names a shipped run from any directory (a wheel install has no recipes/configs/ beside it);
    a file of that name in the directory wins, and an unknown name passes unchanged to the parser (the controls)."""
    from lightning_muon.recipes.cli import main
    from lightning_muon.recipes.shipped import SHIPPED_CONFIGS, shipped_config_paths

    base, size = (str(p) for p in SHIPPED_CONFIGS["t2i_1p3b"])
    assert shipped_config_paths(["fit", "-c", "t2i_1p3b", "--x", "1"]) == ["fit", "-c", base, "-c", size, "--x", "1"]
    dit = str(SHIPPED_CONFIGS["dit_xl2_imagenet256"][0])
    assert shipped_config_paths(["fit", "--config=dit_xl2_imagenet256"]) == ["fit", "--config", dit]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t2i_4b").write_text("trainer: {max_steps: 7}\n")
    assert shipped_config_paths(["fit", "--config", "t2i_4b"]) == ["fit", "--config", "t2i_4b"]
    assert shipped_config_paths(["fit", "--config", "no_such"]) == ["fit", "--config", "no_such"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "dit_xl2_imagenet256", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "LatentShardsDataModule" in capsys.readouterr().out
