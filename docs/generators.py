"""Content the docs build generates from the library itself (used by docs/hooks.py).

Each ``<!-- biasattn:NAME -->`` marker calls ``NAME(page_uri=...)``, which returns
``(markdown, {uri: bytes})``. Everything is read from the operator registry, the operators'
declarations, the dispatcher's priority lists and ``benchmarks/results/``, so the pages follow the
code without being edited.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from pathlib import Path

import torch

import biasattn as ba
from biasattn import dispatch, ops
from biasattn.bias import lower
from biasattn.bias.spec import FEATURES

ROOT = Path(__file__).resolve().parent.parent
# BIASATTN_DOCS_RESULTS points the performance page at another results folder (e.g. a CI artifact).
RESULTS = Path(os.environ.get("BIASATTN_DOCS_RESULTS", ROOT / "benchmarks" / "results")).resolve()

YES, NO = "✓", "—"

# What each spec feature is, and a bias that lowers to it (for the family table).
FEATURE_TEXT = {
    "segments": "packed variable-length sequences (`BlockDiagonalMask`)",
    "padded_keys": "per-row key lengths (`PaddedKeysMask`)",
    "band": "diagonal band: causal, bottom-right causal, sliding window",
    "layout": "block-sparse layout (`BlockSparseMask`)",
    "additive": "dense additive tensor (`AdditiveBias`, a float or bool tensor)",
    "alibi": "ALiBi slopes (`ALiBi`)",
}

FAMILY_EXAMPLES = [
    ("LowerTriangularMask()", lambda: ba.LowerTriangularMask()),
    ("LowerTriangularFromBottomRightMask()", lambda: ba.LowerTriangularFromBottomRightMask()),
    ("LocalAttentionMask(256)", lambda: ba.LocalAttentionMask(256)),
    ("PaddedKeysMask([700, 1024])", lambda: ba.PaddedKeysMask([700, 1024])),
    ("BlockDiagonalMask.from_seqlens([300, 724])", lambda: ba.BlockDiagonalMask.from_seqlens([300, 724])),
    (
        "BlockDiagonalMask.from_seqlens([300, 724]).make_causal()",
        lambda: ba.BlockDiagonalMask.from_seqlens([300, 724]).make_causal(),
    ),
    (
        "BlockSparseMask(layout, block_size=128)",
        lambda: ba.BlockSparseMask(torch.ones(8, 8, dtype=torch.bool).tril(), 128),
    ),
    ("AdditiveBias(torch.randn(1024, 1024))", lambda: ba.AdditiveBias(torch.zeros(1024, 1024))),
    ("ALiBi(ALiBi.standard_slopes(8))", lambda: ba.ALiBi(ba.ALiBi.standard_slopes(8))),
    (
        "LowerTriangularMask() + ALiBi(slopes)",
        lambda: ba.LowerTriangularMask() + ba.ALiBi(ba.ALiBi.standard_slopes(8)),
    ),
    (
        "LowerTriangularFromBottomRightMask() & PaddedKeysMask(lens)",
        lambda: ba.LowerTriangularFromBottomRightMask() & ba.PaddedKeysMask([700, 1024]),
    ),
]

DECLARATION_TITLES = {
    "devices": "devices",
    "min_capability": "min. compute capability",
    "dtypes": "dtypes",
    "head_dims": "head dims",
    "max_mq": "max Mq",
    "scale": "scale",
}
FLAG_TITLES = {
    "backward": "backward",
    "bias_grad": "bias grad",
    "dropout": "dropout",
    "gqa": "GQA",
    "lse": "LSE",
    "deterministic": "deterministic",
}


def _cell(value) -> str:
    if isinstance(value, bool):
        return YES if value else NO
    if value is None:
        return "any"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(str(v) for v in value) or NO
    return str(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _operators():
    return [ops.get(n) for n in ops.available()]


# ----------------------------------------------------------------------------- operators
def support_matrix(page_uri: str) -> tuple[str, dict]:
    """Three tables from ``Operator.declarations()``: limits, spec features, capabilities."""
    decls = [op.declarations() for op in _operators()]
    known = {"name", "description", "features", *DECLARATION_TITLES, *FLAG_TITLES}
    extra_keys = [k for d in decls for k in d if k not in known]
    extra_keys = list(dict.fromkeys(extra_keys))  # declarations added later get a column of their own

    limits = _table(
        ["operator"] + list(DECLARATION_TITLES.values()) + extra_keys,
        [
            [f"`{d['name']}`"]
            + [_cell(d.get(k)) if (k, d.get(k)) != ("min_capability", "0.0") else "none" for k in DECLARATION_TITLES]
            + [_cell(d.get(k)) for k in extra_keys]
            for d in decls
        ],
    )
    features = _table(
        ["operator"] + [f"`{f}`" for f in FEATURES],
        [[f"`{d['name']}`"] + [YES if f in d.get("features", ()) else NO for f in FEATURES] for d in decls],
    )
    flags = _table(
        ["operator"] + list(FLAG_TITLES.values()),
        [[f"`{d['name']}`"] + [_cell(d.get(k)) for k in FLAG_TITLES] for d in decls],
    )
    names = ", ".join(f"`{d['name']}`" for d in decls)
    text = [
        f"Operators registered in this build, in registration order: {names}.",
        "",
        "### Devices, dtypes and sizes",
        "",
        limits,
        "",
        "The compute capability applies to CUDA devices. Head dims are `min..max` over both D and Dv. "
        "The [API reference](api/operators.md#registered-operators) has each operator's own description.",
        "",
        "### Bias features",
        "",
        "Every bias lowers to a `BiasSpec`; an operator runs a bias when it supports every feature the spec uses "
        "(see [which biases use which features](#which-biases-use-which-features)).",
        "",
        features,
        "",
        "### Gradients, dropout and the rest",
        "",
        flags,
        "",
        "*bias grad*: the gradient of an `AdditiveBias` tensor that requires grad. *deterministic*: the backward pass "
        "is run-to-run reproducible; under `torch.use_deterministic_algorithms(True)` a non-deterministic operator "
        "refuses backward.",
    ]
    return "\n".join(text), {}


def bias_features(page_uri: str) -> tuple[str, dict]:
    """Which spec features each bias family lowers to, and the operators that can run it."""
    operators = _operators()
    rows = []
    for code, make in FAMILY_EXAMPLES:
        bias = make()
        spec = lower(bias, 2, 8, 1024, 1024) if "PaddedKeys" in code else lower(bias, 1, 8, 1024, 1024)
        used = sorted(spec.features)
        runs = [f"`{op.NAME}`" for op in operators if set(used) <= op.FEATURES]
        rows.append([f"`{code}`", ", ".join(f"`{f}`" for f in used) or NO, ", ".join(runs) or NO])
    legend = "\n".join(f"- `{f}`: {FEATURE_TEXT.get(f, '')}" for f in FEATURES)
    text = [
        _table(["bias", "lowers to", "operators whose declarations cover it"], rows),
        "",
        "The features:",
        "",
        legend,
    ]
    return "\n".join(text), {}


def priority(page_uri: str) -> tuple[str, dict]:
    """The dispatcher's priority list per device kind."""
    registered = set(ops.available())
    rows = []
    lists = dict(dispatch.PRIORITY)
    lists.setdefault("other devices", dispatch.DEFAULT_PRIORITY)
    for device, names in lists.items():
        cells = [f"`{n}`" if n in registered else f"~~`{n}`~~" for n in names]
        rows.append([f"`{device}`" if device != "other devices" else device, " → ".join(cells)])
    text = [
        _table(["device", "tried in this order"], rows),
        "",
    ]
    missing = sorted({n for names in lists.values() for n in names} - registered)
    if missing:
        text.append(
            "Struck-through names are in a priority list but not registered in this build: "
            + ", ".join(f"`{n}`" for n in missing)
            + ". The dispatcher skips them."
        )
    else:
        text.append("Every operator in these lists is registered in this build.")
    return "\n".join(text), {}


