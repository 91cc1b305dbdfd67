"""The attention benchmark's tables say which commit measured each row, also when joined from several runs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_attention import markdown  # noqa: E402


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
