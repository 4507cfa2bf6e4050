"""Docs as tested truth: every ```python block of README.md and docs/*.md runs, under the launcher
its first line names, and what the prose around it claims is asserted (by the snippet's own
``assert`` lines, or by a check on what it printed: CHECKS below).

The convention (also in tests/README.md), written on the line right before the fence:

- nothing: the block runs. Its first line picks the launcher: ``# torchrun --nproc_per_node N ...``
  (torch.distributed.run, N CPU processes over gloo), ``# mpiexec -n N ...`` (mpiexec, N ranks),
  anything else plain ``python``. It must exit 0 within SNIPPET_TIMEOUT seconds and print no
  traceback.
- ``<!-- not-run: reason -->``: the block is not run (a fragment of an example that
  tests/test_examples.py runs whole, a listing of signatures, something needing root...); the
  block is not collected as a test (a test checks that it says why). A reason starting with "signatures" marks a listing of
  signatures that test_api_signatures compares with ``inspect.signature`` of the real functions.
- ``<!-- gpu: reason -->``: the block needs a CUDA GPU: it runs where one is visible and is a skip
  saying "no CUDA GPU" elsewhere.

A failure names the file and line of the snippet's fence.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import _launch  # tests/_launch.py
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_TIMEOUT = 120.0
_MARK = re.compile(r"<!--\s*(not-run|gpu):\s*(.*?)\s*-->")
_LAUNCH = re.compile(r"#\s*(torchrun|mpiexec)\b(.*)")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int        # 1-based line of the opening fence
    code: str
    mark: str | None  # "not-run", "gpu" or None
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def launcher(self) -> tuple[str, int]:
        """("torchrun" | "mpiexec" | "python", ranks) from the first line."""
        first = self.code.splitlines()[0] if self.code.strip() else ""
        m = _LAUNCH.match(first.strip())
        if m is None:
            return "python", 1
        n = re.search(r"--nproc[_-]per[_-]node[ =](\d+)" if m.group(1) == "torchrun" else r"-(?:n|np)\s+(\d+)", m.group(2))
        if n is None:
            raise ValueError(f"{self.where}: the launcher line {first!r} names no process count")
        return m.group(1), int(n.group(1))


def extract(path: Path) -> list[Snippet]:
    """Every ```python block of a Markdown file, with the marker on the line before its fence."""
    lines = path.read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: unclosed ```python fence")
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            m = _MARK.search(before)
            out.append(Snippet(path, i + 1, "\n".join(lines[i + 1:j]) + "\n", m.group(1) if m else None,
                               m.group(2) if m else ""))
            i = j
        i += 1
    return out


SNIPPETS = [s for p in DOCS for s in extract(p)]


# ------------------------------------------------------------------ claims checked on the output
def _printed_dict(out: str, key: str) -> dict:
    """The last dict literal holding ``key`` in the output (several ranks' prints may share a line)."""
    found, depth, start = [], 0, 0
    for i, ch in enumerate(out):
        if ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                try:
                    d = ast.literal_eval(out[start:i + 1])
                except (ValueError, SyntaxError):
                    continue
                if isinstance(d, dict) and key in d:
                    found.append(d)
    assert found, f"no printed dict with {key!r} in:\n{out[-3000:]}"
    return found[-1]


def _check_readme_ddp(out: str) -> None:
    """The README's claim: FP8 (e4m3) on the wire. The stats, as printed, show e4m3 bytes sent."""
    stats = _printed_dict(out, "bytes_sent")
    assert stats["calls"] > 0 and stats["bytes_sent"].get("e4m3", 0) > 0, stats


#: (file name, a string only that snippet holds) -> a check of its stdout. Every key must match
#: exactly one snippet (test_every_check_has_its_snippet), so a check cannot silently go unused.
CHECKS: dict[tuple[str, str], Callable[[str], None]] = {
    ("README.md", "gift_hook)"): _check_readme_ddp,
    ("README.md", "giftcomm.stats("): _check_readme_ddp,   # "FP8 on the wire": e4m3 bytes were sent
}


