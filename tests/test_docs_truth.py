"""The docs are self-contained and state the code's truth.

- No doc, docstring or comment cites an issue (``issue 19 item 3``, ``#35``, ``the issue's target``)
  or a file outside the repository (``../shared/...``, ``/root/...``, a ``*.md`` no checkout has):
  a reader has the repository and public sources, nothing else.
- A docstring that states a parameter's default as a literal (``default 256``, ``(default: "e4m3")``,
  ``defaults to False``, ``"ceil" (default)``) states the signature's default.
- docs/install.md names every MPI function the MPI transports call.
- docs/architecture.md's map of giftcomm/ names every module file there is and none that is
  gone, and gives each room the floor tests/test_layers.py holds.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

#: the documents a reader reads
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
        ROOT / "perf" / "results" / "INDEX.md"]
#: the source trees whose docstrings and comments are read as docs too
SOURCE_TREES = ("giftcomm", "studies", "examples", "perf", "tests", "native")

#: an issue cited by number or as "the issue": "issue 19", "issue-36", "issues #4", "#35",
#: "owner/repo#123", "the issue's", "the issue found" (the verb "issues"/"issued" is left alone)
ISSUE = re.compile(r"\bissues?[ -]?#?\d+|(?<![\w&#/])#\d+\b(?![\w-])|\b[\w.-]+/[\w.-]+#\d+|\bissue's\b|\bthe issue\b",
                   re.IGNORECASE)
#: an absolute path into someone's machine
ABSOLUTE = re.compile(r"(?<![\w.~$}])/(?:root|work|home|Users|mnt|scratch)/[\w.\-/]*")
#: a relative path that may climb out of the repository
RELATIVE = re.compile(r"(?<![\w.])(?:\.\./)+[\w.\-/]*")
#: a markdown file named by its bare name or a path
MD_NAME = re.compile(r"(?<![\w\-/.*>])[\w\-/.]*[\w\-]\.md\b")


def _tracked(*trees: str, suffixes: tuple[str, ...] = ()) -> list[Path]:
    """Files of the checkout under ``trees`` (git's list where there is one, else the tree)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *trees], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        files = [ROOT / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        files = [p for t in trees for p in (ROOT / t).rglob("*") if p.is_file()]
    return sorted(p for p in files if p.is_file() and (not suffixes or p.name.endswith(suffixes)))


SOURCES = [p for p in _tracked(*SOURCE_TREES, suffixes=(".py", ".sh", ".c", ".h", ".cu", ".cuh")) if p != THIS]
MD_NAMES = {p.name for p in _tracked(".", suffixes=(".md",))}
#: names a command line writes for a file of the reader's choosing
MD_PLACEHOLDERS = {"OUT.md", "FILE.md", "x.md"}


def issue_references(text: str) -> list[str]:
    return [m.group() for m in ISSUE.finditer(text)]


def _inside(path: Path) -> bool:
    path = path.resolve()
    return (ROOT in path.parents or path == ROOT) and path.exists()


def outside_paths(text: str, where: Path, markdown: bool = True) -> list[str]:
    """Paths in ``text`` (a line of the file ``where``) that lead outside the repository: an
    absolute path into a machine, a relative one that is no file or folder of the checkout (from
    the file's folder, or for source files from the repository's root), and with ``markdown`` a
    markdown file no checkout has (``DESIGN.md``)."""
    hits = [m.group() for m in ABSOLUTE.finditer(text)]
    for m in RELATIVE.finditer(text):
        bases = (where.parent,) if where.suffix == ".md" else (where.parent, ROOT)
        if not any(_inside(base / m.group()) for base in bases):
            hits.append(m.group())
    for m in MD_NAME.finditer(text) if markdown else ():
        name = m.group().rsplit("/", 1)[-1]
        if name not in MD_NAMES and name not in MD_PLACEHOLDERS and not any(m.group() in h for h in hits):
            hits.append(m.group())
    return hits


def _hits(files: list[Path], find: Callable[[str, Path], list[str]]) -> list[str]:
    out = []
    for p in files:
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            out += [f"{p.relative_to(ROOT)}:{i}: {h}" for h in find(line, p)]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_no_issue(doc):
    """Docs state facts and cite sources by public name, not an issue tracker the reader lacks."""
    assert _hits([doc], lambda line, _: issue_references(line)) == []


def test_sources_cite_no_issue():
    assert _hits(SOURCES, lambda line, _: issue_references(line)) == []


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "INDEX.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_file_outside_the_repository(doc):
    """(perf/results/INDEX.md is left out: its commands record the paths they were run with.)"""
    assert _hits([doc], outside_paths) == []


def test_sources_name_no_file_outside_the_repository():
    """(Markdown names are not checked here: tests and tools write files of their own.)"""
    assert _hits(SOURCES, lambda line, where: outside_paths(line, where, markdown=False)) == []


def test_the_reference_patterns_find_references_and_leave_prose_alone():
    assert issue_references("(issue 19 item 3), issue-36, issues #4, #35, cupy/cupy#9576, the issue's "
                            "target, as the issue found") == \
        ["issue 19", "issue-36", "issues #4", "#35", "cupy/cupy#9576", "the issue", "the issue"]
    assert issue_references("FSDP2 issues it as one call; a wait issued the queue; f'{x:#010x}'; "
                            "## 4a. Heading; a #define; A&#35;") == []
    here = ROOT / "docs" / "method.md"
    assert outside_paths("see ../shared/reference/gift-method.md and /root/.cache/x.npz and "
                         "/work/main, DESIGN.md", here) == \
        ["/root/.cache/x.npz", "/work/main", "../shared/reference/gift-method.md", "DESIGN.md"]
    assert outside_paths("see ../perf/results/INDEX.md, method.md, ~/.cache/giftcomm/x.npz, "
                         "$HOME/x, perf/results/gift-cost.md, --out OUT.md", here) == []


# ---------------------------------------------------------------- docstring defaults

#: the public API whose docstrings are checked: giftcomm's __all__, the adapters', the geometry
#: package's, the baseline wires, error feedback and the call options record
API_MODULES = ("giftcomm", "giftcomm.adapters.torch", "giftcomm.adapters.lightning", "giftcomm.adapters.jax",
               "giftcomm.geometry", "giftcomm.collectives.feedback", "giftcomm.collectives.baselines", "giftcomm.options")

#: a literal a docstring may state: a number (an optional % after it), a quoted string, a
#: ``code`` span, True / False / None
_LITERAL = r"""(?P<lit>-?\d[\d_,]*(?:\.\d+)?(?:e-?\d+)?%?(?![\w.])|"[^"\n]*"|'[^'\n]*'|``[^`\n]+``|True\b|False\b|None\b)"""
#: "default 256", "(default: "e4m3")", "defaults to False", "default is None", "Default False"
_AFTER = re.compile(r"(?P<before>\w+\s+)?\b[Dd]efaults?(?:\s+to|\s+is|\s*:|\s*=)?\s+" + _LITERAL)
#: ""ceil" (default...", "None (the default)"
_BEFORE = re.compile(_LITERAL + r"\s*\((?:the\s+)?default\b")
#: "(10: sparse by default)"
_BY_DEFAULT = re.compile(r"\(" + _LITERAL + r":[^()\n]*\bby default\)")
#: a default stated right after the name, labelled or not: "layout "blocks" (default)",
#: "``damping`` (default ``DEFAULT_DAMPING``)"
_NAMED = (r"(?<![\w.`])(?:``)?{name}(?:``)?\s+" + _LITERAL + r"\s*\((?:the\s+)?default\b",
          r"(?<![\w.`])(?:``)?{name}(?:``)?\s+\((?:the\s+)?defaults?(?:\s*:|\s+is|\s+to)?\s+" + _LITERAL)
#: a word before "default(s)" that is not a name owning it
_PLAIN_WORDS = {"the", "its", "a", "by", "and", "or", "it", "which", "with", "is", "are", "own"}


def _value(lit: str) -> tuple[bool, Any]:
    """(understood, value) of a literal as a docstring writes it."""
    lit = lit.strip()
    if lit.startswith("``"):
        inner = lit[2:-2].strip()
        try:
            return True, ast.literal_eval(inner)
        except (ValueError, SyntaxError):
            pass
        mod, _, attr = inner.rpartition(".")
        if mod and re.fullmatch(r"[\w.]+", inner):
            try:
                return True, getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError):
                return False, None
        return False, None
    try:
        if lit.endswith("%"):
            return True, float(lit[:-1].replace(",", "")) / 100
        if lit[0].isdigit() or lit[0] == "-":
            return True, ast.literal_eval(lit.replace(",", "").replace("_", ""))
        return True, ast.literal_eval(lit)
    except (ValueError, SyntaxError):
        return False, None


