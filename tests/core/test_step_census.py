"""The loop users run (``lightning-muon fit``, every callback the CLI adds, ``muon_fsdp``, 2 gloo ranks) counted by
``benchmarks/step_census.py``: a typical step makes FSDP2's and the optimizer's collectives and nothing else, and no
host read from this package or from Lightning. Control (slow): a per-step ``sync_dist=True`` log is found."""

import pytest
from step_census import census  # noqa: E402

pytestmark = pytest.mark.distributed


def test_a_typical_step_makes_only_fsdp2_and_optimizer_collectives_and_no_host_read():
    summary = census(steps=16)
    assert summary["violations"] == [], summary["table"]
    for table in summary["ranks"]:
        typical = table["typical"]
        assert typical["steps"] >= 5, table
        assert any(k.endswith("| FSDP2") for k in typical["per_step"])  # the census sees the step's collectives
        assert all(table[kind]["steps"] > 0 for kind in ("logging", "evaluation", "checkpoint", "validation"))


@pytest.mark.slow  # a second fit (about 40 s): in CI's slow run, not the README's
def test_control_a_per_step_sync_dist_log_is_found():
    control = census(steps=4, control=True)
    assert any("barrier per typical step from Lightning" in v and "_sync_ddp" in v for v in control["violations"])
