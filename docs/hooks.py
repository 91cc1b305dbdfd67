"""Build-time parts of the docs site (an mkdocs hook; no plugin beyond mkdocstrings is needed).

Pages are plain markdown with three kinds of HTML-comment markers, replaced while the site builds:

- ``<!-- run -->`` before a fenced python block: the block runs (blocks of one page share a
  namespace) and what it prints is shown below it. An exception fails the build, so every
  example on the site runs as written. ``<!-- run if=biasattn.nn -->`` runs it only when that
  module exists (otherwise the block is shown without output).
- ``<!-- show Mq=8 Mk=12 batches=2 heads=2 -->`` before a fenced python block: the block runs and
  the bias it binds to the name ``bias`` is drawn with ``bias.show`` into a PNG shown below it.
- ``<!-- cli -->`` before a fenced bash block of ``python -m biasattn ...`` lines: each runs in
  process and its output is shown below the block.
- ``<!-- biasattn:NAME -->`` on its own line: replaced by the generator ``NAME`` of
  ``docs/generators.py`` (support matrix, priority lists, benchmark results, ...), which reads the
  library's registry and declarations, so new operators and results appear without editing pages.

API reference pages for ``biasattn.testing``, ``biasattn.nn`` and ``biasattn.integrations`` are
added (with their navigation entries) when those packages exist.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pkgutil
import posixpath
import re
import shlex
import sys
import traceback
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
# The pages describe a plain CPU build: with the Triton interpreter on, the generated tables would
# run the Triton kernels interpreted (slowly) and show a different dispatch.
os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document the checkout, installed or not

import generators  # noqa: E402  (docs/generators.py; the hook's folder is on sys.path while it loads)
from mkdocs.exceptions import PluginError  # noqa: E402
from mkdocs.structure.files import File  # noqa: E402

MARKER = re.compile(r"^<!--\s*(run|show|cli)\b(.*?)-->\s*$")
GENERATOR = re.compile(r"^<!--\s*biasattn:([\w-]+)(.*?)-->\s*$")
FENCE = re.compile(r"^(`{3,})\s*(python|bash)\s*$")

OPTIONAL_API = {
    "biasattn.testing": ("Testing helpers", "api/testing.md"),
    "biasattn.nn": ("Modules (biasattn.nn)", "api/nn.md"),
    "biasattn.integrations": ("Integrations", "api/integrations.md"),
}


def _module_exists(name: str) -> bool:
    """True when ``name`` imports and is a real module (an empty folder is not)."""
    try:
        module = importlib.import_module(name)
    except Exception:
        return False
    return getattr(module, "__file__", None) is not None


# ----------------------------------------------------------------------------- mkdocs events
def on_config(config):
    """Append navigation entries for the optional API pages that this checkout has."""
    for entry in config.nav or []:
        if isinstance(entry, dict) and "API reference" in entry:
            section = entry["API reference"]
            for module, (title, uri) in OPTIONAL_API.items():
                if _module_exists(module) and not any(uri in d.values() for d in section if isinstance(d, dict)):
                    section.append({title: uri})
    return config


def on_files(files, config):
    """Run the markers of every page and add the generated pages and pictures."""
    for f in list(files.documentation_pages()):
        source = f.content_string
        if "<!--" not in source:
            continue
        text, extra = render_page(source, f.src_uri)
        files.remove(f)
        files.append(File.generated(config, f.src_uri, content=text))
        for uri, data in extra.items():
            files.append(File.generated(config, uri, content=data))
    for uri, text in api_pages().items():
        files.append(File.generated(config, uri, content=text))
    return files


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc):(<code>)~?(?:[\w.]+\.)?")


def on_page_content(html, page, config, files):
    """Docstrings use Sphinx roles (:class:`~x.Y`); show them as plain code names."""
    return _ROLE.sub(r"\1", html)


# ----------------------------------------------------------------------------- markers
def render_page(source: str, page_uri: str) -> tuple[str, dict[str, bytes]]:
    """Replace the markers of one page; returns the new markdown and the files it refers to."""
    lines = source.split("\n")
    out: list[str] = []
    extra: dict[str, bytes] = {}
    namespace: dict = {"__name__": f"docs_{Path(page_uri).stem}"}
    n_block = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        gen = GENERATOR.match(line)
        marker = MARKER.match(line)
        if gen:
            name, args = gen.group(1).replace("-", "_"), _options(gen.group(2))
            func = getattr(generators, name, None)
            if func is None:
                raise PluginError(f"{page_uri}: unknown generator biasattn:{gen.group(1)}")
            try:
                text, files = func(page_uri=page_uri, **args)
            except Exception as e:
                raise PluginError(f"{page_uri}: generator {name} failed:\n{traceback.format_exc()}") from e
            out.append(text)
            extra.update(files)
            i += 1
            continue
        if not marker:
            out.append(line)
            i += 1
            continue
        kind, opts = marker.group(1), _options(marker.group(2))
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        fence = FENCE.match(lines[j]) if j < len(lines) else None
        if fence is None:
            raise PluginError(f"{page_uri}, line {i + 1}: <!-- {kind} --> must precede a fenced code block")
        end = j + 1
        while end < len(lines) and lines[end].strip() != fence.group(1):
            end += 1
        code = "\n".join(lines[j + 1 : end])
        out.extend(lines[j : end + 1])
        n_block += 1
        if kind == "run" and "if" in opts and not _module_exists(opts["if"]):
            i = end + 1
            continue
        where = f"{page_uri}, block {n_block} (line {j + 1})"
        printed = _run_cli(code, where) if kind == "cli" else _execute(code, namespace, where)
        if kind in ("run", "cli"):
            if printed.strip():
                out.extend(["", "```text", printed.rstrip("\n"), "```"])
        else:
            bias = namespace.get("bias")
            if bias is None:
                raise PluginError(f"{page_uri}, line {j + 1}: a <!-- show --> block must bind a bias to the name 'bias'")
            stem = Path(page_uri).with_suffix("").as_posix()
            uri = f"img/{stem}/{n_block:02d}-{_slug(code)}.png"
            extra[uri] = generators.draw_bias(bias, **opts)
            rel = posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")
            alt = code.strip().splitlines()[-1].replace("[", "(").replace("]", ")")
            out.extend(["", f'![{alt}]({rel}){{ .bias-picture loading="lazy" }}'])
        i = end + 1
    return "\n".join(out), extra


def _options(text: str) -> dict[str, str]:
    opts = {}
    for word in shlex.split(text.strip()):
        key, _, value = word.partition("=")
        opts[key] = value
    return opts


def _slug(code: str) -> str:
    last = code.strip().splitlines()[-1] if code.strip() else "bias"
    last = last.split("=", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "-", last.lower()).strip("-")[:48] or "bias"


def _execute(code: str, namespace: dict, where: str) -> str:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, where, "exec"), namespace)
    except Exception as e:
        raise PluginError(f"example at {where} failed:\n{traceback.format_exc()}") from e
    return buf.getvalue()


def _run_cli(code: str, where: str) -> str:
    from biasattn.__main__ import main

    buf = io.StringIO()
    for line in code.strip().splitlines():
        words = shlex.split(line)
        if words[:3] != ["python", "-m", "biasattn"]:
            raise PluginError(f"{where}: a <!-- cli --> block holds only 'python -m biasattn ...' lines, got {line!r}")
        try:
            with contextlib.redirect_stdout(buf):
                rc = main(words[3:])
        except (Exception, SystemExit) as e:
            raise PluginError(f"command at {where} failed: {line}\n{traceback.format_exc()}") from e
        if rc:
            raise PluginError(f"command at {where} exited with {rc}: {line}")
    return buf.getvalue()


# ----------------------------------------------------------------------------- API pages
def api_pages() -> dict[str, str]:
    """Generated reference pages: the operators of the registry and the optional packages."""
    pages = {"api/operators.md": generators.operators_api_page()}
    if _module_exists("biasattn.testing"):
        pages["api/testing.md"] = "# Testing helpers\n\n::: biasattn.testing\n"
    if _module_exists("biasattn.nn"):
        pages["api/nn.md"] = "# Modules\n\n::: biasattn.nn\n"
    if _module_exists("biasattn.integrations"):
        import biasattn.integrations as integ

        text = ["# Integrations", "", "::: biasattn.integrations", "    options:", "      members: false", ""]
        for m in sorted(pkgutil.iter_modules(integ.__path__), key=lambda m: m.name):
            if not m.name.startswith("_"):
                text += [f"::: biasattn.integrations.{m.name}", ""]
        pages["api/integrations.md"] = "\n".join(text)
    return pages
