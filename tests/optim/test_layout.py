"""Data flows one way: optimizer → refresh / RowNorm → transport → kernels, and only sharded work reaches the
transport."""

import ast
import sys
from pathlib import Path

import torch

import lightning_muon.optim.transport as transport
from lightning_muon import PeriodicRowwiseMuon

TRANSPORT = Path(transport.__file__)


def test_the_transport_imports_nothing_from_the_optimizer_and_takes_no_callable():
    tree = ast.parse(TRANSPORT.read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "lightning_muon.optim.muon" not in imported and imported >= {"lightning_muon.optim.refresh"}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for arg in fn.args.args:
            assert "Callable" not in ast.unparse(arg.annotation or ast.Constant("")), f"{fn.name}({arg.arg})"


def functions_run_in(path: Path, fn) -> set[str]:
    """Names of the functions of ``path`` that run while ``fn()`` runs (sys.setprofile: nothing is replaced)."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and Path(frame.f_code.co_filename) == path:
            seen.add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_a_single_device_step_runs_no_transport_code():
    """Refresh and RowNorm steps, with the non-finite check: nothing of transport.py runs. Control: the detector sees
    ``comm_stats()`` read the transport's counter."""
    params = [torch.randn(24, 16, requires_grad=True), torch.randn(16, 24, requires_grad=True)]
    opt = PeriodicRowwiseMuon(params, period=2, rownorm_scale="auto")

    def steps():
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()

    assert functions_run_in(TRANSPORT, steps) == set()
    assert "pop" in functions_run_in(TRANSPORT, opt.comm_stats)
