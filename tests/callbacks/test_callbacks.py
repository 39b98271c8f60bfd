"""GenerationEvaluation, OptimizerTelemetry and `lightning-muon evaluate` with real Trainers and TensorBoard files."""

import csv
import json
import subprocess
import sys

import lightning as L
import pytest
import torch
from dist_workers import generation_eval_worker
from helpers import SMALL_DIT, TINY_DIT, fork_ranks, run_distributed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_muon.callbacks import GenerationEvaluation, OptimizerTelemetry
from lightning_muon.metrics import DigitsFeatures
from lightning_muon.recipes.data import DigitsDataModule
from lightning_muon.recipes.evaluate import find_checkpoints, load_generator
from lightning_muon.recipes.evaluate import main as evaluate
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.trust import checkpoint_meta


@pytest.fixture(scope="module")
def cache(digits_cache, monkeypatch_module):
    monkeypatch_module.setenv("LIGHTNING_MUON_CACHE", str(digits_cache))  # the session's trained digits classifier
    return digits_cache


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def event_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def fit(root, max_steps, callbacks, optimizer="periodic_muon", log_every=1, strategy="auto", **trainer_kwargs):
    L.seed_everything(0)
    trainer_kwargs = {"limit_val_batches": 0, **trainer_kwargs}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=root,
        logger=TensorBoardLogger(root, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=log_every,
        strategy=strategy,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(DiTModule(model_config=SMALL_DIT, optimizer=optimizer), DigitsDataModule(batch_size=32))
    return trainer


def test_generation_evaluation_logs_at_the_expected_steps(cache, tmp_path):
    evaluation = GenerationEvaluation(
        sampling={"num_samples": 64, "num_inference_steps": 3, "batch_size": 32},
        every_n_steps=10,
        grid_size=16,
        progress=False,
    )
    trainer = fit(tmp_path, 25, [evaluation, ModelCheckpoint(every_n_train_steps=10, save_top_k=-1)])
    acc = event_scalars(trainer.logger.log_dir)
    fd = acc.Scalars("eval/fd_digits")
    # every 10 steps and at the end of training, at Lightning's logger step (optimizer steps before the batch)
    assert [e.step for e in fd] == [9, 19, 24]
    assert {"eval/precision_digits", "eval/recall_digits", "eval/seconds"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Images("eval/samples")] == [9, 19, 24]
    rows = [
        json.loads(line)
        for line in (tmp_path / "logs" / "version_0" / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [10, 20, 25]
    assert [r["eval/fd_digits"] for r in rows] == pytest.approx([e.value for e in fd], rel=1e-6)


def test_train_val_eval_lr_and_telemetry_scalars_share_step_numbers(cache, tmp_path):
    """In TensorBoard the evaluation after optimizer step 10 sits at the step of that batch's train/loss, of the
    validation run after it and of its learning rate (Lightning's logger step 9), so the curves line up. (Logged at
    the optimizer step, the evaluation would sit at 10 and 20, beside no loss: the break this catches.)"""
    from lightning.pytorch.callbacks import LearningRateMonitor

    evaluation = GenerationEvaluation(
        sampling={"num_samples": 32, "num_inference_steps": 2, "batch_size": 32},
        every_n_steps=10,
        grid_size=0,
        progress=False,
    )
    callbacks = [evaluation, OptimizerTelemetry(), LearningRateMonitor(logging_interval="step")]
    trainer = fit(tmp_path, 20, callbacks, log_every=5, val_check_interval=10, limit_val_batches=1)
    acc = event_scalars(trainer.logger.log_dir)

    def steps(tag):
        return {e.step for e in acc.Scalars(tag)}

    lr = next(t for t in acc.Tags()["scalars"] if t.startswith("lr-"))
    assert steps("eval/fd_digits") == steps("val/loss") == {9, 19}
    assert {9, 19} <= steps("train/loss") == steps(lr) == steps("optim/step_ms") == {4, 9, 14, 19}


def test_best_fd_checkpoint_is_the_lowest_fd_in_metrics_jsonl(cache, tmp_path):
    def best(mode):
        return ModelCheckpoint(
            dirpath=tmp_path / mode,
            monitor="eval/fd_digits",
            mode=mode,
            every_n_train_steps=2,
            save_top_k=1,
            filename="best-step={step}",
            auto_insert_metric_name=False,
        )

    evaluation = GenerationEvaluation(
        sampling={"num_samples": 32, "num_inference_steps": 2, "batch_size": 32},
        every_n_steps=2,
        grid_size=16,
        progress=False,
    )
    lowest, highest = best("min"), best("max")
    trainer = fit(tmp_path, 10, [ModelCheckpoint(every_n_train_steps=2, save_top_k=-1), evaluation, lowest, highest])
    rows = [
        json.loads(line)
        for line in (tmp_path / "logs" / "version_0" / "checkpoints" / "metrics.jsonl").read_text().splitlines()
    ]
    fd = {r["step"]: r["eval/fd_digits"] for r in rows}
    assert sorted(fd) == [2, 4, 6, 8, 10]
    argmin, argmax = min(fd, key=fd.get), max(fd, key=fd.get)
    assert argmin != argmax  # the control (mode="max") must pick another checkpoint
    assert lowest.best_model_path.endswith(f"best-step={argmin}.ckpt")
    assert highest.best_model_path.endswith(f"best-step={argmax}.ckpt")
    assert float(lowest.best_model_score) == pytest.approx(fd[argmin])
    image = event_scalars(trainer.logger.log_dir).Images("eval/samples")[-1]
    assert min(image.width, image.height) >= 256  # 4x4 grid of 8x8 samples, upscaled


def test_missing_weights_fail_at_setup_before_training(cache, tmp_path):
    evaluation = GenerationEvaluation(suite={"metrics": ["fd_dinov2"], "dinov2_weights": str(tmp_path / "no-dinov2")})
    with pytest.raises(FileNotFoundError, match="DINOv2 weights not found"):
        fit(tmp_path, 5, [evaluation])
    with pytest.raises(ValueError, match="needs `inception_weights=`"):
        fit(tmp_path, 5, [GenerationEvaluation(suite={"metrics": ["fid"]})])


def test_telemetry_logs_a_refresh_exactly_every_k_steps(cache, tmp_path):
    trainer = fit(tmp_path, 12, [OptimizerTelemetry()])
    acc = event_scalars(trainer.logger.log_dir)
    refresh = [(e.step, e.value) for e in acc.Scalars("optim/refresh")]
    assert refresh == [(t - 1, float((t - 1) % 3 == 0)) for t in range(1, 13)]  # step t at logger step t - 1
    tags = set(acc.Tags()["scalars"])
    assert {"optim/step_ms", "optim/update_rms/group0", "optim/grad_norm/group0"} <= tags
    assert all(e.value > 0 for e in acc.Scalars("optim/update_rms/group0"))
    matrix = [(e.step, e.value) for e in acc.Scalars("optim/refreshes/transformer_blocks.0.attn1.to_q.weight")]
    assert matrix == [(t - 1, float((t - 1) // 3 + 1)) for t in range(1, 13)]  # NS5 refreshes so far, per matrix
    group = dict((e.step, e.value) for e in acc.Scalars("optim/refreshes/group0"))
    assert group[11] > matrix[-1][1] and group[11] % matrix[-1][1] == 0  # every matrix of the group alike
    descent = [e.value for e in acc.Scalars("optim/rownorm_vs_ns5/descent/group0")]
    rms = [e.value for e in acc.Scalars("optim/rownorm_vs_ns5/rms/group0")]
    assert len(descent) == len(rms) == 12 and all(d > 1 for d in descent) and all(0.8 < r < 2 for r in rms)
    assert not any(t.startswith("optim/gamma/") for t in tags)  # a fixed γ: nothing calibrated


def test_telemetry_reports_the_calibrated_gamma_and_the_ratios_it_inverts(cache, tmp_path):
    """Under rownorm_scale="auto" the logged γ (mean, min, max over the group's matrices) is what the optimizer's
    states hold, and its mean inverse-relates to the logged descent ratio (control: the RMS ratio does not)."""
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=TensorBoardLogger(tmp_path, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        limit_val_batches=0,
        callbacks=[OptimizerTelemetry()],
    )
    module = DiTModule(model_config=SMALL_DIT, muon={"rownorm_scale": "auto"})
    trainer.fit(module, DigitsDataModule(batch_size=32))
    acc = event_scalars(trainer.logger.log_dir)
    gamma = {k: acc.Scalars(f"optim/gamma/group0/{k}")[-1].value for k in ("mean", "min", "max")}
    opt = trainer.optimizers[0]
    held = torch.stack([opt.state[p]["refresh_scales"][0] for p in opt.param_groups[0]["params"]])
    assert gamma == pytest.approx({"mean": held.mean().item(), "min": held.min().item(), "max": held.max().item()})
    assert gamma["min"] < gamma["mean"] < gamma["max"]
    descent = acc.Scalars("optim/rownorm_vs_ns5/descent/group0")[-1].value
    assert descent == pytest.approx(float((1 / held.double()).mean()), rel=1e-6)
    rms = acc.Scalars("optim/rownorm_vs_ns5/rms/group0")[-1].value
    assert rms != pytest.approx(descent, rel=1e-3)


@pytest.mark.distributed
def test_ddp_evaluation_equals_single_process(cache, tmp_path):
    classifier = cache / "digits_classifier.pt"
    single = generation_eval_worker(0, 1, classifier, tmp_path / "ref1", 51)
    for values in run_distributed(generation_eval_worker, 2, classifier, tmp_path / "ref2", 51):
        assert values.keys() == single.keys()
        for key, value in single.items():
            assert values[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _fit_without_checkpointing(rank, world, root):
    """A 2-rank muon_fsdp fit with an evaluation at its last step and no checkpoint callback (metrics.jsonl goes to
    ``trainer.log_dir``, which Lightning broadcasts)."""
    from lightning_muon.recipes.module import DiTModule

    evaluation = GenerationEvaluation(
        suite={"metrics": ["fd_digits"]},
        sampling={"num_samples": 16, "num_inference_steps": 2, "batch_size": 16},
        every_n_steps=2,
        grid_size=4,
        progress=False,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="muon_fsdp", max_steps=2, enable_checkpointing=False,
        logger=TensorBoardLogger(root), enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[evaluation],
    )  # fmt: skip
    trainer.fit(DiTModule(model_config=TINY_DIT), DigitsDataModule(batch_size=8))


@pytest.mark.distributed
def test_an_evaluation_without_checkpointing_publishes_on_2_ranks(cache, tmp_path):
    """With checkpointing off the evaluation's folder is ``trainer.log_dir`` — a broadcast, made by every rank (it was
    made by rank 0 alone, inside its publishing branch: a hang or a mismatched collective)."""
    ranks = fork_ranks(_fit_without_checkpointing, 2, 240, str(tmp_path))
    assert [r["code"] for r in ranks] == [0, 0], ranks[0]["log"][-3000:] + ranks[1]["log"][-3000:]
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [2]


def test_evaluate_two_runs_writes_csv_markdown_png_and_resumes(cache, tmp_path):
    for name, optimizer in (("adamw", "adamw"), ("periodic", "periodic_muon")):
        fit(tmp_path / name, 20, [ModelCheckpoint(every_n_train_steps=10, save_top_k=-1)], optimizer=optimizer)
    runs = [str(tmp_path / "adamw"), str(tmp_path / "periodic")]
    args = ["--out", str(tmp_path / "eval"), "--num-samples", "48", "--num-inference-steps", "3", "--batch-size", "48"]
    evaluate(runs + args)
    rows = list(csv.DictReader((tmp_path / "eval" / "results.csv").open()))
    assert sorted((r["run"], int(r["step"])) for r in rows) == [
        ("adamw", 10),
        ("adamw", 20),
        ("periodic", 10),
        ("periodic", 20),
    ]
    assert "| adamw | 10 |" in (tmp_path / "eval" / "results.md").read_text()
    png = tmp_path / "eval" / "fd_digits.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = (tmp_path / "eval" / "results.csv").read_text()
    evaluate(runs + args)  # nothing left to do: the CSV is unchanged
    assert (tmp_path / "eval" / "results.csv").read_text() == before


@pytest.mark.distributed
@pytest.mark.slow  # 43 s; every shipped config's end-to-end run (slow set) also evaluates its distributed checkpoints
def test_evaluate_reads_distributed_checkpoints(cache, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "lightning_muon.recipes.cli",
        "fit",
        "--trainer.strategy",
        "muon_fsdp",
        "--trainer.devices",
        "1",
        "--trainer.max_steps",
        "10",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.callbacks",
        "[]",
        "--trainer.val_check_interval",
        "10",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps",
        "10",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = find_checkpoints(str(tmp_path / "lightning_logs"))
    assert ckpt.is_dir()  # a torch.distributed.checkpoint directory
    assert checkpoint_meta(ckpt)["global_step"] == 10
    module, _ = load_generator(ckpt, torch.device("cpu"))  # only the EMA weights, into the sampling network
    import torch.distributed.checkpoint as dcp

    key = "transformer_blocks.0.attn1.to_q.weight"
    ema, trained = torch.empty_like(module.model.state_dict()[key]), torch.empty_like(module.model.state_dict()[key])
    dcp.load({"state_dict": {f"ema.{key}": ema, f"model.{key}": trained}}, checkpoint_id=str(ckpt))
    assert module.ema is None and torch.equal(module.model.state_dict()[key], ema) and not torch.equal(ema, trained)
    out = tmp_path / "eval"
    evaluate(
        [
            str(tmp_path / "lightning_logs"),
            "--out",
            str(out),
            "--num-samples",
            "32",
            "--num-inference-steps",
            "2",
            "--batch-size",
            "32",
        ]
    )
    assert (out / "results.csv").read_text().count("\n") == 2
    assert torch.isfinite(torch.tensor(float(next(csv.DictReader((out / "results.csv").open()))["eval/fd_digits"])))


def test_generation_evaluation_on_every_checkpoint(cache, tmp_path):
    evaluation = GenerationEvaluation(
        sampling={"num_samples": 32, "num_inference_steps": 2, "batch_size": 32},
        every_n_steps=0,
        on_checkpoint=True,
        progress=False,
    )
    trainer = fit(tmp_path, 14, [evaluation, ModelCheckpoint(every_n_train_steps=7, save_top_k=-1, save_last=True)])
    assert [h["step"] for h in evaluation.history] == [7, 14]
    assert [e.step for e in event_scalars(trainer.logger.log_dir).Scalars("eval/fd_digits")] == [6, 13]


def test_text_to_image_evaluation_scores_prompts_with_hps(cache, tmp_path):
    """A tiny PixArt with a tiny T5 generates for prompts i mod P; HPSv2 scores exactly those image-prompt pairs."""
    from fixtures import tiny_open_clip_config
    from helpers import tiny_text_encoder

    from lightning_muon.metrics import FrechetDistance, HPSv2Score
    from lightning_muon.metrics.evaluation import Sampling, prepare_references, score_generation

    tiny_text_encoder(tmp_path / "t5")
    _, clip_path = tiny_open_clip_config(tmp_path)
    pixart = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=3,
        out_channels=3,
        num_layers=1,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
    )
    torch.manual_seed(0)
    module = DiTModule(
        architecture="pixart", model_config=pixart, text_encoder_path=str(tmp_path / "t5"), max_caption_length=6
    )
    module.configure_model()
    prompts = ["a red cat", "a dog", "two birds"]
    metrics = {
        "hpsv2": HPSv2Score(clip_path, model_name="tiny-test-clip"),
        "fd_digits": FrechetDistance(DigitsFeatures()),
    }
    prepare_references(metrics, DigitsDataModule().real_images, tmp_path / "ref", "digits", 256)
    values, grid, higher = score_generation(
        module,
        metrics,
        Sampling(7, num_inference_steps=2, guidance_scale=2.0, batch_size=4),
        grid_size=4,
        progress=False,
        prompts=prompts,
    )
    assert {"eval/hpsv2", "eval/fd_digits"} <= values.keys() and grid.shape == (4, 3, 8, 8)
    assert higher == {"eval/hpsv2": True, "eval/fd_digits": False}  # each metric's higher_is_better
    expected_prompts = [prompts[i % 3] for i in range(7)]
    images = module.generate(expected_prompts, list(range(7)), 2, 2.0)
    independent = HPSv2Score(clip_path, model_name="tiny-test-clip").scores(images, expected_prompts).mean()
    assert values["eval/hpsv2"] == pytest.approx(float(independent), rel=1e-4)


class _Regression(L.LightningModule):
    """A linear model and its EMA copy on fixed data: no randomness, so batch 32 == 2 x 16 accumulated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        self.ema = torch.nn.Linear(8, 1).requires_grad_(False)
        self.ema.load_state_dict(self.model.state_dict())

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(-1))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def test_ema_updates_once_per_optimizer_step_under_gradient_accumulation(tmp_path):
    decay = 0.9
    from lightning_muon.callbacks import EMA

    results = {}
    for batch_size, accumulate in ((32, 1), (16, 2)):
        module, ema = _Regression(), EMA(decay)
        module.batch_size = batch_size
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=8,
            accumulate_grad_batches=accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ema],
            default_root_dir=tmp_path,
        )
        trainer.fit(module)
        assert ema.updates == trainer.global_step == 8  # per-batch updating (the old hook) would make 16
        results[accumulate] = (module.model.weight.detach().clone(), module.ema.weight.detach().clone())
    (w1, e1), (w2, e2) = results[1], results[2]
    torch.testing.assert_close(w2, w1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e2, e1, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(e1, w1)  # the average is not the weights


def test_dit_module_brings_its_ema_callback():
    from lightning_muon.callbacks import EMA

    assert [type(c) for c in DiTModule(model_config=SMALL_DIT, ema_decay=0.99).configure_callbacks()] == [EMA]
    assert DiTModule(model_config=SMALL_DIT, ema_decay=0.0).configure_callbacks() == []


def test_early_stopping_reads_the_evaluation(cache, tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping

    evaluation = GenerationEvaluation(
        sampling={"num_samples": 16, "num_inference_steps": 1, "batch_size": 16},
        every_n_steps=1,
        grid_size=0,
        progress=False,
    )
    # an improvement of 1e6 is never reached: the first check sets the best, the second stops training
    stop = EarlyStopping(monitor="eval/fd_digits", mode="min", patience=0, min_delta=1e6, check_on_train_epoch_end=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[evaluation, stop],
        default_root_dir=tmp_path,
    )
    trainer.fit(DiTModule(model_config=SMALL_DIT), DigitsDataModule(batch_size=512))
    assert stop.stopped_epoch == 1 and trainer.global_step == 6  # 3 steps per epoch


def test_evaluate_flags_and_the_callback_share_the_engines_defaults():
    """``evaluate``'s flags are the fields of Sampling and MetricSuite, and the callback takes the same objects whole
    (control: a changed default is seen)."""
    import inspect
    from dataclasses import fields

    from lightning_muon.metrics.evaluation import MetricSuite, Sampling
    from lightning_muon.recipes.evaluate import build_parser

    args = vars(build_parser().parse_args(["run"]))
    for f in (*fields(Sampling), *fields(MetricSuite)):
        want = None if f.name == "num_classes" else f.default  # evaluate reads it from the checkpoint
        assert args[f.name] == (list(want) if isinstance(want, tuple) else want), f.name
    signature = inspect.signature(GenerationEvaluation.__init__).parameters
    assert signature["sampling"].default == Sampling() and signature["suite"].default == MetricSuite()
    assert signature["sampling"].default != Sampling(seed=1)  # the control


def test_evaluate_scores_a_checkpoint_as_the_callback_did_at_its_step(cache, tmp_path):
    """The same weights (the EMA the step's checkpoint holds) and the same samples: the callback at step 6 and
    ``evaluate`` on the step-6 checkpoint agree. (The callback ran before the EMA callback's update of that step
    until it brought the average up to date itself: FD differed by ~1% on the default run.)"""
    settings = dict(num_samples=48, num_inference_steps=3, batch_size=48)
    evaluation = GenerationEvaluation(sampling=settings, every_n_steps=6, progress=False)
    fit(tmp_path / "run", 6, [evaluation, ModelCheckpoint(every_n_train_steps=6, save_top_k=-1)])
    callback = evaluation.history[-1]
    assert callback["step"] == 6
    args = ["--num-samples", "48", "--num-inference-steps", "3", "--batch-size", "48"]
    evaluate([str(tmp_path / "run"), "--out", str(tmp_path / "eval"), *args])
    (row,) = list(csv.DictReader((tmp_path / "eval" / "results.csv").open()))
    keys = [k for k in callback if k.startswith("eval/") and k != "eval/seconds"]
    assert len(keys) >= 5
    for key in keys:
        assert float(row[key]) == pytest.approx(callback[key], rel=1e-4), key
    # control: the trained weights instead of their average give other numbers
    module, _ = load_generator(next((tmp_path / "run").rglob("*.ckpt")), torch.device("cpu"))
    saved = torch.load(next((tmp_path / "run").rglob("*.ckpt")), weights_only=True)["state_dict"]
    module.model.load_state_dict({k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")})
    from lightning_muon.metrics.evaluation import Sampling, score_generation

    values, _, _ = score_generation(
        module, evaluation.metrics, Sampling(48, num_inference_steps=3, batch_size=48), progress=False
    )
    assert abs(values["eval/fd_digits"] - callback["eval/fd_digits"]) > 1e-3 * callback["eval/fd_digits"]