def _checks_for(s: Snippet) -> list[Callable[[str], None]]:
    return [f for (name, key), f in CHECKS.items() if s.path.name == name and key in s.code]


def test_every_check_has_its_snippet():
    for (name, key) in CHECKS:
        hits = [s.where for s in SNIPPETS if s.path.name == name and key in s.code and s.mark is None]
        assert len(hits) == 1, f"check ({name}, {key!r}) matches {hits}"


def test_every_snippet_is_found_and_marked_well():
    """Each doc's fences were all read (no ```python block the extractor missed) and every
    marker has a reason."""
    for p in DOCS:
        assert len(extract(p)) == p.read_text().count("```python"), p
    for s in SNIPPETS:
        assert s.mark is None or s.reason, f"{s.where}: a marker needs a reason"
        s.launcher()  # a launcher line must name its process count


# ------------------------------------------------------------------ running them
def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _cuda() -> bool:
    if shutil.which("nvidia-smi") is None and not Path("/dev/nvidia0").exists():
        return False  # no driver: skip without importing torch
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _command(s: Snippet, script: Path) -> list[str]:
    kind, n = s.launcher()
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", _free_port(),
                str(script)]
    if kind == "mpiexec":
        exe = shutil.which("mpiexec")
        assert exe is not None, "no mpiexec on PATH: the mpich wheel (a dependency) provides it"
        return [exe, "-n", str(n), sys.executable, str(script)]
    return [sys.executable, str(script)]


def run_snippet(s: Snippet, tmp: Path) -> str:
    """Run one snippet in ``tmp`` under its launcher; its stdout. Fails naming file:line."""
    script = tmp / "snippet.py"
    script.write_text(s.code)
    cmd = _command(s, script)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    try:
        child = _launch.run(cmd, SNIPPET_TIMEOUT, cwd=tmp, env=env)
    except AssertionError as e:
        raise AssertionError(f"{s.where}: {e}") from None
    stdout, stderr = child.stdout, child.stderr
    assert child.returncode == 0 and "Traceback" not in stderr, (
        f"{s.where}: the snippet failed ({child.returncode}) under {' '.join(cmd[:4])}:\n{stdout[-3000:]}\n{stderr[-4000:]}")
    return stdout


RUN = [s for s in SNIPPETS if s.mark != "not-run"]


@pytest.mark.parametrize("snippet", RUN, ids=[s.where for s in RUN])
def test_snippet(snippet: Snippet, tmp_path):
    if snippet.mark == "gpu" and not _cuda():
        pytest.skip(f"{snippet.where}: no CUDA GPU ({snippet.reason})")
    out = run_snippet(snippet, tmp_path)
    for check in _checks_for(snippet):
        try:
            check(out)
        except AssertionError as exc:
            raise AssertionError(f"{snippet.where}: what the prose claims does not hold: {exc}") from None


# ------------------------------------------------------------------ the format tables
def _format_rows(path: Path) -> dict[str, float]:
    """{format name: bytes/value} of the Markdown table rows whose first cell names formats
    (`"e4m3"`) and whose last cell is a number."""
    rows: dict[str, float] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.strip().startswith("|"):
            continue
        names = re.findall(r'`"(\w+)"`', cells[0])
        try:
            value = float(cells[-1])
        except ValueError:
            continue
        for name in names:
            rows[name] = value
    return rows


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_format_table(doc):
    """The formats table lists every format of giftcomm.formats.FORMATS with its bytes per value."""
    import giftcomm
    from giftcomm.formats import FORMATS

    rows = _format_rows(ROOT / doc)
    assert set(rows) == set(FORMATS), f"{doc}: the table lists {sorted(rows)}, giftcomm.FORMATS has {sorted(FORMATS)}"
    for name, value in rows.items():
        assert abs(value - giftcomm.bytes_per_value(name)) < 1e-4, (doc, name, value, giftcomm.bytes_per_value(name))


