"""What a new user meets first: subpackages as attributes, explain() under use_ops, use_ops and threads,
and the package working without triton."""

from __future__ import annotations

import contextvars
import functools
import subprocess
import sys
import threading

import pytest
import torch

import biasattn as ba


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet) and return what it prints."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("name", ["nn", "testing", "integrations"])
def test_subpackages_are_attributes_imported_on_first_use(name):
    """``biasattn.nn`` / ``.testing`` / ``.integrations`` raised AttributeError after ``import biasattn``."""
    out = _python(
        "import sys, biasattn\n"
        f"print('biasattn.{name}' in sys.modules, {name!r} in dir(biasattn))\n"
        f"m = biasattn.{name}\n"
        f"print('biasattn.{name}' in sys.modules, m.__name__)\n"
    )
    assert out.split() == ["False", "True", "True", f"biasattn.{name}"]


def test_import_biasattn_imports_no_subpackage_and_no_optional_dependency():
    """``import biasattn`` stays light: no subpackage, no triton, hypothesis or transformers."""
    out = _python(
        "import sys, biasattn\n"
        "heavy = ['biasattn.nn', 'biasattn.testing', 'biasattn.integrations', 'biasattn.distributed',\n"
        "         'triton', 'hypothesis', 'transformers']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    assert out.strip() == "[]"


def test_unknown_attribute_still_raises_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'not_a_subpackage'"):
        ba.not_a_subpackage  # noqa: B018


def test_testing_strategies_reachable_from_the_top():
    pytest.importorskip("hypothesis")
    assert ba.testing.strategies.attention_inputs is not None


def _qkv():
    torch.manual_seed(0)
    return torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)


def test_explain_says_use_ops_excluded_an_operator():
    """explain() inside use_ops("reference") said chunked was "not in this device's priority list"."""
    q, k, v = _qkv()
    with ba.use_ops("reference"):
        text = ba.explain(q, k, v, ba.LowerTriangularMask())
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("chunked"))
    assert "excluded by use_ops('reference')" in line
    assert "priority list" not in line


def _chosen_in_thread(wrap) -> str:
    q, k, v = _qkv()
    inp = ba.inputs.make_inputs(q, k, v)
    seen = []
    target = wrap(lambda: seen.append(ba.dispatch.choose(inp)[0].NAME))
    t = threading.Thread(target=target)
    t.start()
    t.join()
    return seen[0]


def test_use_ops_does_not_reach_a_thread_started_inside_the_block():
    """What docs/dispatch.md says: a thread started inside use_ops dispatches without the restriction,
    unless it runs in a copy of the context."""
    with ba.use_ops("reference"):
        plain = _chosen_in_thread(lambda fn: fn)
        copied = _chosen_in_thread(lambda fn: functools.partial(contextvars.copy_context().run, fn))
    assert plain == ba.dispatch.candidates("cpu")[0].NAME != "reference"
    assert copied == "reference"


def test_package_runs_without_triton():
    """triton was a core dependency; without it the package imports, ``info`` and ``demo`` run, and the
    CPU operators compute attention and gradients (triton is blocked in a fresh interpreter)."""
    out = _python(
        "import sys\n"
        "sys.modules['triton'] = None  # import triton now fails as if it were not installed\n"
        "import torch, biasattn as ba\n"
        "from biasattn.__main__ import main\n"
        "assert main(['info']) == 0 and main(['demo']) == 0\n"
        "q = torch.randn(1, 2, 7, 8, requires_grad=True)\n"
        "out = ba.attention(q, q, q, ba.LowerTriangularMask() & ba.PaddedKeysMask([5]))\n"
        "out.sum().backward()\n"
        "bias = ba.LowerTriangularMask() & ba.PaddedKeysMask([5])\n"
        "ref, _ = ba.testing.reference_attention(q, q, q, bias)\n"
        "low, _ = ba.testing.reference_attention(q, q, q, bias, compute_dtype=torch.float32)\n"
        "ba.testing.assert_close_to_reference(out, ref, low)\n"
        "print('close to the reference')\n"
        "try:\n"
        "    ba.attention(q, q, q, op='triton')\n"
        "except ba.NotSupportedError as e:\n"
        "    print('refused:', e.reasons['triton'])\n"
    )
    assert "triton: not installed" in out and 'pip install -e ".[triton]"' in out
    assert "all within float32 rounding: yes" in out
    assert "close to the reference" in out
    assert "refused: ['needs the triton package, which is not installed']" in out
