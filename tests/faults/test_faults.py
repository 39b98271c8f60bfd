"""Faults and hostile input: no loader runs code from a file, a failing rank ends the job in seconds, a rank killed
while training or saving leaves nothing partial that a resume would trust, an evaluation cut short is redone.

Each payload is a pickle whose loading would create ``marker``: the loaders must refuse it and the file must not
appear; the controls show that torch's / torch-fidelity's own loaders do run it (so the payloads are live).
"""

import csv
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fixtures import random_inception_state_dict, tiny_open_clip_config
from helpers import (
    TINY_DIT,
    distributed_checkpoint,
    fork_ranks,
    tiny_dinov2,
    tiny_vae,
)

from lightning_muon.checkpoint import (
    check_weights_file,
    checkpoint_problem,
    load_distributed,
    newest_checkpoint,
)
from lightning_muon.parallelize import free_port

HARNESS = Path(__file__).parents[2] / "benchmarks" / "fault_injection" / "harness.py"


class Payload:
    """Unpickling it calls ``Path(marker).touch()``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


# ----------------------------------------------------------------------------------------------- hostile files
def _dcp_metadata(tmp_path, marker):
    path = distributed_checkpoint(tmp_path / "x.ckpt")
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return path


def _dcp_bytes_entry(tmp_path, marker):
    return distributed_checkpoint(tmp_path / "x.ckpt", extra={"obj": Payload(marker)})


def _meta_pt(tmp_path, marker):
    return distributed_checkpoint(tmp_path / "x.ckpt", meta={"global_step": Payload(marker)})


def _single_file(tmp_path, marker):
    torch.save({"state_dict": {}, "global_step": 1, "x": Payload(marker)}, tmp_path / "x.ckpt")
    return tmp_path / "x.ckpt"


def _weights_file(tmp_path, marker, name="weights.pth"):
    torch.save({"weight": Payload(marker)}, tmp_path / name)
    return tmp_path / name


def load_resume(path):
    """What ``muon_fsdp`` resume and ``lightning-muon evaluate`` read from a checkpoint, in their order."""
    if problem := checkpoint_problem(path):
        raise ValueError(problem)
    load_distributed({"state_dict": {"w": torch.zeros(2, 3)}, "obj": 0}, path)


def load_evaluate(path):
    from lightning_muon.recipes.evaluate import load_generator

    load_generator(path, torch.device("cpu"))


def load_inception(tmp_path, marker):
    from lightning_muon.metrics.features import InceptionFeatures

    InceptionFeatures(weights=_weights_file(tmp_path, marker))


def load_clip(tmp_path, marker):
    from lightning_muon.metrics.features import load_open_clip

    tiny_open_clip_config(tmp_path)
    load_open_clip("tiny-test-clip", _weights_file(tmp_path, marker))


def load_digits_classifier(tmp_path, marker):
    from lightning_muon.metrics.features import DigitsFeatures

    DigitsFeatures(path=_weights_file(tmp_path, marker))


def load_reference_cache(tmp_path, marker):
    from helpers import digits_metrics

    metric = digits_metrics(tmp_path / "classifier.pt")["fd_digits"]
    metric.load_reference(_weights_file(tmp_path, marker, "reference.pt"))


def load_dinov2_dir(tmp_path, marker):
    from lightning_muon.metrics.features import DinoV2Features

    path = tiny_dinov2(tmp_path / "dino")
    (path / "model.safetensors").unlink()
    torch.save({"embeddings.cls_token": Payload(marker)}, path / "pytorch_model.bin")
    DinoV2Features(weights=path)


def load_vae_dir(tmp_path, marker):
    from diffusers import AutoencoderKL

    from lightning_muon.recipes.networks import load_local

    path = tiny_vae(tmp_path / "vae")
    (path / "diffusion_pytorch_model.safetensors").unlink()
    torch.save({"encoder.conv_in.weight": Payload(marker)}, path / "diffusion_pytorch_model.bin")
    load_local(AutoencoderKL, str(path), "vae_path")


CHECKPOINT_LOADERS = {
    "dcp-metadata/resume": (_dcp_metadata, load_resume),
    "dcp-metadata/evaluate": (_dcp_metadata, load_evaluate),
    "dcp-bytes-entry/resume": (_dcp_bytes_entry, load_resume),
    "meta.pt/resume": (_meta_pt, load_resume),
    "meta.pt/evaluate": (_meta_pt, load_evaluate),
    "single-file/evaluate": (_single_file, load_evaluate),
}
WEIGHT_LOADERS = {
    "inception": load_inception,
    "open_clip": load_clip,
    "digits-classifier": load_digits_classifier,
    "reference-cache": load_reference_cache,
    "dinov2-dir": load_dinov2_dir,
    "vae-dir": load_vae_dir,
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_LOADERS))
def test_checkpoint_payload_never_runs(tmp_path, case):
    make, load = CHECKPOINT_LOADERS[case]
    marker = tmp_path / "pwned"
    path = make(tmp_path, marker)
    with pytest.raises(Exception) as info:
        load(path)
    assert not marker.exists(), f"{case}: the payload ran"
    assert "pwned" not in str(info.value) or "refused" in str(info.value)
    assert newest_checkpoint(tmp_path) is None  # resume from the directory skips it too
    assert not marker.exists()


@pytest.mark.parametrize("case", sorted(WEIGHT_LOADERS))
def test_weight_file_payload_never_runs(tmp_path, case):
    marker = tmp_path / "pwned"
    with pytest.raises(Exception):  # noqa: B017 - each loader has its own (clear) error type
        WEIGHT_LOADERS[case](tmp_path, marker)
    assert not marker.exists(), f"{case}: the payload ran"


def test_controls_torchs_and_torch_fidelitys_own_loaders_run_the_payloads(tmp_path):
    """The payloads are live: the readers we replace execute them."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    marker = tmp_path / "pwned_metadata"
    path = _dcp_metadata(tmp_path / "a", marker)
    with pytest.raises(BaseException):  # noqa: B017 - torch's CheckpointException is a BaseException
        dcp.load({"state_dict": {"w": torch.zeros(2, 3)}}, checkpoint_id=path)
    assert marker.exists()

    marker = tmp_path / "pwned_bytes"
    path = _dcp_bytes_entry(tmp_path / "b", marker)
    try:
        dcp.load({"state_dict": {"w": torch.zeros(2, 3)}, "obj": 0}, checkpoint_id=path)
    except BaseException:  # noqa: BLE001, S110 - what matters is that it ran
        pass
    assert marker.exists()

    marker = tmp_path / "pwned_inception"
    with pytest.raises(Exception):  # noqa: B017
        FeatureExtractorInceptionV3(
            "inception-v3-compat", ["2048"], feature_extractor_weights_path=str(_weights_file(tmp_path, marker))
        )
    assert marker.exists()


