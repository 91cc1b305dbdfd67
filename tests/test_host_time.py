"""``benchmarks/tools/host_time.py``: the comparison it prints from two trees' figures, and its help on any machine."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "benchmarks", "tools", "host_time.py")
sys.path.insert(0, os.path.dirname(TOOL))
from host_time import summary  # noqa: E402


def test_the_summary_gives_each_row_the_median_of_its_runs_and_their_ratio():
    figures = {("none", "fwd", "base"): [100.0, 300.0, 120.0], ("none", "fwd", "new"): [90.0, 60.0, 75.0],
               ("causal", "fwd+bwd", "base"): [800.0], ("causal", "fwd+bwd", "new"): [600.0],
               ("padded", "fwd", "base"): [50.0]}  # a row one tree lacks is left out
    lines = summary(figures)
    assert len(lines) == 2
    assert lines[0].split() == ["causal", "fwd+bwd", "base", "800.0", "µs", "new", "600.0", "µs", "new/base", "0.75"]
    assert lines[1].split() == ["none", "fwd", "base", "120.0", "µs", "new", "75.0", "µs", "new/base", "0.62"]


def test_help_runs_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "--against" in run.stdout
