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
    # control: the transport's hook alone, after the group was destroyed (the order before the fix), gives none
    graces.clear()
    transport.release_gloo_workers_at_exit()
    assert graces == []
