"""The optimizer's arithmetic is unchanged: fixed-seed runs equal the weights and state recorded before #25's move."""

import pytest
import torch
from optim.recorded_runs import RECORDED, RUNS, run


@pytest.fixture(scope="module")
def recorded():
    return torch.load(RECORDED, weights_only=True)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_fixed_seed_run_equals_the_recorded_weights_and_state(recorded, name):
    """Bit for bit on the CPU kind they were recorded on (float32 matmul kernels differ between CPU instruction
    sets, so elsewhere to 1e-5)."""
    expected, actual = recorded["runs"][name], run(name)
    assert sorted(actual) == sorted(expected)
    same_cpu = torch.backends.cpu.get_cpu_capability() == recorded["cpu_capability"]
    for key in expected:
        if same_cpu:
            assert torch.equal(actual[key], expected[key]), f"{name}: {key} differs from the recorded run"
        else:
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")


def test_control_a_changed_rownorm_scale_is_caught(recorded):
    """Deliberate break: a 1% different gamma no longer equals the recording."""
    options = RUNS["fixed_k3_skip"][0]
    RUNS["fixed_k3_skip"][0]["rownorm_scale"] = options["rownorm_scale"] * 1.01
    try:
        actual = run("fixed_k3_skip")
    finally:
        RUNS["fixed_k3_skip"][0]["rownorm_scale"] = 0.15
    assert not torch.equal(actual["weight0"], recorded["runs"]["fixed_k3_skip"]["weight0"])
