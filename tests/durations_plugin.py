"""A pytest plugin (``-p durations_plugin``) that records each test's wall time and what it started: subprocesses
(Popen: CLI runs, scripts, Lightning's launcher), spawned ranks (``torch.multiprocessing``) and in-process
``Trainer.fit`` calls; ``benchmarks/test_durations.py`` turns the records into a table. Nothing is replaced: the
counters wrap the real calls."""

import functools
import json
import os
import subprocess
import time

import pytest

_counts = {"popen": 0, "spawn": 0, "fit": 0}


def _counting(owner, name, key):
    original = getattr(owner, name)

    @functools.wraps(original)  # the same signature: LightningCLI builds `fit`'s options from Trainer.fit's
    def wrapper(*args, **kwargs):
        _counts[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def pytest_configure(config):
    import torch.multiprocessing as mp

    _counting(subprocess.Popen, "__init__", "popen")
    _counting(mp, "spawn", "spawn")
    try:
        from lightning.pytorch import Trainer

        _counting(Trainer, "fit", "fit")
    except ImportError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = dict(_counts), time.perf_counter()
    yield
    row = {"nodeid": item.nodeid, "seconds": time.perf_counter() - start,
           "markers": sorted({m.name for m in item.iter_markers()})}  # fmt: skip
    row.update({k: _counts[k] - before[k] for k in _counts})
    with open(os.environ["TEST_DURATIONS_OUT"], "a") as f:
        f.write(json.dumps(row) + "\n")
