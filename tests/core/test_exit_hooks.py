"""The exit hooks' order: ``muon_fsdp``'s hook (registered in ``setup_environment``, after the transport's, so it runs
first) gives gloo's workers their grace while the group still exists, then destroys it. CI saw a 2-rank CLI run abort at
exit ("terminate called without an active exception") while the grace was skipped: the transport's hook ran second
and found no group."""

import time

import torch.distributed as dist

from lightning_muon import strategy
from lightning_muon.optim import transport


def test_the_strategy_exit_hook_gives_gloo_its_grace_before_destroying_the_group(tmp_path, monkeypatch):
    graces = []  # (seconds asked for, whether the group still existed): recorded, not slept
    monkeypatch.setattr(time, "sleep", lambda s: graces.append((s, dist.is_initialized())))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        strategy._destroy_process_group_at_exit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not dist.is_initialized()
    assert graces == [(transport.GLOO_EXIT_GRACE, True)]
    # control: the transport's hook alone, after the group was destroyed, gives none to a group that carried none of
    # this package's collectives
    graces.clear()
    monkeypatch.setattr(transport, "_carried_gloo", False)
    transport.release_gloo_workers_at_exit()
    assert graces == []


def test_a_gloo_group_that_carried_our_collectives_gets_its_grace_after_the_script_destroyed_it(tmp_path, monkeypatch):
    """A user's script that calls ``destroy_process_group()`` itself (``benchmarks/exit_aborts.py`` does): the hook
    still gives gloo's workers their grace (control: an NCCL-like backend is not noted)."""
    graces = []
    monkeypatch.setattr(time, "sleep", lambda s: graces.append(s))
    monkeypatch.setattr(transport, "_carried_gloo", False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    transport.note_gloo_collectives()
    dist.destroy_process_group()
    transport.release_gloo_workers_at_exit()
    assert graces == [transport.GLOO_EXIT_GRACE]
    monkeypatch.setattr(transport, "_carried_gloo", False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    transport.note_gloo_collectives()
    assert transport._carried_gloo is False
