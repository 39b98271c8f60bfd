"""lightning_muon.checkpoint: a partial checkpoint is never trusted (every kind of damage found without loading), the
newest complete one is found (also after a replacement cut short), a directory resolves to it, single files are
written whole or not at all."""

import pytest
from helpers import distributed_checkpoint

from lightning_muon.checkpoint import (
    atomic_write,
    checkpoint_problem,
    is_distributed_checkpoint,
    newest_checkpoint,
    remove_checkpoint,
    resolve_checkpoint,
)


def test_checkpoint_problem_finds_every_kind_of_partial_checkpoint(tmp_path):
    good = distributed_checkpoint(tmp_path / "good.ckpt")
    assert checkpoint_problem(good) is None
    shard = next(good.glob("*.distcp"))
    for name, damage in {
        "truncated-shard": lambda p: (p / shard.name).write_bytes((p / shard.name).read_bytes()[:10]),
        "missing-shard": lambda p: (p / shard.name).unlink(),
        "missing-meta": lambda p: (p / "meta.pt").unlink(),
        "garbage-metadata": lambda p: (p / ".metadata").write_bytes(b"\x80\x04garbage"),
    }.items():
        bad = distributed_checkpoint(tmp_path / f"{name}.ckpt")
        damage(bad)
        assert checkpoint_problem(bad) is not None, name
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert checkpoint_problem(tmp_path / "empty.ckpt") is not None
    assert newest_checkpoint(tmp_path) == (good, 3)


def test_newest_checkpoint_takes_the_highest_step_and_restores_an_interrupted_replacement(tmp_path):
    distributed_checkpoint(tmp_path / "step=2.ckpt", meta={"global_step": 2})
    distributed_checkpoint(tmp_path / ".last.ckpt.old", meta={"global_step": 5})  # killed between the renames
    distributed_checkpoint(tmp_path / ".last.ckpt.partial", meta={"global_step": 6})  # never trusted
    assert newest_checkpoint(tmp_path) == (tmp_path / "last.ckpt", 5)
    remove_checkpoint(tmp_path / "last.ckpt")
    assert newest_checkpoint(tmp_path) == (tmp_path / "step=2.ckpt", 2)


def test_atomic_write_leaves_no_temporaries_and_clears_those_of_dead_writers(tmp_path):
    import socket

    stale = tmp_path / f".f.txt.{socket.gethostname()}-999999999.tmp"  # no such pid
    stale.write_text("half")
    atomic_write(tmp_path / "f.txt", lambda tmp: tmp.write_text("whole"))
    with pytest.raises(ZeroDivisionError):
        atomic_write(tmp_path / "f.txt", lambda tmp: (tmp.write_text("partial"), 1 / 0))
    assert (tmp_path / "f.txt").read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_a_directory_resolves_to_its_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    old = distributed_checkpoint(run / "step=2.ckpt", meta={"global_step": 2})
    new = distributed_checkpoint(run / "step=4.ckpt", meta={"global_step": 4})
    assert is_distributed_checkpoint(new) and not is_distributed_checkpoint(run)
    assert resolve_checkpoint(run) == new and resolve_checkpoint(old) == old  # a checkpoint is itself
    next(new.glob("*.distcp")).unlink()  # the control: damaged, the newer one is passed over
    assert resolve_checkpoint(run) == old
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
        resolve_checkpoint(tmp_path / "empty")