# ------------------------------------------------------------------ written signatures
_SIG_LINE = re.compile(r"^([A-Za-z_][\w.]*)\((.*?)\)(?:\s*->.*)?$")
#: where the bare names of a doc's signature listings live
NAMESPACES = {"api.md": "giftcomm", "geometry.md": "giftcomm.geometry"}


def _signature_listings() -> list[tuple[Snippet, str, str]]:
    """(snippet, name, parameter text) of every ``name(...)`` written in the signature listings
    (``<!-- not-run: signatures ... -->``) of the docs in NAMESPACES, lines joined across the
    continuation indent; "x = f(...)" counts as f(...)."""
    out = []
    for doc in NAMESPACES:
        for s in extract(ROOT / "docs" / doc):
            if s.mark != "not-run" or not s.reason.startswith("signatures"):
                continue
            joined: list[str] = []
            for line in s.code.splitlines():
                text = line.split("  #")[0].rstrip()
                if not text.strip():
                    continue
                if joined and joined[-1].count("(") > joined[-1].count(")"):  # an open call goes on
                    joined[-1] += " " + text.strip()
                else:
                    joined.append(text.strip())
            for text in joined:
                text = re.sub(r"^\w+\s*=\s*", "", text)
                m = _SIG_LINE.match(text)
                if m:
                    out.append((s, m.group(1), m.group(2)))
    return out


def _resolve(doc: str, dotted: str):
    """The object a written name means: ``giftcomm.x.y`` from the root, a bare name from the doc's
    namespace; None for what names no module attribute (``est.update``: an instance's method)."""
    candidates = [dotted] if dotted.startswith("giftcomm.") else [f"{NAMESPACES[doc]}.{dotted}"]
    for full in candidates:
        parts = full.split(".")
        for k in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ImportError:
                continue
            try:
                for attr in parts[k:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                return None
            return obj
    return None


def _default(src: str) -> str:
    return ast.unparse(ast.parse(src, mode="eval").body)


def _written(params: str) -> list[tuple[str, str | None, bool]]:
    """(name, default source or None, keyword-only) of a written parameter list."""
    tree = ast.parse(f"def f({params}): pass").body[0]
    assert isinstance(tree, ast.FunctionDef)
    a = tree.args
    out: list[tuple[str, str | None, bool]] = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out += [(p.arg, None if d is None else ast.unparse(d), False) for p, d in zip(pos, defaults)]
    out += [(p.arg, None if d is None else ast.unparse(d), True) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return out


def _real(fn, written: list) -> list[tuple[str, str | None, bool]]:
    """The function's parameters as _written gives them; a default whose repr is not Python
    (a dataclass field's ``<factory>``) is taken as written."""
    said = {name: d for name, d, _ in written}
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        d = None
        if p.default is not p.empty:
            try:
                d = _default(repr(p.default))
            except SyntaxError:
                d = said.get(p.name)
        out.append((p.name, d, p.kind == p.KEYWORD_ONLY))
    return out


SIGNATURES = [e for e in _signature_listings() if _resolve(e[0].path.name, e[1]) is not None]  # not est.update


def test_api_md_lists_the_public_functions():
    names = {name for s, name, _ in SIGNATURES if s.path.name == "api.md"}
    for fn in ("allreduce", "gift_allreduce", "reduce_scatter", "allgather", "plan_allreduce", "release"):
        assert f"giftcomm.{fn}" in names, f"docs/api.md writes no signature of giftcomm.{fn}"


@pytest.mark.parametrize("entry", SIGNATURES, ids=[f"{s.where}:{name}" for s, name, _ in SIGNATURES])
def test_api_signature(entry):
    """A signature written in a listing is the function's: every parameter, in order, with its
    default and kind (positional or keyword-only)."""
    s, name, params = entry
    fn = _resolve(s.path.name, name)
    written = _written(params)
    assert written == _real(fn, written), f"{s.where}: the docs write {name}({params}), the code has {name}{inspect.signature(fn)}"