def _same(stated: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(stated, bool) or default is None or stated is None:
        return stated is default
    if isinstance(default, (int, float)) and isinstance(stated, (int, float)):
        return abs(stated - default) <= 1e-9 * max(1.0, abs(default))
    return bool(stated == default)


def stated_defaults(doc: str, params: list[str]) -> Iterator[tuple[str, str, Any]]:
    """(parameter, the phrase, the stated value) for each literal default the docstring states in
    a parameter's own paragraph: from its label (``name:`` or ``name (...):``, alone, not in a
    list of names) to the next parameter's label or a blank line."""
    labels = []
    for name in params:
        m = re.search(r"(?:^|(?<=[\s(]))(?:``)?%s(?:``)?(?:\s*\([^()\n]*\))?:(?!:)" % re.escape(name), doc,
                      re.MULTILINE)
        if m:  # a label after "a, " belongs to a list of names: it ends the paragraph before it
            labels.append((m.start(), m.end(), name, re.search(r",\s*$", doc[:m.start()]) is None))
    labels.sort()
    for i, (start, body, name, alone) in enumerate(labels):
        if not alone:
            continue
        end = labels[i + 1][0] if i + 1 < len(labels) else len(doc)
        blank = doc.find("\n\n", body)
        seg = doc[start: min(end, blank if blank >= 0 else end)]  # "name (default 3): ..." included
        found = []
        for m in _BEFORE.finditer(seg):
            if _value(m.group("lit"))[0]:  # not "``name`` (default ...": the name itself
                found.append((m.start("lit"), m.group(), m.group("lit")))
        for m in _BY_DEFAULT.finditer(seg):
            found.append((m.start("lit"), m.group(), m.group("lit")))
        for m in _AFTER.finditer(seg):
            owner = (m.group("before") or "").strip()
            if owner and owner != name and owner.lower() not in _PLAIN_WORDS:
                continue  # another name's default ("op defaults to ...")
            if any(s <= m.start() < s + len(p) + 12 for s, p, _ in found):
                continue  # "None (default: ...)": what the default means, stated before
            found.append((m.start(), m.group(), m.group("lit")))
        yield from _literal_values(name, found)
    labelled = {name for _, _, name, alone in labels if alone}
    for name in params:
        if name in labelled:
            continue
        for pattern in _NAMED:
            for m in re.finditer(pattern.replace("{name}", re.escape(name)), doc):
                yield from _literal_values(name, [(m.start(), m.group(), m.group("lit"))])


def _literal_values(name: str, found: list[tuple[int, str, str]]) -> Iterator[tuple[str, str, Any]]:
    for _, phrase, lit in found:
        ok, value = _value(lit)
        if ok:
            yield name, " ".join(phrase.split()), value


def _documented() -> Iterator[tuple[str, Callable, str]]:
    """(qualified name, callable, docstring) of the public functions, classes (their __init__,
    with the class docstring) and public methods of API_MODULES."""
    for mod_name in API_MODULES:
        mod = importlib.import_module(mod_name)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            if inspect.isclass(obj):
                yield f"{mod_name}.{name}", obj, (obj.__doc__ or "") + "\n\n" + (obj.__init__.__doc__ or "")
                for attr, value in vars(obj).items():
                    func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                    if not attr.startswith("_") and inspect.isfunction(func):
                        yield f"{mod_name}.{name}.{attr}", func, func.__doc__ or ""
            elif inspect.isfunction(obj):
                yield f"{mod_name}.{name}", obj, obj.__doc__ or ""


def _defaults(func: Callable) -> dict[str, Any]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in sig.parameters.values() if p.default is not inspect.Parameter.empty}


