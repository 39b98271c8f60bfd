"""PeriodicRowwiseMuon on FSDP2 DTensor shards (gloo, 127.0.0.1) against the same optimizer on dense tensors."""

import pytest
import torch
from dist_workers import (
    SHAPES,
    dense_run,
    nonfinite_consensus_worker,
    nonfinite_dense,
    placement_error_worker,
    sharded_run,
)
from helpers import run_distributed

from lightning_muon.optim.kernels import make_orthogonalizer, ns_flops
from lightning_muon.optim.shards import assign_owners

pytestmark = pytest.mark.distributed

CASES = [
    (1, "gather", torch.float32),
    (3, "gather", torch.float32),
    (1, "scatter", torch.float32),
    (3, "scatter", torch.float32),
    (3, "gather", torch.bfloat16),
    (3, "scatter", torch.bfloat16),
    (3, "gather", torch.float32, {"rownorm_scale": "auto"}),
    (3, "scatter", torch.float32, {"rownorm_scale": "auto"}),
    (3, "scatter", torch.bfloat16, {"rownorm_scale": "auto_rms", "auto_scale_multiplier": 0.5}),
]
AUTO = {"rownorm_scale": "auto"}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def sharded(request):
    return request.param, run_distributed(sharded_run, request.param, SHAPES, CASES)


def case_id(i):
    period, mode, dtype, *extra = CASES[i]
    return f"K{period}-{mode}-{str(dtype)[6:]}" + ("-" + extra[0]["rownorm_scale"] if extra else "")


