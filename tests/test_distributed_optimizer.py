"""PeriodicRowwiseMuon on FSDP2 DTensor shards (gloo, 127.0.0.1) against the same optimizer on dense tensors."""

import pytest
import torch
from dist_workers import SHAPES, dense_run, nonfinite_consensus_worker, placement_error_worker, sharded_run
from helpers import run_distributed

pytestmark = pytest.mark.distributed

CASES = [(1, "gather", torch.float32), (3, "gather", torch.float32), (1, "scatter", torch.float32),
         (3, "scatter", torch.float32), (3, "gather", torch.bfloat16), (3, "scatter", torch.bfloat16)]  # fmt: skip


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def sharded(request):
    return request.param, run_distributed(sharded_run, request.param, SHAPES, CASES)


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=lambda i: "K{}-{}-{}".format(*CASES[i][:2], str(CASES[i][2])[6:])
)
def test_sharded_equals_dense(sharded, case):
    world, results = sharded
    period, mode, dtype = CASES[case]
    dense = dense_run(SHAPES, period, mode, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # bf16 NS5: batching differs between the two runs
    for rank_results in results:
        for got, want in zip(rank_results[case]["params"], dense):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert results[0][case]["local_types"] == ["DTensor"] * len(SHAPES)  # states keep the parameter's placement


def test_rownorm_steps_one_allreduce_no_gather(sharded):
    world, results = sharded
    for case, (period, mode, _) in enumerate(CASES):
        for t, step in enumerate(results[0][case]["steps"]):
            refresh = t % period == 0
            assert step["branches"]["refresh" if refresh else "rownorm"] == len(SHAPES)
            profiled, stats = step["profiled"], step["stats"]
            if not refresh:
                assert profiled["allgather"] == 0 and profiled["alltoall"] == 0
                assert profiled["allreduce"] == 1
                assert stats["rownorm"]["collectives"] == 1 and stats["refresh"]["collectives"] == 0
            elif mode == "gather":
                assert profiled["allgather"] >= 1 and profiled["alltoall"] == 0
            else:
                assert profiled["alltoall"] == 2 and profiled["allgather"] == 0


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


def test_column_sharded_matrix_is_refused():
    (message, _) = run_distributed(placement_error_worker, 2)
    assert "Tensor-parallel or column-sharded matrices are not supported" in message


@pytest.mark.parametrize("period", [1, 3])
def test_nonfinite_gradient_on_one_rank_is_skipped_by_all(period):
    results = run_distributed(nonfinite_consensus_worker, 2, period)
    for r in results:
        assert r["skipped"] == [0, 0, 1, 1] and r["steps"] == [3.0, 3.0]
