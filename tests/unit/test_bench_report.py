"""The benchmark's arithmetic and formatting: pure functions, no processes, no peers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ringcore.bench import cli, data, engines, report, summary

K, M = 1 << 10, 1 << 20


# --- sizes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4096", 4096), ("4K", 4 * K), ("8M", 8 * M), ("256M", 256 * M), ("1G", 1 << 30), ("64k", 64 * K)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert report.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "lots", "4X", "-1K"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        report.parse_size(text)


def test_parse_size_list_keeps_order() -> None:
    assert report.parse_size_list("1M,4K, 16M") == [M, 4 * K, 16 * M]


def test_sweep_by_factor_four() -> None:
    assert report.size_sweep(4 * K, 64 * M, 4) == [4 * K << (2 * i) for i in range(8)]


def test_sweep_stops_below_maxbytes() -> None:
    assert report.size_sweep(8 * M, 100 * M, 2) == [8 * M, 16 * M, 32 * M, 64 * M]


def test_sweep_single_size() -> None:
    assert report.size_sweep(32 * M, 32 * M, 2) == [32 * M]
    assert report.size_sweep(32 * M, 32 * M, 1) == [32 * M]


@pytest.mark.parametrize(("lo", "hi", "factor"), [(0, 8, 2), (16, 8, 2), (8, 64, 1), (8, 64, 0.5)])
def test_sweep_rejects_bad_bounds(lo: int, hi: int, factor: float) -> None:
    with pytest.raises(ValueError):
        report.size_sweep(lo, hi, factor)


# --- shapes and bandwidth --------------------------------------------------


def test_shape_allreduce_rounds_to_elements() -> None:
    assert report.shape("allreduce", 4099, 4, 4) == report.Shape(4096, 1024, 1024, 1024)


def test_shape_allgather_counts_total_output() -> None:
    # nccl-tests: size = total output bytes, count = elements each rank sends
    sh = report.shape("allgather", 4096, 4, 3)
    assert sh == report.Shape(341 * 3 * 4, 341, 341, 1023)


def test_shape_reduce_scatter_counts_total_input() -> None:
    sh = report.shape("reduce_scatter", 4096, 2, 4)
    assert sh == report.Shape(4096, 512, 2048, 512)


def test_shape_too_small_has_zero_count() -> None:
    assert report.shape("allgather", 8, 4, 4).count == 0


@pytest.mark.parametrize(
    ("test", "n", "factor"),
    [
        ("allreduce", 1, 0.0),
        ("allreduce", 2, 1.0),
        ("allreduce", 4, 1.5),
        ("allreduce", 8, 1.75),
        ("allgather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("broadcast", 4, 1.0),
        ("broadcast", 1, 1.0),
    ],
)
def test_bus_factor(test: str, n: int, factor: float) -> None:
    assert report.bus_factor(test, n) == pytest.approx(factor)


def test_bus_factor_unknown_test() -> None:
    with pytest.raises(ValueError):
        report.bus_factor("alltoall", 4)


def test_bandwidths_use_1e9_bytes() -> None:
    algbw, busbw = report.bandwidths(10**9, 1e6, "allreduce", 4)  # 1e9 B in one second
    assert algbw == pytest.approx(1.0)
    assert busbw == pytest.approx(1.5)


def test_bandwidths_of_zero_time() -> None:
    assert report.bandwidths(4096, 0.0, "allreduce", 2) == (0.0, 0.0)


# --- timing ----------------------------------------------------------------


def test_median_of_max_takes_slowest_rank_per_iteration() -> None:
    # per-iteration max is [4, 5, 6]: the median is 5, not any single rank's median
    assert report.median_of_max([[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]]) == 5.0


def test_median_of_max_even_iterations() -> None:
    assert report.median_of_max(np.array([[1.0, 2.0, 3.0, 10.0]])) == 2.5


def test_median_of_max_one_rank_one_iteration() -> None:
    assert report.median_of_max([[7.0]]) == 7.0


@pytest.mark.parametrize("times", [[], [[]], [1.0, 2.0]])
def test_median_of_max_rejects_bad_shapes(times: list) -> None:
    with pytest.raises(ValueError):
        report.median_of_max(times)


def test_iteration_plan_without_budget() -> None:
    assert report.iteration_plan(256 * M, 20, 5, 0) == (20, 5)


def test_iteration_plan_with_budget() -> None:
    assert report.iteration_plan(4 * K, 20, 5, 1 << 30) == (20, 4)
    assert report.iteration_plan(64 * M, 20, 5, 1 << 30) == (16, 3)
    assert report.iteration_plan(256 * M, 20, 5, 1 << 30) == (5, 1)  # floor of 5 iterations
    assert report.iteration_plan(256 * M, 3, 0, 1 << 30) == (3, 0)  # never more than asked


# --- columns ---------------------------------------------------------------


def _row(**kw: object) -> report.Row:
    base = dict(
        nbytes=4096,
        count=1024,
        dtype="float",
        redop="sum",
        root=-1,
        time_us=12.345,
        algbw=0.33,
        busbw=0.5,
        wrong=0,
    )
    return report.Row(**(base | kw))  # type: ignore[arg-type]


def test_format_row_matches_nccl_tests() -> None:
    line = report.format_row(_row())
    assert line == "        4096          1024     float     sum      -1    12.35    0.33    0.50      0"


def test_format_row_unchecked_and_big_times() -> None:
    line = report.format_row(_row(time_us=123456.7, wrong=None, busbw=12.3456))
    assert line.endswith("   123457    0.33   12.35    N/A")
    assert report.format_row(_row(time_us=1234.56)).split()[5] == "1234.6"


def test_header_columns_line_up_with_rows() -> None:
    line = report.format_row(_row())
    row_ends = [m.end() for m in re.finditer(r"\S+", line)]
    head_ends = [m.end() for m in re.finditer(r"\S+", report.HEADER[0][1:])]
    assert [e + 1 for e in head_ends] == row_ends
    assert report.HEADER[0].split()[1:] == [
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
    ]


def test_make_row_computes_bandwidth_from_total_size() -> None:
    sh = report.shape("allgather", 4 * M, 4, 4)
    row = report.make_row("allgather", sh, "float", "none", -1, 1000.0, 4, None)
    assert row.algbw == pytest.approx(4 * M / 1000.0 / 1e3)
    assert row.busbw == pytest.approx(row.algbw * 0.75)


def test_footer_average_and_verdict() -> None:
    rows = [_row(busbw=1.0), _row(busbw=2.0, wrong=3)]
    assert report.footer(rows) == ["# Out of bounds values : 3 FAILED", "# Avg bus bandwidth    : 1.5 "]
    assert report.footer([_row(wrong=None)]) == ["# Avg bus bandwidth    : 0.5 "]
    assert report.footer([_row()])[0] == "# Out of bounds values : 0 OK"


def test_parse_row_round_trip() -> None:
    back = report.parse_row(report.format_row(_row(wrong=None)))
    assert back is not None
    assert (back["bytes"], back["count"], back["time_us"], back["busbw"], back["wrong"]) == (
        4096,
        1024,
        12.35,
        0.5,
        None,
    )
    assert report.parse_table("\n".join([*report.HEADER, report.format_row(_row()), "# done"])) == [
        report.parse_row(report.format_row(_row()))
    ]


def test_type_labels_follow_nccl_names() -> None:
    assert [report.type_label(d) for d in ("float32", "float16", "float64", "int8")] == [
        "float",
        "half",
        "double",
        "int8",
    ]
    assert report.numpy_dtype("half") == np.float16
    with pytest.raises(ValueError):
        report.numpy_dtype("complex64")


# --- check data ------------------------------------------------------------

_REDUCE = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _simulate(test: str, op: str, dtype: np.dtype, n: int, in_count: int, root: int = 0) -> list[np.ndarray]:
    """What each rank would hold after ``test``, computed from the full inputs (the slow way)."""
    inputs = [data.pattern(r, in_count, op, dtype) for r in range(n)]
    if test == "broadcast":
        return [inputs[root].copy() for _ in range(n)]
    if test == "allgather":
        return [np.concatenate(inputs) for _ in range(n)]
    if op == "avg":
        total = (np.sum([x.astype(np.float64) for x in inputs], axis=0) / n).astype(dtype)
    else:
        total = _REDUCE[op].reduce(np.stack(inputs), axis=0).astype(dtype)
    if test == "allreduce":
        return [total.copy() for _ in range(n)]
    return [c.copy() for c in np.array_split(total, n)]


@pytest.mark.parametrize("test", report.TESTS)
@pytest.mark.parametrize("op", report.OPS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "uint8", "int64"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_expected_matches_a_full_simulation(test: str, op: str, dtype: str, n: int) -> None:
    dt = np.dtype(dtype)
    in_count = 30 if test != "reduce_scatter" else 31  # uneven split for reduce_scatter
    results = _simulate(test, op, dt, n, in_count, root=n - 1)
    for rank, got in enumerate(results):
        want = data.expected(test, rank, n, in_count, op, dt, n - 1)
        assert data.count_wrong(got, want, op) == 0


def test_count_wrong_counts_each_bad_element() -> None:
    want = data.expected("allreduce", 0, 4, 100, "sum", np.dtype(np.float32), 0)
    got = want.copy()
    got[[3, 50]] += 1
    assert data.count_wrong(got, want, "sum") == 2
    assert data.count_wrong(got[:10], want, "sum") == 100


def test_count_wrong_avg_tolerance() -> None:
    want = np.array([2.5, 3.0], dtype=np.float16)
    assert data.count_wrong(want + np.float16(0.001), want, "avg") == 0
    assert data.count_wrong(np.array([2, 3], dtype=np.int32), np.array([3, 3], dtype=np.int32), "avg") == 0
    assert data.count_wrong(np.array([1, 3], dtype=np.int32), np.array([3, 3], dtype=np.int32), "avg") == 1


def test_pattern_never_contains_zero() -> None:
    for op in report.OPS:
        assert data.pattern(5, 64, op, np.dtype(np.int8)).min() >= 1


@pytest.mark.parametrize(("count", "n"), [(10, 3), (3, 5), (0, 2), (16, 4)])
def test_split_bounds_follow_array_split(count: int, n: int) -> None:
    chunks = np.array_split(np.arange(count), n)
    for r, chunk in enumerate(chunks):
        start, stop = data.split_bounds(count, n, r)
        assert list(range(start, stop)) == list(chunk)


def test_steady_values_survive_repetition() -> None:
    for op in report.OPS:
        v = np.full(4, data.steady_value(op), dtype=np.float32)
        results = _simulate_steady(op, v, n=4)
        np.testing.assert_array_equal(results, v)


def _simulate_steady(op: str, v: np.ndarray, n: int) -> np.ndarray:
    if op == "avg":
        return np.sum([v] * n, axis=0) / n
    return _REDUCE[op].reduce(np.stack([v] * n), axis=0)


# --- comparison table ------------------------------------------------------


def _rec(engine: str, n: int, rows: list[tuple[int, float, float]], rc: int = 0) -> dict:
    return {
        "engine": engine,
        "n": n,
        "rc": rc,
        "rows": [{"bytes": b, "time_us": t, "busbw": bw} for b, t, bw in rows],
    }


def test_summarize_takes_medians_over_repeats() -> None:
    recs = [_rec("gloo", 2, [(M, t, bw)]) for t, bw in ((10.0, 1.0), (30.0, 3.0), (20.0, 9.0))]
    recs.append(_rec("gloo", 2, [], rc=1))  # failed run: no rows, no effect
    cell = summary.summarize(recs)[2]["gloo"][M]
    assert (cell["busbw"], cell["time_us"], cell["busbw_min"], cell["busbw_max"], cell["repeats"]) == (
        3.0,
        20.0,
        1.0,
        9.0,
        3,
    )


def test_ratios_against_best_tcp_peer() -> None:
    cells = {
        "ringcore": {"busbw": 1.0},
        "gloo": {"busbw": 0.5},
        "mpi-tcp": {"busbw": 2.0},
        "mpi-shm": {"busbw": 10.0},  # shared memory is not a TCP peer: never "best"
    }
    r = summary.ratios(cells, ["gloo", "mpi-tcp", "mpi-shm"])
    assert r == {"best": 0.5, "gloo": 2.0, "mpi-tcp": 0.5, "mpi-shm": 0.1}
    assert summary.ratios({"ringcore": None, "gloo": {"busbw": 1.0}}, ["gloo"]) == {
        "best": None,
        "gloo": None,
    }


def test_table_shows_time_for_small_sizes_only() -> None:
    recs = [
        _rec("ringcore", 4, [(4 * K, 100.0, 0.06), (16 * M, 1e4, 2.5)]),
        _rec("gloo", 4, [(4 * K, 50.0, 0.12), (16 * M, 2e4, 1.25)]),
    ]
    lines = summary.table(summary.summarize(recs), 4, ["ringcore", "gloo"])
    assert lines[0].startswith("# N=4: busbw (GB/s), 1 repeat")
    assert lines[1].split() == ["size", "ringcore", "gloo", "rc/best", "rc/gloo"]
    assert lines[2].split() == ["4K", "0.060", "100us", "0.120", "50us", "0.50", "0.50"]
    assert lines[3].split() == ["16M", "2.500", "1.250", "2.00", "2.00"]
    recs.append(_rec("ringcore-symmetric", 4, [(4 * K, 80.0, 0.1), (16 * M, 5e3, 5.0)]))
    lines = summary.table(summary.summarize(recs), 4, ["ringcore-symmetric", "ringcore", "gloo"])
    assert lines[0].endswith("; rc: ringcore-symmetric")
    assert lines[1].split()[-3:] == ["rc/best", "rc/ringcore", "rc/gloo"]
    assert lines[3].split()[-3:] == ["4.00", "2.00", "4.00"], "the symmetric route's ratios"


def test_human_size() -> None:
    assert [summary.human_size(x) for x in (4 * K, 256 * M, 1 << 30, 1000)] == ["4K", "256M", "1G", "1000"]


# --- command line ----------------------------------------------------------


def test_strip_np_removes_both_spellings() -> None:
    assert cli.strip_np(["--np", "4", "-b", "8M", "--np=2", "-e", "1G"]) == ["-b", "8M", "-e", "1G"]


def test_cli_defaults_follow_nccl_tests() -> None:
    args = cli.build_parser().parse_args(["-b", "8M", "-e", "256M", "-f", "2"])
    assert (args.iters, args.warmup_iters, args.check, args.op, args.datatype, args.test) == (
        20,
        5,
        1,
        "sum",
        "float",
        "allreduce",
    )
    assert report.size_sweep(report.parse_size(args.minbytes), report.parse_size(args.maxbytes), 2) == [
        8 * M << i for i in range(6)
    ]


@pytest.mark.parametrize("test", report.TESTS)
@pytest.mark.parametrize("op", report.OPS)
def test_expected_in_bfloat16(test: str, op: str) -> None:
    pytest.importorskip("ml_dtypes")
    dt = report.numpy_dtype("bfloat16")
    for rank, got in enumerate(_simulate(test, op, dt, 4, 32, root=1)):
        assert data.count_wrong(got, data.expected(test, rank, 4, 32, op, dt, 1), op) == 0


def test_a_ringcore_engine_with_settings_runs_ringcore_bench_with_them(tmp_path: Path) -> None:
    plan = engines.Plan((4096,), 3, 1, 0, 10.0)
    variant = "ringcore:SHM_CACHE_BYTES=0+SPIN_US=0"
    assert engines.variant_env(variant) == {"RINGCORE_SHM_CACHE_BYTES": "0", "RINGCORE_SPIN_US": "0"}
    assert engines.command(variant, 2, plan, tmp_path / "x.json") == engines.command(
        "ringcore", 2, plan, tmp_path / "x.json"
    )
    assert engines.variant_env("ringcore") == {} and engines.variant_env("gloo") == {}
    with pytest.raises(ValueError, match="no setting"):
        engines.variant_env("ringcore:SHM_CACHE_BYTE=0")