def test_docstring_defaults_match_the_signatures():
    wrong, checked = [], 0
    for qualname, func, doc in _documented():
        defaults = _defaults(func)
        for name, phrase, value in stated_defaults(doc, list(defaults)):
            checked += 1
            if not _same(value, defaults[name]):
                wrong.append(f"{qualname}: {name}: the docstring says {phrase!r}, the signature {defaults[name]!r}")
    assert wrong == []
    assert checked >= 10, f"only {checked} stated defaults found: the parser no longer reads the docstrings"


def _option_defaults(obj: Any) -> dict[str, Any] | None:
    """The call options' defaults of an entry point that takes them as ``**opts``: CallOptions'
    own, replaced by those its source passes to ``options_of_call`` / ``call_options`` (a dict
    literal, or a module-level dict or Entry); None when it takes no call options."""
    import dataclasses

    from giftcomm.options import CallOptions, Entry

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None
    names = vars(inspect.getmodule(obj))
    found = None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("options_of_call", "call_options")):
            continue
        index, keyword = (3, "defaults") if node.func.id == "options_of_call" else (2, "entry")
        arg = node.args[index] if len(node.args) > index else \
            next((k.value for k in node.keywords if k.arg == keyword), None)
        given: Any = {}
        if isinstance(arg, ast.Dict):
            given = ast.literal_eval(arg)
        elif isinstance(arg, ast.Name):
            given = names.get(arg.id, {})
            given = given.defaults if isinstance(given, Entry) else given
        found = {**(found or {}), **dict(given or {})}
    if found is None:
        return None
    base = {f.name: f.default for f in dataclasses.fields(CallOptions)}
    return {**base, **found}


