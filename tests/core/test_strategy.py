"""Trainer(strategy="muon_fsdp") on CPU with gloo: fit, distributed checkpoint, resume on the same and another
device count with the same branch schedule and loss curve; clear errors for unsupported set-ups."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_workers import meta_init_worker
from helpers import run_distributed

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parents[1] / "scripts" / "fit_muon_fsdp.py"


def fit(tmp_path, name, devices, epochs, ckpt=None, extra=(), check=True):
    record = tmp_path / f"{name}.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--devices",
        str(devices),
        "--epochs",
        str(epochs),
        "--root",
        str(tmp_path / name),
        "--record",
        str(record),
        *extra,
    ]
    if ckpt:
        cmd += ["--ckpt-path", str(ckpt)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(record.read_text())
    return proc


def curve(rows):
    return [(r["step"], r["branches"]["refresh"] > 0) for r in rows], [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_fsdp")
    out = {"straight": fit(tmp, "straight", devices=2, epochs=2), "first": fit(tmp, "first", devices=2, epochs=1)}
    ckpt = tmp / "first" / "ckpt" / "last.ckpt"
    assert ckpt.is_dir() and any(ckpt.glob("*.distcp"))  # a torch.distributed.checkpoint directory
    out["resume1"] = fit(tmp, "resume1", devices=1, epochs=2, ckpt=ckpt)
    return {**out, "dir": tmp, "ckpt": ckpt}


def test_fit_trains_with_periodic_schedule(runs):
    schedule, losses = curve(runs["straight"])
    assert [s for s, _ in schedule] == list(range(1, 13))
    assert [refresh for _, refresh in schedule] == [(t - 1) % 3 == 0 for t in range(1, 13)]
    assert losses[-1] < losses[0]
    assert {r["world"] for r in runs["straight"]} == {2}


# the same device count is slow-only: the default suite resumes 2 ranks on 2 with a transformers Llama
# (tests/core/test_your_model.py) and here on another device count
@pytest.mark.parametrize("resumed", [pytest.param("resume2", marks=pytest.mark.slow), "resume1"])
def test_resume_continues_schedule_and_loss_curve(runs, resumed):
    if resumed not in runs:
        runs[resumed] = fit(runs["dir"], resumed, devices=2, epochs=2, ckpt=runs["ckpt"])
    want_schedule, want_losses = curve(runs["straight"][6:])
    got_schedule, got_losses = curve(runs[resumed])
    assert got_schedule == want_schedule  # steps 7..12, refresh at 7 and 10
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    assert curve(runs["first"])[1] == curve(runs["straight"][:6])[1]


@pytest.mark.slow
def test_adaptive_schedule_resumes_from_a_distributed_checkpoint(tmp_path):
    """The adaptive schedule's per-matrix state (reference momentum shards, host ages, drifts, counts) goes through
    torch.distributed.checkpoint: the resumed run takes the uninterrupted run's per-matrix decisions and losses."""
    extra = ["--optimizer", "adaptive"]
    straight = fit(tmp_path, "straight", devices=2, epochs=2, extra=extra)
    fit(tmp_path, "first", devices=2, epochs=1, extra=extra)
    resumed = fit(tmp_path, "resumed", devices=2, epochs=2, ckpt=tmp_path / "first" / "ckpt" / "last.ckpt", extra=extra)
    refreshes = [r["branches"]["refresh"] for r in straight]
    assert len(set(refreshes) - {0, refreshes[0]}) > 0  # some matrices refresh on their own steps (e.g. 5 of 14)
    assert [r["branches"] for r in resumed] == [r["branches"] for r in straight[6:]]
    assert resumed[-1]["refreshes"] == straight[-1]["refreshes"]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[6:]], rel=1e-5)


@pytest.mark.slow  # a fact about Lightning's callback, not this package's code: 27 s of launcher start-up
def test_lightnings_ema_weight_averaging_breaks_under_muon_fsdp(runs, tmp_path):
    """Why ``lightning_muon.callbacks.EMA`` stays: Lightning 2.6's ``EMAWeightAveraging`` deep-copies the module in
    ``setup``, before the strategy shards it, so its average holds plain full tensors on every rank, and the first
    update copies DTensor shards into them and fails. The control is the same 2-rank run without it (``runs``)."""
    assert runs["first"]  # the control trained
    proc = fit(tmp_path, "ema", devices=2, epochs=1, extra=["--ema-weight-averaging"], check=False)
    assert proc.returncode != 0
    assert "weight_averaging.py" in proc.stderr and "got mixed torch.Tensor and DTensor" in proc.stderr