def forced_error(page_uri: str) -> tuple[str, dict]:
    """A real NotSupportedError from forcing an operator that cannot run CPU inputs (if any can't)."""
    q = torch.randn(1, 4, 64, 32)
    k = v = torch.randn(1, 4, 64, 32)
    for op in _operators():
        try:
            ba.attention(q, k, v, ba.LowerTriangularMask(), op=op.NAME)
        except ba.NotSupportedError as e:
            code = (
                "q = k = v = torch.randn(1, 4, 64, 32)  # on the CPU\n"
                f'ba.attention(q, k, v, ba.LowerTriangularMask(), op="{op.NAME}")'
            )
            text = ["```python", code, "```", "", "```text", f"biasattn.errors.NotSupportedError: {e}", "```"]
            return "\n".join(text), {}
    return (
        "Every operator registered in this build can run float32 CPU inputs, so the docs build has no "
        "refusal to show here; on a build with the GPU operators, forcing one of them on CPU tensors raises "
        "`NotSupportedError` with its reasons.",
        {},
    )


def operators_api_page() -> str:
    """API page: the registry functions, the Operator base class, then every registered operator."""
    text = [
        "# Operators and dispatch",
        "",
        "::: biasattn.ops.available",
        "",
        "::: biasattn.ops.get",
        "",
        "::: biasattn.ops.register",
        "",
        "::: biasattn.use_ops",
        "",
        "::: biasattn.ops.base.Operator",
        "    options:",
        "      members: [not_supported_reasons, supports, extra_reasons, environment_reasons, declarations, fwd, bwd]",
        "",
        "## Registered operators",
        "",
        "Generated from `biasattn.ops.available()`; each operator's declarations are tabulated in "
        "[Operators](../operators.md).",
        "",
    ]
    for op in _operators():
        cls = type(op)
        text += [
            f"::: {cls.__module__}.{cls.__qualname__}",
            "    options:",
            "      members: false",
            "      heading_level: 3",
            "",
        ]
    return "\n".join(text)


