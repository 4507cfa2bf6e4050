"""The repository shows the library: every committed result file is indexed and quoted, every
results path a doc names exists, and the docs state today's truth without commit hashes."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "perf" / "results"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

#: a 7-40 digit hex word with at least one letter and one digit, not part of a number
#: (``5.877472e-39``), a path or a longer word
HEX = re.compile(r"(?<![\w.+\-/])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w\-/]|\.\d)")
#: a data digest is not a commit: "digest `7bb24cfd...`", "SHA-256 ...", "sha256 ..."
DIGEST = re.compile(r"(digest|sha-?256)\W{0,3}$", re.IGNORECASE)
#: a results path as docs write it (a link target or plain text), up to a template (`<date>`)
RESULT_PATH = re.compile(r"perf/results/([\w.*\-/]*)")


def _committed_results() -> set[str]:
    """Files under perf/results/ (relative to it): the committed ones in a git checkout, so that
    a local run's fresh outputs do not count; every file otherwise."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "perf/results"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        files = {f[len("perf/results/"):] for f in out.split("\0") if f}
    except (OSError, subprocess.CalledProcessError):
        files = set()
    if not files:
        files = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file()}
    return files - {"INDEX.md"}


def _indexed() -> dict[str, str]:
    """file -> its INDEX.md row: the first column of the table lists a row's files, comma-separated."""
    rows = {}
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith(("| files ", "| ---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"INDEX.md row without its 4 columns (files, what, command, commit): {line[:80]}"
        assert cells[2], f"INDEX.md row without a command: {line[:80]}"
        for name in cells[0].split(","):
            rows[name.strip()] = line
    return rows


def _doc_text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def test_every_result_file_is_indexed_and_every_indexed_file_exists():
    files, indexed = _committed_results(), _indexed()
    assert files, "no result files found"
    assert sorted(files - set(indexed)) == [], "result files without an INDEX.md row (add one, or git rm them)"
    assert sorted(n for n in indexed if not (RESULTS / n).is_file()) == [], "INDEX.md names missing files"


def test_every_result_file_is_quoted_by_a_doc():
    """Each file, or the result it belongs to (a .json / .png / .args.json beside a quoted .md or
    .txt, a quoted directory), is named in docs/ or README.md."""
    text = _doc_text()

    def quoted(name: str) -> bool:
        stem = re.sub(r"(\.args)?\.(json|png)(\.gz)?$", "", name)
        names = [name, name.removesuffix(".gz")] + [stem + ext for ext in (".md", ".txt") if stem != name]
        parts = name.split("/")[:-1]
        names += ["/".join(parts[: i + 1]) + "/" for i in range(len(parts))]  # a quoted directory above it
        return any(re.search(r"(?<![\w-])" + re.escape(n) + r"(?![\w-])", text) for n in names)

    assert sorted(n for n in _committed_results() if not quoted(n)) == [], \
        "result files no doc quotes (git rm them; git history keeps them)"


#: the most perf/results may hold, in bytes of committed files (raw outputs compressed, INDEX.md)
RESULTS_BUDGET = 3_000_000


def test_results_stay_within_their_budget():
    """perf/results holds what the docs quote, compactly: at most RESULTS_BUDGET bytes committed."""
    sizes = {name: (RESULTS / name).stat().st_size for name in _committed_results() | {"INDEX.md"}
             if (RESULTS / name).is_file()}
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert sum(sizes.values()) <= RESULTS_BUDGET, \
        f"perf/results holds {sum(sizes.values()):,} bytes > {RESULTS_BUDGET:,}; the biggest: {biggest}"


def test_every_results_path_a_doc_names_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for m in RESULT_PATH.finditer(text):
            rel = m.group(1).rstrip(".")
            if not rel or text[m.end():m.end() + 1] == "<":  # the directory itself; a template (device-<date>.md)
                continue
            if "*" in rel:
                ok = any(RESULTS.glob(rel))
            else:  # a raw output is committed gzip-compressed (INDEX.md): the doc may name either
                ok = (RESULTS / rel).exists() or (RESULTS / (rel + ".gz")).exists()
            if not ok:
                missing.append(f"{doc.name}: perf/results/{rel}")
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_no_commit_hashes(doc):
    """Docs state today's truth; which commit a result measured is perf/results/INDEX.md's."""
    hits = []
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        for m in HEX.finditer(line):
            if not DIGEST.search(line[: m.start()].rstrip("`")):
                hits.append(f"{doc.name}:{i}: {m.group()}")
    assert hits == []


def test_the_hash_pattern_finds_hashes_and_leaves_numbers_alone():
    assert [m.group() for m in HEX.finditer("at a14f92d (5be9a67), e7e8226.")] == ["a14f92d", "5be9a67", "e7e8226"]
    assert not HEX.search("0 + 5.877472e-39, 1234567 values, a deadbeef, perf/results/abc1234f.md")