def test_docstring_call_option_defaults_match_the_entry_points():
    """"op defaults to "avg"" in an adapter's docstring is what it passes to options_of_call."""
    import dataclasses

    from giftcomm.options import CallOptions

    fields = [f.name for f in dataclasses.fields(CallOptions)]
    wrong, checked = [], 0
    for qualname, func, doc in _documented():
        obj = _owner_object(qualname)
        defaults = _option_defaults(obj) if obj is not None else None
        if defaults is None:
            continue
        for name in fields:
            if name in _defaults(func):
                continue
            for m in re.finditer(r"(?<![\w.`])(?:``)?%s(?:``)?\s+defaults\s+to\s+%s" % (name, _LITERAL), doc):
                ok, value = _value(m.group("lit"))
                checked += ok
                if ok and not _same(value, defaults[name]):
                    wrong.append(f"{qualname}: option {name}: the docstring says {m.group()!r}, "
                                 f"the entry point {defaults[name]!r}")
    assert wrong == []
    assert checked >= 3, f"only {checked} stated option defaults found"


def _owner_object(qualname: str) -> Any:
    """The class or function a qualified name of _documented names (a method: its class)."""
    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj if inspect.isclass(obj) or inspect.isfunction(obj) else None
    return None


def test_the_default_parser_reads_what_docstrings_write():
    doc = ('Sum things.\n\n    block: values per scale (default 256). fmt: the format (default: "e4m3").\n'
           '    strict: refuse bad input; defaults to False. mode: "ceil" (default) or "floor".\n'
           '    options: the call options; op defaults to "avg". sync: None (default: "ordinary" with a\n'
           '    geometry). damping: (default ``giftcomm.options.DEFAULT_DAMPING``). a, rate: (default 3)\n'
           '    fraction: budget (default 10% of the wire time). shared: a window. Default True: zero copy.\n')
    from giftcomm.options import DEFAULT_DAMPING

    got = {(n, v) for n, _, v in stated_defaults(doc, ["block", "fmt", "strict", "mode", "options", "sync",
                                                       "damping", "rate", "fraction", "shared"])}
    assert got == {("block", 256), ("fmt", "e4m3"), ("strict", False), ("mode", "ceil"), ("sync", None),
                   ("damping", DEFAULT_DAMPING), ("fraction", 0.1), ("shared", True)}


# ---------------------------------------------------------------- MPI calls

#: mpi4py's method -> the MPI function docs/install.md names
MPI_NAMES = {
    "Isend": "MPI_Isend", "Irecv": "MPI_Irecv", "Test": "MPI_Test", "Testall": "MPI_Testall",
    "Ibarrier": "MPI_Ibarrier", "Iallgather": "MPI_Iallgather", "Iallgatherv": "MPI_Iallgatherv",
    "Ibcast": "MPI_Ibcast", "Ireduce": "MPI_Ireduce", "Iallreduce": "MPI_Iallreduce", "Create": "MPI_Op_create",
    "Idup": "MPI_Comm_idup", "Split_type": "MPI_Comm_split_type", "Split": "MPI_Comm_split", "Free": "_free",
    "Allocate_shared": "MPI_Win_allocate_shared", "Shared_query": "MPI_Win_shared_query",
    "Lock_all": "MPI_Win_lock_all", "Sync": "MPI_Win_sync", "Unlock_all": "MPI_Win_unlock_all",
    "Abort": "MPI_Abort", "Translate_ranks": "group rank translation", "Create_keyval": "cached attributes",
    "Set_attr": "cached attributes", "Get_attr": "cached attributes", "Delete_attr": "cached attributes",
    "Get_group": "group rank translation", "Get_rank": "", "Get_size": "", "Is_initialized": "",
    "Is_finalized": "", "py2f": "",
}
MPI_TRANSPORTS = ("giftcomm/transport/mpi.py", "giftcomm/transport/device_mpi.py")