# ----------------------------------------------------------------------------- numerics
def tolerance_table(page_uri: str) -> tuple[str, dict]:
    """Measured on the CPU at build time: each operator's error next to the low-precision math's error."""
    try:
        from biasattn.testing import DEFAULT_ATOL, max_abs_diff, reference_attention
    except ImportError:
        return "*(`biasattn.testing` is not part of this build, so no measurements are shown.)*", {}
    gen = torch.Generator().manual_seed(0)
    B, H, M, D = 1, 2, 61, 16
    q64, k64, v64, do64 = (torch.randn(B, H, M, D, generator=gen, dtype=torch.float64) for _ in range(4))
    cases = [
        ("causal", ba.LowerTriangularMask()),
        (
            "varlen causal + ALiBi",
            ba.BlockDiagonalMask.from_seqlens([25, 36]).make_causal() + ba.ALiBi(ba.ALiBi.standard_slopes(H)),
        ),
    ]

    def leaves(dtype):
        return [t.detach().to(dtype, copy=True).requires_grad_() for t in (q64, k64, v64)]

    def grads(out, q, dtype):
        out.backward(do64.to(dtype))
        return out.detach(), q.grad

    rows = []
    for name, bias in cases:
        q, k, v = leaves(torch.float64)
        ref, ref_dq = grads(reference_attention(q, k, v, bias)[0], q, torch.float64)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            q, k, v = leaves(dtype)
            low, low_dq = grads(reference_attention(q, k, v, bias, compute_dtype=dtype)[0], q, dtype)
            e_out, e_dq = max_abs_diff(low, ref), max_abs_diff(low_dq, ref_dq)
            atol = DEFAULT_ATOL[dtype]
            for op in _operators():
                q, k, v = leaves(dtype)
                try:
                    out, dq = grads(ba.attention(q, k, v, bias, op=op.NAME), q, dtype)
                except ba.NotSupportedError:
                    continue
                o, g = max_abs_diff(out, ref), max_abs_diff(dq, ref_dq)
                ok = o <= 2 * e_out + atol and g <= 3 * e_dq + atol
                rows.append(
                    [name, str(dtype).replace("torch.", ""), f"`{op.NAME}`"]
                    + [f"{x:.1e}" for x in (e_out, o, 2 * e_out + atol, e_dq, g, 3 * e_dq + atol)]
                    + [YES if ok else "✗"]
                )
    header = [
        "bias",
        "dtype",
        "operator",
        "low-prec. out err",
        "out err",
        "out bound",
        "low-prec. dq err",
        "dq err",
        "dq bound",
        "within",
    ]
    text = [
        _table(header, rows),
        "",
        f"q, k, v `[{B}, {H}, {M}, {D}]`, torch {torch.__version__}, CPU. *err* is the largest absolute difference "
        "from `biasattn.testing.reference_attention` in float64; *low-prec.* is the same textbook math run in the "
        "row's dtype (`compute_dtype=dtype`); the bounds are `2 ·` (out) and `3 ·` (dq) that error plus "
        "`biasattn.testing.DEFAULT_ATOL[dtype]`. Only the operators that run on the CPU appear; the bound is the "
        "same for every operator.",
    ]
    return "\n".join(text), {}


