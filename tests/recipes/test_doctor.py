"""``lightning-muon doctor``: its CPU parts run here; on a CUDA machine the whole check (marked ``gpu``)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_muon.recipes import doctor, doctor_checks


def run_doctor(tmp_path, *args):
    out = tmp_path / "doctor.json"
    cmd = [sys.executable, "-m", "lightning_muon.recipes.cli", "doctor", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ})
    return proc, {r["name"]: r for r in json.loads(out.read_text())} if out.is_file() else {}


@pytest.mark.slow
def test_doctor_runs_its_cpu_checks_and_writes_every_figure(tmp_path):
    proc, rows = run_doctor(tmp_path, "--device", "cpu", "--hidden", "128")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "| check | status | detail |" in proc.stdout
    assert list(rows) == list(doctor.CHECKS)
    assert {name: r["status"] for name, r in rows.items()} == {
        **{name: "ok" for name in doctor.CHECKS},
        "collectives": "skipped",  # NCCL needs two GPUs
        "memory": "skipped",  # max_memory_allocated needs CUDA
        "no host sync": "skipped",  # CUDA's sync debug mode
    }
    assert rows["transports"]["figures"]["scatter_refresh_collectives"] > 0
    assert rows["memory"]["detail"] == "max_memory_allocated needs CUDA"
    fit = rows["sharded fit"]["figures"]  # on 2 gloo CPU ranks, fp32: the same model whatever the rank count
    assert fit["world"] == 2 and all(v <= 1e-4 for k, v in fit.items() if k.endswith("_rel"))
    assert rows["evaluate"]["figures"]["rel"] <= 1e-3
    assert rows["failure"]["figures"]["seconds_to_exit"] < 60 and rows["failure"]["figures"]["exit_code"] != 0
    assert rows["versions"]["figures"]["torch"] == torch.__version__
    assert rows["optimizer"]["figures"]["vs_torch_muon_rel"] <= 1e-4
    assert rows["fused"]["figures"]["fused_vs_eager_rel"] <= 1e-5
    assert rows["ns5"]["figures"]["ratio_128"] > 0
    assert torch.isfinite(torch.tensor(rows["train step"]["figures"]["loss"]))


def test_doctor_reports_a_wrong_optimizer_and_goes_on(tmp_path):
    """Control: with one NS iteration fewer than torch.optim.Muon the optimizer check fails (exit 1) and the
    other checks still run."""
    bad = doctor.optimizer(torch.device("cpu"), ns_steps=4)
    assert bad.status == "FAILED" and "vs_torch_muon_rel" in bad.detail
    assert doctor.optimizer(torch.device("cpu")).status == "ok"
    multi_process = {"sharded fit", "transports", "evaluate", "failure"}
    results = doctor.run_checks(torch.device("cpu"), [64], skip={"fused", "train step", "ns5"} | multi_process)
    assert [r.status for r in results] == ["ok", "ok", "ok"] + ["skipped"] * 10


def test_doctor_steps_both_transports_as_rank_0_of_8_in_one_process(tmp_path):
    """The row a single GPU gets (on a CPU without the sync check): both transports over torch's fake 8-rank group;
    the RowNorm steps all-reduce, the refresh steps exchange (scatter: to owners and back)."""
    row = doctor.transports(torch.device("cpu"), tmp_path)
    assert row.status == "ok", row.detail
    assert row.figures["scatter_refresh_collectives"] > row.figures["gather_refresh_collectives"] > 0
    assert row.figures["gather_rownorm_collectives"] > 0 and "sync check needs CUDA" in row.detail


@pytest.mark.gpu
def test_doctor_on_cuda(tmp_path):
    proc, rows = run_doctor(tmp_path, "--hidden", "1024")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert rows["optimizer"]["figures"]["device_vs_cpu_rel"] <= 1e-4
    assert 0 < rows["memory"]["figures"]["train_ratio"] <= doctor_checks.MEMORY_SLACK
    assert 0 < rows["memory"]["figures"]["eval_ratio"] <= doctor_checks.MEMORY_SLACK
    assert rows["no host sync"]["status"] == "ok"
    if torch.cuda.device_count() >= 2:
        assert {rows[n]["status"] for n in ("sharded fit", "evaluate", "failure")} == {"ok"}