@pytest.mark.parametrize("case", range(len(CASES)), ids=case_id)
def test_sharded_equals_dense(sharded, case):
    """Uneven shards ((7, 5) over 3 ranks: 3, 3, 1 rows) and empty ones ((2, 64) over 3). Auto-γ cases: the γ each
    matrix calibrates (rebuilt by gather, sent back bit for bit by scatter) drives the same steps; control: the
    dense run with the fixed default γ is not what they produced."""
    world, results = sharded
    period, mode, dtype, *extra = CASES[case]
    dense = dense_run(SHAPES, period, mode, dtype, extra=extra[0] if extra else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # bf16 NS5: batching differs between the two runs
    for rank_results in results:
        for got, want in zip(rank_results[case]["params"], dense):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert results[0][case]["local_types"] == ["DTensor"] * len(SHAPES)  # states keep the parameter's placement
    if extra:
        fixed = dense_run(SHAPES, period, mode, dtype)
        assert not all(torch.allclose(g, f, rtol=tol, atol=tol) for g, f in zip(results[0][case]["params"], fixed))


def expected_buckets(shapes, world, itemsize, bucket_bytes):
    """Refresh buckets as documented: consecutive matrices until their padded full size reaches the bucket size."""
    count, size = 0, 0
    for m, n in shapes:
        size += world * -(-m // world) * n * itemsize
        if size >= bucket_bytes:
            count, size = count + 1, 0
    return count + (size > 0)


def test_collectives_per_step_are_the_papers_budget(sharded):
    """Counted by the profiler (c10d ops), independently of comm_stats: RowNorm steps one all-reduce (column
    statistics and the non-finite flag), refresh steps only the refresh payload (the flag rides its first bucket)."""
    world, results = sharded
    for case, (period, mode, dtype, *_) in enumerate(CASES):  # auto-γ cases included: the same budget
        buckets = expected_buckets(SHAPES, world, dtype.itemsize, int(0.01 * 2**20))
        small = 0
        for t, step in enumerate(results[0][case]["steps"]):
            refresh = t % period == 0
            assert step["branches"]["refresh" if refresh else "rownorm"] == len(SHAPES)
            profiled, stats = step["profiled"], step["stats"]
            small += profiled["allreduce"]
            if not refresh:
                assert profiled == {"allreduce": 1, "allgather": 0, "alltoall": 0}
                assert stats["rownorm"]["collectives"] == 1 and stats["refresh"]["collectives"] == 0
            elif mode == "gather":
                assert profiled == {"allreduce": 0, "allgather": buckets, "alltoall": 0}
            else:
                assert profiled == {"allreduce": 0, "allgather": 0, "alltoall": 2 * buckets}
        steps = len(results[0][case]["steps"])
        assert small / steps <= (period - 1) / period + 1e-9  # ≈ 0.67 small all-reduces per step at K=3


def test_no_collective_on_rownorm_steps_when_rows_are_whole_and_checks_are_off():
    wide = [(5, 7), (64, 96), (2, 64)]
    cases = [(3, "scatter", torch.float32, {"nonfinite": "ignore"}), (3, "scatter", torch.float32)]
    results = run_distributed(sharded_run, 2, wide, cases, 6)
    for case, want in enumerate([0, 1]):  # "ignore": nothing to agree on; the default: the flag's all-reduce
        for t, step in enumerate(results[0][case]["steps"]):
            if t % 3:
                assert step["profiled"] == {"allreduce": want, "allgather": 0, "alltoall": 0}


def test_hsdp_mesh_shards_over_the_shard_dimension_only():
    """4 ranks as 2 replicas x 2 shards: every rank ends with the dense result."""
    cases = [(3, "gather", torch.float32), (3, "scatter", torch.float32)]
    results = run_distributed(sharded_run, 4, SHAPES, cases, 7, (2, 2))
    assert "Replicate" in results[0][0]["placements"][0] and "Shard(dim=0)" in results[0][0]["placements"][0]
    for case, (period, mode, dtype) in enumerate(cases):
        dense = dense_run(SHAPES, period, mode, dtype, steps=7)
        for rank_results in results:
            for got, want in zip(rank_results[case]["params"], dense):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


TURBO_GRAM = {"ns_coefficients": "turbo_muon", "ns_steps": 4, "ns_normalize": "aol", "ns_method": "gram"}


def test_opt_in_orthogonalizer_sharded_equals_dense():
    """Turbo-Muon with the Gram iteration in both refresh modes on 3 ranks (uneven and empty shards) equals the dense
    run; the owners' NS FLOPs add up to one dense orthogonalization per matrix, fewer than NS5's."""
    cases = [(1, "gather", torch.float32, TURBO_GRAM), (3, "scatter", torch.float32, TURBO_GRAM)]
    results = run_distributed(sharded_run, 3, SHAPES, cases, 4)
    for case, (period, mode, dtype, extra) in enumerate(cases):
        dense = dense_run(SHAPES, period, mode, dtype, steps=4, extra=extra)
        for rank_results in results:
            for got, want in zip(rank_results[case]["params"], dense):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ortho = make_orthogonalizer("turbo_muon", 4, normalize="aol", method="gram")
    assert sum(r[1]["steps"][0]["ns_flops"] for r in results) == sum(ortho.flops(s) for s in SHAPES)
    assert sum(ortho.flops(s) for s in SHAPES) < sum(ns_flops(s) for s in SHAPES)


def test_column_sharded_matrix_is_refused():
    (message, _) = run_distributed(placement_error_worker, 2)
    assert "Tensor-parallel or column-sharded matrices are not supported" in message


@pytest.mark.parametrize(("period", "bad_step"), [(1, 2), (3, 2), (3, 3)])  # refresh, RowNorm after a refresh
@pytest.mark.parametrize("mode", ["gather", "scatter"])
def test_nonfinite_gradient_on_one_rank_is_skipped_by_all(period, bad_step, mode):
    """Only the last rank holds the NaN; the verdict rides a collective the step runs anyway, and every rank
    (and the dense run) skips the same step."""
    want, dense = nonfinite_dense(period, mode, "skip", bad_step)
    assert want == [0] * bad_step + [1] * (4 - bad_step)
    for out, params in run_distributed(nonfinite_consensus_worker, 2, period, mode, "skip", bad_step):
        assert out == want
        for got, ref in zip(params, dense):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["gather", "scatter"])
def test_nonfinite_raise_mode_raises_on_every_rank(mode):
    results = run_distributed(nonfinite_consensus_worker, 2, 1, mode, "raise", 1)
    assert all(isinstance(out, str) and "Non-finite" in out for out, _ in results), results


def test_scale_model_byte_accounting_equals_measured_comm_stats(sharded):
    """benchmarks/scale_model.py projects to 256 GPUs with comm_per_rank: at 2 and 3 ranks it must reproduce what
    every rank's comm_stats() measured, byte for byte, for both refresh modes and RowNorm steps."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "scale_model.py"
    spec = importlib.util.spec_from_file_location("scale_model", path)
    scale_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale_model)
    world, results = sharded
    owners = assign_owners([ns_flops(s) for s in SHAPES], world)
    for case, (period, mode, dtype, *extra) in enumerate(CASES):
        for rank in range(world):
            model = scale_model.comm_per_rank(SHAPES, world, rank, mode, dtype.itemsize, int(0.01 * 2**20))
            steps = results[rank][case]["steps"]
            if extra and mode == "scatter":  # an owner returns each matrix's γ candidates (8 bytes) with its rows
                owned = owners.count(rank)
                model["refresh"] = dict(model["refresh"])
                model["refresh"]["bytes_sent"] += 8 * owned * (world - 1)
                model["refresh"]["bytes_received"] += 8 * (len(SHAPES) - owned)
            assert steps[0]["stats"]["refresh"] == model["refresh"]
            assert steps[0]["ns_flops"] == model["ns_flops"]
            if period > 1:
                assert steps[1]["stats"]["rownorm"] == model["rownorm"]