# ----------------------------------------------------------------------------- performance
_LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,4})\s", re.M)


CASE_TEXT = {
    "none": "no bias",
    "causal": "`LowerTriangularMask()`; SDPA peers get `is_causal=True`",
    "window": "causal sliding window, `LocalAttentionMask(window_left)`",
    "padded": "right-padded keys, `PaddedKeysMask` with lengths between M/2 and M",
    "varlen": "packed documents, `BlockDiagonalMask.from_seqlens(...).make_causal()`, batch of one",
    "block_sparse": "`BlockSparseMask` of 128-blocks, per-head random layout of exactly 25% of the blocks, diagonal included",
    "additive": "`AdditiveBias` of a dense `[1, H, M, M]` tensor",
    "alibi": "`ALiBi(ALiBi.standard_slopes(H))`",
}


def benchmark_cases(page_uri: str) -> tuple[str, dict]:
    """The case names of ``benchmarks/cases.py`` with what each one measures."""
    import ast

    path = ROOT / "benchmarks" / "cases.py"
    if not path.is_file():
        return "*(`benchmarks/cases.py` is not part of this checkout.)*", {}
    names: tuple = ()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:  # read, not run: no GPU needed
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CASE_NAMES" for t in node.targets):
            names = ast.literal_eval(node.value)
    rows = [[f"`{n}`", CASE_TEXT.get(n, NO)] for n in names]
    return _table(["case", "bias"], rows), {}


