"""The attention benchmark's tables say which commit measured each row, also when joined from several runs; its
rounds start with each provider in turn."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_attention import markdown, time_rounds  # noqa: E402


def _row(commit, date, D, provider="triton", ms=1.0):
    return dict(device="NVIDIA H200", torch="2.11", triton="3.6", commit=commit, date=date, mode="fwd", D=D, M=2048,
                case="window", provider=provider, status="ok", ms=ms, tflops=100.0 / ms, peak_mib=64.0)


def test_a_table_joined_from_two_runs_names_each_commit_with_its_head_dims():
    rows = [_row("aaaaaaa", "2026-11-27", 64), _row("aaaaaaa", "2026-11-27", 64, "flex", 2.0),
            _row("bbbbbbb", "2026-11-29", 256), _row("bbbbbbb", "2026-11-29", 256, "flex", 1.5)]
    title = markdown(rows).splitlines()[0]
    assert "commit aaaaaaa, 2026-11-27 (D=64); commit bbbbbbb, 2026-11-29 (D=256)" in title
    assert "| 64 | 2048 | window | 100 | 50 | 2.00 | 64 |" in markdown(rows)


def test_a_table_of_one_run_names_its_commit_alone():
    title = markdown([_row("aaaaaaa", "2026-11-27", 64), _row("aaaaaaa", "2026-11-27", 128)]).splitlines()[0]
    assert "commit aaaaaaa, 2026-11-27, bf16" in title


def _dispatch_row(provider, ms, S=2048, chosen=""):
    return dict(device="NVIDIA H200", torch="2.11", triton="3.6", commit="ccccccc", date="2026-11-30", S=S, B=8, H=16,
                D=256, dtype="bf16", case="none", mode="fwd", provider=provider, chosen=chosen, ms=ms, tflops=1.0)


def test_the_dispatch_table_renders_from_the_csvs_of_several_calls(tmp_path):
    """A sweep longer than one call's time limit runs in pieces; ``--render`` joins their CSVs into one table."""
    import csv

    from bench_dispatch import main

    parts = {"a": [_dispatch_row("op:triton", 0.9), _dispatch_row("auto", 0.9, chosen="triton"),
                   _dispatch_row("sdpa:cudnn", 0.95)],
             "b": [_dispatch_row("op:triton", 3.0, 8192), _dispatch_row("auto", 3.3, 8192, "cudnn"),
                   _dispatch_row("sdpa:cudnn", 3.3, 8192)]}
    paths = []
    for name, rows in parts.items():
        paths.append(str(tmp_path / f"{name}.csv"))
        with open(paths[-1], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    main(["--render", *paths, "--out", str(tmp_path / "merged")])
    table = (tmp_path / "merged.md").read_text()
    assert "commit ccccccc, 2026-11-30." in table
    assert "| bf16 | 256 | 2048 | none | fwd | triton 0.900 | triton | 0.900 | cudnn 0.950 | 1.00 | 1.06 | yes |" in table
    assert "| bf16 | 256 | 8192 | none | fwd | triton 3.000 | cudnn | 3.300 | cudnn 3.300 | 0.91 | 1.00 | NO |" in table
    with open(tmp_path / "merged.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 6


def test_each_round_of_a_point_starts_with_the_next_provider():
    order = []
    timed = [({"provider": p}, (lambda p=p: order.append(p) or len(order)), []) for p in ("triton", "cudnn", "flex")]
    time_rounds(timed, 4)
    assert order == ["triton", "cudnn", "flex", "cudnn", "flex", "triton", "flex", "triton", "cudnn",
                     "triton", "cudnn", "flex"]
    assert [len(times) for _, _, times in timed] == [4, 4, 4]


def test_a_timer_that_raises_marks_its_row_and_the_others_keep_timing():
    def broken():
        raise RuntimeError("out of memory\nmore")

    timed = [({"status": "ok"}, broken, []), ({"status": "ok"}, lambda: 1.0, [])]
    time_rounds(timed, 2)
    assert timed[0][0]["status"] == "RuntimeError: out of memory" and timed[1][2] == [1.0, 1.0]
    time_rounds([], 3)  # a point no provider could express