def test_a_muon_matrix_left_unsharded_is_named_before_the_first_step():
    """The strategy's check on the optimizer it set up (the end-to-end run through Trainer.setup is slow-only)."""
    import torch

    from lightning_muon import MuonFSDPStrategy, PeriodicRowwiseMuon

    strategy = MuonFSDPStrategy()
    strategy.optimizers = [PeriodicRowwiseMuon([("blocks.0.attn.weight", torch.nn.Parameter(torch.randn(4, 4)))])]
    with pytest.raises(TypeError, match=r"Muon parameter blocks.0.attn.weight \(4, 4\) is not a DTensor"):
        strategy._check_optimizers()


@pytest.mark.slow
def test_partially_sharded_muon_matrices_fail_clearly(tmp_path):
    proc = fit(tmp_path, "bad", devices=2, epochs=1, extra=["--partial-shard"], check=False)
    assert proc.returncode != 0 and "is not a DTensor" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_users_torch_adamw_under_muon_fsdp_equals_lightnings_model_parallel(tmp_path):
    """Any optimizer is accepted: torch.optim.AdamW on the same FSDP2 sharding as Lightning's own strategy."""
    ours = fit(tmp_path, "ours", devices=2, epochs=1, extra=["--optimizer", "adamw"])
    lightning = fit(
        tmp_path, "lightning", devices=2, epochs=1, extra=["--optimizer", "adamw", "--strategy", "model_parallel"]
    )
    assert [r["loss"] for r in ours] == pytest.approx([r["loss"] for r in lightning], rel=1e-6)
    assert len(ours) == 6 and ours[-1]["loss"] < ours[0]["loss"]


def test_fit_validate_test_predict_in_one_process(tmp_path):
    """The process group outlives each call (Lightning owns it); every call ends cleanly, exit code 0."""
    script = Path(__file__).parents[1] / "scripts" / "lifecycle_muon_fsdp.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = json.loads((tmp_path / "done.json").read_text())
    assert done["stages"] == ["fit", "validate", "test", "predict"] and done["predictions"] == 16
    assert done["val_loss"] > 0 and done["test_loss"] > 0


def test_meta_device_init_leaves_nothing_uninitialized():
    for result in run_distributed(meta_init_worker, 2):
        for arch, r in result.items():
            assert r["was_meta"] and r["pos_embed_equal"] and r["finite"] and r["ema_equal"], arch
        assert len(result["pixart"]["table_std"]) == 3  # the root table and one per block
        assert all(0.5 < s < 1.5 for s in result["pixart"]["table_std"])


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "gloo"])
def test_a_rank_that_raises_under_nccl_aborts_its_group_before_the_callbacks(monkeypatch, backend):
    """``on_exception`` under NCCL — alone or in a mixed group — aborts the process group (its in-flight collectives
    cancelled: teardown and exit cannot block on peers), once, and before any callback's ``on_exception`` (the
    strategy puts its hook first in ``trainer.callbacks``); under gloo — the control — it leaves the group to the
    exit hook; an agreed SIGTERM stop aborts nothing. The backend query and the abort are recorded: NCCL needs
    GPUs."""
    import lightning as L
    import torch
    import torch.distributed.distributed_c10d as c10d
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_muon.strategy import MuonFSDPStrategy, _AbortFirst

    events = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: events.append("abort"))

    class CollectiveOnException(L.Callback):  # e.g. OnExceptionCheckpoint's collective save
        def on_exception(self, trainer, pl_module, exception):
            events.append("callback")

    strategy = MuonFSDPStrategy()
    trainer = L.Trainer(strategy="auto", callbacks=[CollectiveOnException()], logger=False)
    trainer.callbacks.insert(0, _AbortFirst())  # what MuonFSDPStrategy.setup does
    monkeypatch.setattr(type(trainer), "strategy", property(lambda self: strategy))
    strategy.on_exception(SIGTERMException())
    assert events == []  # every rank stops at the same step: collectives still work
    for callback in trainer.callbacks:  # Lightning's order, then the strategy's own hook
        callback.on_exception(trainer, None, RuntimeError("a rank failed"))
    strategy.on_exception(RuntimeError("a rank failed"))
    assert events == (["abort", "callback"] if "nccl" in backend else ["callback"])