def benchmark_results(page_uri: str) -> tuple[str, dict]:
    """Every markdown table, PNG plot and CSV under ``benchmarks/results/``, grouped by folder."""
    if not RESULTS.is_dir():
        return "`benchmarks/results/` does not exist in this checkout, so there are no results to show yet.", {}
    kinds = {".md", ".png", ".csv"}
    found = sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.suffix.lower() in kinds)
    if not found:
        return (
            "**No results yet.** `benchmarks/results/` is empty in this checkout: no benchmark has been recorded, "
            "so this page has no tables or plots to show and the library makes no speed claims. Results appear here "
            "on the next docs build after the benchmarks write their CSV, markdown and PNG files to that folder.",
            {},
        )
    files: dict[str, bytes] = {}
    page_dir = posixpath.dirname(page_uri)

    def uri_of(p: Path) -> str:
        return "results/" + p.relative_to(RESULTS).as_posix()

    def link(p: Path) -> str:
        return posixpath.relpath(uri_of(p), page_dir or ".")

    for p in found:
        if p.suffix.lower() != ".md":
            files[uri_of(p)] = p.read_bytes()

    out: list[str] = []
    folders = sorted({p.parent for p in found}, key=lambda d: (d != RESULTS, d.as_posix()))
    for folder in folders:
        here = [p for p in found if p.parent == folder]
        title = "benchmarks/results/" + (folder.relative_to(RESULTS).as_posix() + "/" if folder != RESULTS else "")
        out += [f"### `{title}`", ""]
        shown: set[Path] = set()
        for md in [p for p in here if p.suffix.lower() == ".md"]:
            body = md.read_text(encoding="utf-8")
            body = _HEADING.sub(lambda m: "#" * min(len(m.group(1)) + 3, 6) + " ", body)

            def fix(m, md=md, shown=shown):
                target = m.group(2)
                if re.match(r"^(https?|mailto):", target):
                    return m.group(0)
                p = (md.parent / target).resolve()
                if p.is_file() and RESULTS in p.parents and uri_of(p) in files:
                    shown.add(p)
                    return f"{m.group(1)}({link(p)})"
                text = m.group(1)[2:-1] if m.group(1).startswith("!") else m.group(1)[1:-1]
                return f"{text} (`{target}`)"  # a link the site cannot follow becomes text

            out += [f"From `{md.name}`:", "", _LINK.sub(fix, body).strip(), ""]
        for png in [p for p in here if p.suffix.lower() == ".png" and p not in shown]:
            out += [f"![{png.stem}]({link(png)})", "", f"*{png.name}*", ""]
        csvs = [p for p in here if p.suffix.lower() == ".csv"]
        if csvs:
            out += ["Raw data: " + ", ".join(f"[{p.name}]({link(p)})" for p in csvs), ""]
    return "\n".join(out), files


# ----------------------------------------------------------------------------- pictures
def draw_bias(bias, Mq: str, Mk: str, batches: str = "", heads: str = "", **_) -> bytes:
    """A PNG of ``bias.show(Mq, Mk)``: one panel per listed batch row / head, grid lines between cells.

    Margins are laid out by hand (no ``bbox_inches="tight"``, which draws every figure twice).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Mq, Mk = int(Mq), int(Mk)
    bs = [int(x) for x in batches.split(",")] if batches else [0]
    hs = [int(x) for x in heads.split(",")] if heads else [0]
    panels = [(b, h) for b in bs for h in hs]
    cell = min(0.26, 4.0 / max(Mq, Mk))
    pw, ph = cell * Mk, cell * Mq  # panel size in inches
    left, right, bottom, top, gap = 0.5, 0.12, 0.45, 0.3, 0.45
    cbar = 0.0 if bias.is_mask else 0.6
    W = left + len(panels) * (pw + cbar) + (len(panels) - 1) * gap + right
    H = bottom + ph + top
    fig = plt.figure(figsize=(W, H))
    step = 1 if max(Mq, Mk) <= 16 else 4
    for n, (b, h) in enumerate(panels):
        x = left + n * (pw + cbar + gap)
        ax = fig.add_axes((x / W, bottom / H, pw / W, ph / H))
        bias.show(Mq, Mk, batch=b, head=h, ax=ax)
        label = ([f"batch row {b}"] if batches else []) + ([f"head {h}"] if heads else [])
        ax.set_title(", ".join(label), fontsize=8)
        ax.set_xticks(range(0, Mk, step))
        ax.set_yticks(range(0, Mq, step))
        ax.tick_params(labelsize=7)
        ax.xaxis.label.set_size(8)
        ax.yaxis.label.set_size(8)
        if max(Mq, Mk) <= 40:
            ax.set_xticks([i - 0.5 for i in range(Mk + 1)], minor=True)
            ax.set_yticks([i - 0.5 for i in range(Mq + 1)], minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
        if cbar and ax.images:
            cax = fig.add_axes(((x + pw + 0.08) / W, bottom / H, 0.1 / W, ph / H))
            fig.colorbar(ax.images[0], cax=cax).ax.tick_params(labelsize=6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