def test_real_inception_weights_pass_the_check(tmp_path):
    torch.save(random_inception_state_dict(), tmp_path / "pt_inception.pth")
    check_weights_file(tmp_path / "pt_inception.pth", "InceptionV3 weights")


# ------------------------------------------------------------------------------------------ failing ranks
@pytest.fixture(scope="module")
def raise_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("raise")
    subprocess.run(
        [sys.executable, str(HARNESS), "raise", "--out", str(out)], check=True, timeout=600, capture_output=True
    )
    return json.loads((out / "report.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(4), ids=["w2-rank1", "w2-rank0", "w3-rank0", "w3-rank2"])
def test_a_rank_that_raises_ends_every_rank_within_seconds(raise_report, case):
    row = raise_report[case]
    assert row["codes"] == [1] * row["world"], row  # every rank non-zero, none hung
    assert row["original_error_logged"]
    assert not row["timeout_in_any_log"]
    assert row["seconds_to_all_exited"] < 10, row  # the process-group timeout is 300 s


@pytest.mark.distributed
@pytest.mark.slow  # 30 s; the default set keeps test_a_rank_that_raises_ends_every_rank_within_seconds (4 cases)
def test_torchrun_reports_the_failing_rank_as_root_cause(tmp_path):
    start = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(HARNESS),
            "run",
            "--fail-rank",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.time() - start
    assert proc.returncode != 0
    assert "RuntimeError: injected failure on rank 1 at step 2" in proc.stderr + proc.stdout
    root_cause = (proc.stderr + proc.stdout).split("Root Cause")[-1]
    assert "rank      : 1" in root_cause
    assert wall < 120, wall  # start-up included; the timeout is 300 s


# ---------------------------------------------------------------------------------------- killed ranks
@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_while_training_and_saving_never_leaves_a_checkpoint_that_resumes_wrong(tmp_path):
    trials = 20
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "kill", "--trials", str(trials), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    summary = {k: v for k, v in report.items() if k != "rows"}
    print(f"\nkill-and-resume: {summary}")
    assert report["killed"] >= trials * 3 // 4, summary  # most trials were really killed mid-run
    assert report["resumed"] >= trials // 2, summary
    assert report["resumed_exactly"] == report["resumed"], summary  # never a mixed or partial state
    assert report["losses_match"], summary  # the loss curve continues exactly
    hung = [  # their logs hold the stacks they dumped before they were killed (kills land after the group formed)
        f"trial{r['trial']:02d}/rank{rank}.log"
        for r in report["rows"]
        for rank, code in enumerate(r["codes"])
        if code == "hung"
    ]
    stacks = {log: (tmp_path / log).read_text()[-3000:] for log in hung}
    assert report["hung"] == 0 and report["max_seconds_to_all_exited"] < 10, (summary, stacks)
    assert report["final_codes"] == [0, 0] and report["final_reached_max_steps"], summary
    assert report["leftover_partial"] == [], summary
    assert report["control_mixed_detected"], summary  # the exactness check does catch a mixed checkpoint


@pytest.mark.distributed
@pytest.mark.slow
def test_resumes_at_epoch_ends_keep_the_data_order(tmp_path):
    """Lightning miscounts epochs after a resume from an epoch's last batch, so the next epoch-end resume used to
    replay an epoch's permutation (found by the kill test); ``muon_fsdp`` repairs the counters. Also: a resume
    from a directory without a complete checkpoint fails on every rank with the reason."""
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "chain", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    repaired, control = report["repair_epochs=True"], report["repair_epochs=False"]
    assert repaired["steps"] == list(range(1, 45)), repaired
    assert repaired["resumed_exactly"] and repaired["mismatched_steps"] == [], repaired
    assert control["mismatched_steps"], control  # without the repair the curve leaves the uninterrupted one
    # only rank 0 resolves a directory (the harness makes it an error on the others), its verdict reaches all
    assert report["resume_from_nothing"] == {"codes": [1, 1], "message_on_every_rank": True}, report


# ------------------------------------------------------------------------------------ evaluation cut short
class FailingGeneration:
    """Fault injection: ``generate`` raises once, during the evaluation at ``step`` (a preemption there)."""

    def __init__(self, step: int) -> None:
        self.step, self.fired = step, False

    def __call__(self, module, generate):
        def wrapped(labels, seeds, num_inference_steps, *args, **kwargs):
            if module.global_step == self.step and num_inference_steps > 1 and not self.fired:
                self.fired = True
                raise RuntimeError("preempted during evaluation")
            return generate(labels, seeds, num_inference_steps, *args, **kwargs)

        return wrapped


def test_an_evaluation_cut_short_is_redone_on_resume_and_none_is_repeated(tmp_path, monkeypatch):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    from lightning_muon.callbacks import GenerationEvaluation
    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule

    monkeypatch.setenv("LIGHTNING_MUON_CACHE", str(tmp_path / "cache"))
    ckpt_dir = tmp_path / "ckpt"

    def fit(max_steps, ckpt_path=None, fail_at=None):
        evaluation = GenerationEvaluation(
            suite={"metrics": ["fd_digits"]},
            sampling={"num_samples": 20, "num_inference_steps": 2, "batch_size": 20},
            every_n_steps=2,
            progress=False,
        )
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=max_steps,
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[
                ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_last=True),
                OnExceptionCheckpoint(ckpt_dir),
                evaluation,
            ],
        )
        module = DiTModule(model_config=TINY_DIT)
        if fail_at is not None:
            module.generate = FailingGeneration(fail_at)(module, module.generate)
        trainer.fit(module, DigitsDataModule(batch_size=16), ckpt_path=ckpt_path)
        return evaluation

    with pytest.raises(RuntimeError, match="preempted during evaluation"):
        fit(max_steps=6, fail_at=4)  # evaluated at 2; killed in the evaluation at 4; on_exception.ckpt at step 4
    assert (ckpt_dir / "on_exception.ckpt").is_file()
    rows = [json.loads(line)["step"] for line in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [2]
    evaluation = fit(max_steps=6, ckpt_path=str(ckpt_dir / "on_exception.ckpt"))
    rows = [json.loads(line)["step"] for line in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [2, 4, 6]  # 4 redone at the start of the resumed run, 2 not repeated
    assert [row["step"] for row in evaluation.history] == [2, 4, 6]  # the history came back with the checkpoint


def test_unknown_checkpoint_hyperparameters_are_named(caplog):
    from lightning_muon.recipes.evaluate import module_from_hparams

    with caplog.at_level("WARNING"):
        hparams = {"model_config": TINY_DIT, "bogus_option": 1, "_instantiator": "x"}
        module_from_hparams({**hparams, "_class_path": "lightning_muon.recipes.module.DiTModule"})
    assert "bogus_option" in caplog.text and "_class_path" not in caplog.text and "_instantiator" not in caplog.text
    with pytest.raises(ValueError, match="not DiTModule"):  # Lightning's key naming another class is refused
        module_from_hparams({**hparams, "_class_path": "x"})


def test_evaluate_reports_a_damaged_checkpoint_and_goes_on(tmp_path, monkeypatch, capsys):
    from lightning_muon.recipes.evaluate import main as evaluate

    monkeypatch.setenv("LIGHTNING_MUON_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "step=1.ckpt").write_bytes(b"not a checkpoint")
    damaged = distributed_checkpoint(run / "step=2.ckpt")
    next(damaged.glob("*.distcp")).unlink()
    with pytest.raises(SystemExit) as info:
        evaluate([str(run), "--out", str(tmp_path / "eval"), "--metrics", "fd_digits", "--num-samples", "8"])
    assert info.value.code == 1
    errors = (tmp_path / "eval" / "errors.txt").read_text()
    assert "step=1.ckpt" in errors and "step=2.ckpt" in errors and "missing or truncated" in errors


def _tiny_checkpoint(path: Path, step: int) -> None:
    """What ``lightning-muon fit`` writes for the tiny DiT, without training."""
    from lightning_muon.recipes.module import DiTModule

    module = DiTModule(model_config=TINY_DIT)
    module.configure_model()
    state = {f"model.{k}": v for k, v in module.model.state_dict().items()}
    state |= {f"ema.{k}": v for k, v in module.ema.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": dict(module.hparams), "global_step": step}, path)


def _evaluate_failing_on_rank_1(rank, world, run, out, where):
    """``evaluate`` under torchrun's environment, rank 1 failing on ``step=1.ckpt`` — at its load or in its scoring."""
    from lightning_muon.recipes import evaluate

    if where == "load":
        load = evaluate.load_generator

        def load_generator(path, *args, **kwargs):
            if rank == 1 and path.name == "step=1.ckpt":
                raise OSError(f"rank {rank} cannot read {path.name}")
            return load(path, *args, **kwargs)

        evaluate.load_generator = load_generator
    else:
        score = evaluate._score

        def _score(module, meta, *args):
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (planted)")
            return score(module, meta, *args)

        evaluate._score = _score
    evaluate.main([run, "--out", out, "--metrics", "fd_digits", "--num-samples", "8", "--num-inference-steps", "1"])


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["load", "scoring"])
def test_evaluate_on_2_ranks_ends_every_rank_together_when_one_fails(digits_cache, tmp_path, monkeypatch, where):
    """One rank cannot load a checkpoint: every rank skips it together (the error named with its rank) and scores
    the next. One rank fails while scoring (an OOM): every rank ends within seconds, the error in that rank's output.
    (Each rank used to catch its own failure and go on to the next checkpoint while the others waited in the
    metric all-gather: a hang, or samples of two checkpoints mixed.)"""
    monkeypatch.setenv("LIGHTNING_MUON_CACHE", str(digits_cache))
    run, out = tmp_path / "run", tmp_path / "eval"
    run.mkdir()
    for step in (1, 2):
        _tiny_checkpoint(run / f"step={step}.ckpt", step)
    ranks = fork_ranks(_evaluate_failing_on_rank_1, 2, 180, str(run), str(out), where)
    logs = "\n".join(r["log"][-2000:] for r in ranks)
    assert all(r["code"] not in (0, "hung") for r in ranks), logs
    assert max(r["seconds"] for r in ranks) - min(r["seconds"] for r in ranks) < 20, ranks
    if where == "load":
        assert "rank 1: OSError: rank 1 cannot read step=1.ckpt" in (out / "errors.txt").read_text()
        steps = [int(row["step"]) for row in csv.DictReader((out / "results.csv").open())]
        assert steps == [2]  # the next checkpoint, scored by both ranks together
    else:
        assert "CUDA out of memory (planted)" in ranks[1]["log"]  # the error, named in the failing rank's output