def test_install_md_names_every_mpi_call_of_the_transports():
    """A site MPI must offer each call; docs/install.md lists them. Free is MPI_Comm_free and
    MPI_Win_free (both named); the attribute getters need nothing beyond MPI-1."""
    text = " ".join((ROOT / "docs" / "install.md").read_text().split())
    missing = []
    for rel in MPI_TRANSPORTS:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr[:1].isupper():
                method = node.func.attr
                base = node.func.value
                if isinstance(base, ast.Name) and base.id in ("ctypes", "threading", "np", "os", "sys", "time"):
                    continue  # not MPI (the CUDA-awareness query goes through ctypes: named by hand below)
                if method not in MPI_NAMES:
                    missing.append(f"{rel}: {method} (add it to MPI_NAMES and to docs/install.md)")
                    continue
                wanted = ["MPI_Comm_free", "MPI_Win_free"] if MPI_NAMES[method] == "_free" else \
                    [MPI_NAMES[method]] if MPI_NAMES[method] else []
                missing += [f"{rel}: {method} -> {w}" for w in wanted if w not in text]
    missing += [f"giftcomm/transport/device_mpi.py: {q}" for q in ("MPIX_GPU_query_support", "MPIX_Query_cuda_support")
                if q not in text]
    assert sorted(set(missing)) == []


# ----------------------------------------------------------------------------- the module map

def architecture_map(text: str) -> tuple[set[str], dict[str, int]]:
    """(the paths under giftcomm/ that docs/architecture.md's map names, {room: floor}). The map
    is the code block that starts with ``giftcomm/``: an entry a line (a file, or a folder ending
    in ``/``), indented two spaces per folder level; a line indented past the entries' column
    (more than 12 spaces) continues the description above it. A folder whose description names
    ``*.py`` files (``__init__.py (face), ddp.py (...), ...``, continued or not) lists them
    there instead of an entry each. A top-level room's description starts ``(floor N)``."""
    block = re.search(r"^```\ngiftcomm/\n(.*?)^```", text, flags=re.M | re.S)
    assert block, "docs/architecture.md has no map of giftcomm/"
    named: set[str] = set()
    floors: dict[str, int] = {}
    folders: list[tuple[int, str]] = []   # (indent, path) of the folders the entries are in
    last_folder = ""                      # the folder of the last entry when it was a folder
    for line in block.group(1).splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if indent > 12:                   # a description's continuation
            if last_folder:
                named |= {last_folder + f for f in re.findall(r"\b(\w+\.py)\b", line)}
            continue
        if indent < 2:
            break                         # past giftcomm/ (studies/, native/, ...)
        word, _, rest = line.strip().partition(" ")
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = (folders[-1][1] if folders else "") + word
        if indent == 2 and (m := re.match(r"\(floor (\d+)\)", rest.strip())):
            floors[word.removesuffix("/").removesuffix(".py")] = int(m.group(1))
        last_folder = path if word.endswith("/") else ""
        if last_folder:
            folders.append((indent, path))
            named |= {path + f for f in re.findall(r"\b(\w+\.py)\b", rest)}
        else:
            named.add(path)
    return named, floors


def test_architecture_map_names_every_module_and_the_floors():
    from test_layers import FLOORS

    named, floors = architecture_map((ROOT / "docs" / "architecture.md").read_text())
    pkg = ROOT / "giftcomm"
    modules = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")}
    assert modules - named == set(), f"modules missing from docs/architecture.md's map: {sorted(modules - named)}"
    gone = {n for n in named if n.endswith(".py") and n not in modules}
    assert gone == set(), f"docs/architecture.md's map names modules that are gone: {sorted(gone)}"
    assert floors == FLOORS


def test_the_map_reader_reads_nesting_and_inline_lists():
    text = ("```\ngiftcomm/\n  a.py            (floor 1) one\n  b/              (floor 2) a room\n"
            "    c.py          two\n    d/            e.py (x), f.py (y),\n"
            "                  g.py\n  h.py            (floor 3) three\nother/   no\n```\n")
    named, floors = architecture_map(text)
    assert named == {"a.py", "b/c.py", "b/d/e.py", "b/d/f.py", "b/d/g.py", "h.py"}
    assert floors == {"a": 1, "b": 2, "h": 3}
