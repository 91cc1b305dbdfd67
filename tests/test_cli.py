"""The command line, run in process: ``info``, ``demo``, ``explain`` and ``bench`` on tiny shapes."""

from __future__ import annotations

import pytest
import torch

import biasattn as ba
from biasattn.__main__ import BIAS_GRAMMAR, main, parse_bias, verdict

TERMS = ("causal", "causal-br", "local:", "padded:", "varlen:", "varlen-causal", "block_sparse:", "alibi", "additive")


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_lists_the_bias_grammar(capsys):
    """The --bias terms were only in a docstring, not in --help."""
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    out = capsys.readouterr().out
    for term in TERMS:
        assert term in out
    assert "(causal & padded:100) + alibi" in out


def test_unknown_term_lists_the_grammar(capsys):
    """An unknown --bias term named only the docstring; the error lists the terms."""
    rc, out, err = run(capsys, "explain", "--shape", "1,2,4,8", "--bias", "causal & casual")
    assert rc == 2 and "unknown bias term 'casual'" in err
    for term in TERMS:
        assert term in err


@pytest.mark.parametrize("text, what", [("causal &", "expected a term at the end"), ("(causal", "'(' is not closed"),
                                        ("causal alibi", "unexpected 'alibi'"), ("& causal", "expected a term before '&'")])
def test_malformed_bias_text(capsys, text, what):
    rc, _, err = run(capsys, "explain", "--shape", "1,2,4,8", "--bias", text)
    assert rc == 2 and what in err and "--bias terms:" in err


@pytest.mark.parametrize("shape", ["1,8,64", "1,8,64,32,2", "1,0,4,8", "a,b,c,d"])
def test_bad_shape_is_a_clear_message(capsys, shape):
    """--shape 1,8,64 raised a raw ValueError traceback."""
    rc, out, err = run(capsys, "explain", "--shape", shape)
    assert rc == 2 and "--shape" in err and repr(shape) in err
    assert "Traceback" not in err


def test_causal_and_alibi_is_refused_with_the_library_error(capsys):
    """The CLI turned "causal & alibi" into a sum that the library refuses: one rule, the library's."""
    with pytest.raises(ba.BiasCompositionError) as lib:
        ba.LowerTriangularMask() & ba.ALiBi(ba.ALiBi.standard_slopes(2))
    rc, _, err = run(capsys, "explain", "--shape", "1,2,4,8", "--bias", "causal & alibi")
    assert rc == 2 and err.strip() == f"error: {lib.value}"


def test_bias_text_follows_python_precedence():
    """``a & b + c`` is ``a & (b + c)`` as in Python, and a parenthesized mask takes an additive term."""
    args = dict(B=1, H=2, Mq=6, Mk=6, device="cpu", dtype=torch.float32)
    text_bias = parse_bias("(causal & padded:4) + alibi", **args)
    lib_bias = (ba.LowerTriangularMask() & ba.PaddedKeysMask([4])) + ba.ALiBi(ba.ALiBi.standard_slopes(2))
    shape = (1, 2, 6, 6)
    torch.testing.assert_close(text_bias.materialize(shape), lib_bias.materialize(shape), rtol=0, atol=0)
    masks = parse_bias("causal & padded:4 + local:2", **args)  # masks add as they intersect
    expected = ba.LowerTriangularMask() & ba.PaddedKeysMask([4]) & ba.LocalAttentionMask(2)
    torch.testing.assert_close(masks.materialize(shape), expected.materialize(shape), rtol=0, atol=0)
    with pytest.raises(ba.BiasCompositionError):
        parse_bias("causal & padded:4 + alibi", **args)
    assert parse_bias("none", **args) is None


def test_explain_folds_operators_that_cannot_run_on_this_device(capsys):
    """On a CPU machine explain printed one line per GPU-only operator."""
    rc, out, _ = run(capsys, "explain", "--shape", "1,2,4,8", "--bias", "causal", "--device", "cpu")
    assert rc == 0
    forward = out.split("forward:")[1]
    lines = forward.strip().splitlines()
    folded = [ln for ln in lines if ln.strip().startswith("not on cpu")]
    assert len(folded) == 1
    for name in ("cutlass", "flash2", "cudnn"):
        assert name in folded[0]
    runnable = [n for n in ba.ops.available() if n not in folded[0]]
    assert "chunked" in runnable and "reference" in runnable
    assert len(lines) == len(runnable) + 1


def test_explain_says_when_a_bias_part_has_no_effect(capsys):
    """A causal mask over one query and one key changes nothing; explain says so."""
    rc, out, _ = run(capsys, "explain", "--shape", "1,2,1,8", "--bias", "causal & padded:1")
    assert rc == 0
    assert "note: causal has no effect for Mq=1, Mk=1" in out
    assert "note: padded:1 has no effect for Mq=1, Mk=1" in out
    rc, out, _ = run(capsys, "explain", "--shape", "1,2,3,8", "--bias", "causal")
    assert "no effect" not in out


def test_explain_warns_about_top_left_causal_over_a_cache(capsys):
    """One query against many keys with the top-left causal mask sees only the first key."""
    rc, out, _ = run(capsys, "explain", "--shape", "1,2,1,8", "--mk", "16", "--bias", "causal")
    assert rc == 0 and "use causal-br" in out and "with 1 query and 16 keys, the last query sees 1 key;" in out
    rc, out, _ = run(capsys, "explain", "--shape", "1,2,1,8", "--mk", "16", "--bias", "causal-br")
    assert "use causal-br" not in out and "causal-br has no effect for Mq=1, Mk=16" in out


@pytest.mark.parametrize("ours, theirs, words", [
    (1.0, 2.1, "biasattn 2.10× faster than SDPA"),
    (2.0, 1.0, "biasattn 2.00× slower than SDPA"),
    (1.0, 1.01, "biasattn and SDPA take the same time"),
])
def test_verdict_in_words(ours, theirs, words):
    assert verdict(ours, theirs, "SDPA").startswith(words)


def test_bench_says_which_is_faster_on_the_cpu(capsys):
    """bench printed only ratios of times; it now says in words which is faster, on the CPU too."""
    rc, out, _ = run(capsys, "bench", "--shape", "1,2,8,8", "--bias", "causal", "--reps", "2")
    assert rc == 0
    assert "torch SDPA with a dense mask" in out
    assert ("faster than torch SDPA" in out) or ("slower than torch SDPA" in out) or ("same time" in out)
    assert "on the CPU biasattn runs" in out


def test_info_and_demo_run(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "operators:" in out and "chunked" in out
    rc, out, _ = run(capsys, "demo")
    assert rc == 0 and "all within float32 rounding: yes" in out


def test_grammar_names_every_term_the_parser_knows():
    for term in TERMS:
        assert term in BIAS_GRAMMAR
