"""The bench's time-by-operator-family breakdown (``harts-bench --profile``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts_bench.profiling import (
    OTHER,
    causal_attention_pairs,
    excess_over_compression,
    family_of,
    gaps_before_kernels,
    idle_gaps,
    plan_attention_pairs,
    seconds_by_family,
    seconds_by_kernel,
)


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("chunk_kda_fwd_kernel_intra_token_parallel", "linear attention"),
        ("_scan_backward_kernel", "linear attention"),
        ("chunk_gla_fwd_kernel_o", "linear attention"),
        ("causal_conv1d_bwd_kernel", "causal conv"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "full attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "matmul"),
        ("void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>", "gather / scatter"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
        ("aten::mm", "matmul"),
        ("aten::index_select", "gather / scatter"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("triton_poi_fused_0", OTHER),
    ],
)
def test_kernel_names_fall_in_their_family(name, family):
    assert family_of(name) == family


def test_excess_rows_add_up():
    baseline = {"matmul": 10.0, "linear attention": 4.0, OTHER: 1.0}
    harts = {"matmul": 2.5, "linear attention": 1.5, OTHER: 0.5}
    rows = excess_over_compression(baseline, harts, compression=5.0)
    assert rows["matmul"] == {"baseline": 10.0, "ideal": 2.0, "harts": 2.5, "excess": pytest.approx(0.5)}
    assert rows["total"]["excess"] == pytest.approx(sum(harts.values()) - sum(baseline.values()) / 5.0)


def test_a_cpu_profile_puts_matmuls_and_gathers_in_their_families():
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    index = torch.randint(0, 256, (4096,))

    def run():
        for _ in range(3):
            (a @ b).index_select(0, index).sum()

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    seconds = seconds_by_family(profiler, "cpu")
    assert seconds["matmul"] > 0 and seconds["gather / scatter"] > 0
    assert seconds["linear attention"] == 0 and seconds["causal conv"] == 0


def test_the_kernel_table_sums_to_the_family_table():
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(128, 128), torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(4):
            torch.softmax(a @ b, dim=-1).sum()
    kernels = seconds_by_kernel(profiler, "cpu")
    families = seconds_by_family(profiler, "cpu")
    assert [row["seconds"] for row in kernels] == sorted((row["seconds"] for row in kernels), reverse=True)
    mm = next(row for row in kernels if row["name"] == "aten::mm")
    assert mm["calls"] == 4 and mm["family"] == "matmul"
    for family, seconds in families.items():
        assert sum(row["seconds"] for row in kernels if row["family"] == family) == pytest.approx(seconds)


def plan_layouts(trajectories, chunk_size):
    import harts

    batch = harts.RolloutBatch.from_trajectories(trajectories)
    plan = harts.compile(batch, capacity=4096, chunk_size=chunk_size)
    return batch, [plan.layout(m) for m in range(len(plan.module.microbatches))]


def test_attention_pairs_without_sharing_equal_the_baseline():
    batch, layouts = plan_layouts([[1, 2, 3], [4, 5, 6, 7, 8], [9]], chunk_size=4)
    assert plan_attention_pairs(layouts) == causal_attention_pairs(batch.lengths) == 6 + 15 + 1


def test_attention_pairs_of_branches_on_a_shared_prefix():
    """One prefix of 100 tokens, four branches of 10 (the fork on the chunk grid, so no replay): the
    prefix's pairs are computed once, every branch's queries still see all 100 prefix keys."""
    prefix = list(range(1, 101))
    branches = [prefix + [200 + 10 * b + i for i in range(10)] for b in range(4)]
    batch, layouts = plan_layouts(branches, chunk_size=4)
    assert causal_attention_pairs(batch.lengths) == 4 * 110 * 111 / 2
    assert plan_attention_pairs(layouts) == 100 * 101 / 2 + 4 * (10 * 100 + 10 * 11 / 2)


def test_a_family_with_its_own_compression_gets_its_own_ideal():
    rows = excess_over_compression({"full attention": 8.0, "matmul": 10.0}, {"full attention": 2.5, "matmul": 2.0},
                                   compression=5.0, family_compression={"full attention": 4.0})
    assert rows["full attention"]["ideal"] == 2.0 and rows["matmul"]["ideal"] == 2.0
    assert rows["total"]["excess"] == pytest.approx(0.5)


def test_idle_gaps_merge_overlapping_kernels_and_bucket_the_gaps():
    # two streams overlap in [0, 12); then gaps of 3, 50 and 2000 us
    intervals = [(0, 10), (5, 12), (15, 20), (70, 80), (2080, 2100)]
    gaps = idle_gaps(intervals, edges_us=(10.0, 100.0, 1000.0))
    assert gaps["busy_us"] == pytest.approx(12 + 5 + 10 + 20)
    assert gaps["idle_us"] == pytest.approx(3 + 50 + 2000)
    assert gaps["busy_us"] + gaps["idle_us"] == pytest.approx(2100)
    by_gap = gaps["by_gap"]
    assert by_gap["< 10 us"] == {"idle_us": 3.0, "gaps": 1}
    assert by_gap["10-100 us"] == {"idle_us": 50.0, "gaps": 1}
    assert by_gap["100-1000 us"] == {"idle_us": 0.0, "gaps": 0}
    assert by_gap[">= 1000 us"] == {"idle_us": 2000.0, "gaps": 1}


def test_gaps_are_charged_to_the_kernels_around_them():
    # "scan" overlaps "gemm" on another stream; 40 us of idle before "norm" twice, 5 us before "add"
    kernels = [(0, 10, "gemm"), (5, 30, "scan"), (70, 80, "norm"), (85, 90, "add"), (90, 100, "scan"), (140, 150, "norm")]
    rows = gaps_before_kernels(kernels, min_gap_us=10.0)
    assert rows == [{"before": "scan", "after": "norm", "idle_us": 80.0, "gaps": 2, "largest_us": 40.0}]
    assert sum(row["idle_us"] for row in gaps_before_kernels(kernels, min_gap_us=0.0)) == pytest.approx(85.0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 500)), max_size=40))
def test_charged_gaps_add_up_to_the_idle_time(starts_and_lengths):
    intervals = [(start, start + length) for start, length in starts_and_lengths]
    rows = gaps_before_kernels([(a, b, f"k{i % 3}") for i, (a, b) in enumerate(intervals)], min_gap_us=0.0, top=100)
    assert sum(row["idle_us"] for row in rows) == pytest.approx(idle_gaps(intervals)["idle_us"])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 500)), max_size=40))
def test_idle_gaps_add_up_to_the_span_for_any_kernels(starts_and_lengths):
    intervals = [(start, start + length) for start, length in starts_and_lengths]
    gaps = idle_gaps(intervals)
    if not intervals:
        assert gaps["busy_us"] == gaps["idle_us"] == 0.0
        return
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    assert gaps["busy_us"] + gaps["idle_us"] == pytest.approx(span)
    assert sum(row["idle_us"] for row in gaps["by_gap"].values()) == pytest.approx(gaps["idle_us"])
    covered = set()
    for a, b in intervals:
        covered.update(range(a, b))
    assert gaps["busy_us"] == pytest.approx(len(covered))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sync_sites_count_each_host_read_by_its_line():
    from harts_bench.profiling import SyncSites

    x = torch.ones(8, device="cuda")
    with SyncSites() as syncs:
        for _ in range(3):
            float(x.sum())  # a host read: one sync each
        y = x * 2  # queued, never read
    assert sum(syncs.sites.values()) == 3, syncs.sites
    ((site, count),) = syncs.sites.items()
    assert count == 3 and "float(x.sum())" in site
    assert torch.cuda.get_sync_debug_mode() == 0 and y.shape == x.shape
