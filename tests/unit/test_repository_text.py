"""The repository's text files hold no unresolved merge-conflict markers, the product's text
(package, tools, examples, docs, config files) no words about how it was developed, and every
relative link of its Markdown files reaches a file (and heading) that exists."""

from __future__ import annotations

import re
import subprocess

from tests.helpers.gloo_launch import REPO_ROOT

MARKERS = ("<<<<<<< ", ">>>>>>> ", "=======\n")


def test_no_conflict_markers_are_committed():
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for name in files:
        path = REPO_ROOT / name
        if path.suffix not in (".py", ".md", ".yaml", ".toml", ".txt", ".sh", ".sbatch", ".json"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(True), 1):
            if line.startswith(MARKERS[:2]) or line == MARKERS[2]:
                found.append(f"{name}:{number}")
    assert found == []


# What a reader of the product needs is what it does and where it was verified, never how or
# where it was developed. Each pattern names what it catches; the evidence pages (run reports
# and benchmarks, which give each figure's date, commit and machine) may name those three.
DEVELOPMENT_HISTORY = {
    "a lent machine": r"\blent\b",
    "a development session": r"\b(GPU|next|that|this) sessions?\b|\bsessions since\b",
    "the machines it was developed on": (
        r"\bthese machines\b|\bmachines? this project\b|\bdeveloped on\b"
        r"|\bno GPU (here|in this project)\b|\bthis project has no GPU\b"
    ),
    "an issue number": r"\bissues? #?\d+\b",
    "where something was run, as 'here'": (
        r"\b(measured|ran|tested|never run|not run) here\b|(?<!the )\brun here\b"
        r"|\bno GPU time left\b"
    ),
    "where a recipe was written": r"\bno GPU was available\b|\bwhere this recipe was written\b",
    "a device tool's status": r"\bcan_start_another\b|\bbudget_left_s\b",
}
EVIDENCE_ONLY = {
    "a development machine's cores": r"\b2-core\b|\btwo cores\b|\b2 cores shared\b",
    "a commit hash": r"\b(commits?|at) (?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
    "a dated measurement": r"\bmeasured (on |at )?\d{4}-\d{2}-\d{2}\b|\bon \d{4}-\d{2}-\d{2}\b",
}
PRODUCT_TEXT = ("bapo_megatron/", "tools/", "examples/", "docs/", "docker/", ".ci/")
CONFIG_FILES = ("README.md", "pyproject.toml", "constraints-gpu.txt")
EVIDENCE = ("docs/validation.md", "docs/benchmarks.md", "docs/staleness-sweep/")
RAW_REPORTS = "docs/validation/"  # the GPU check's reports and logs, kept as they were written


def product_files() -> list[str]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [
        name
        for name in names
        if name.startswith(PRODUCT_TEXT)
        and not name.startswith(RAW_REPORTS)
        or name in CONFIG_FILES
        or (name.startswith("requirements") and name.endswith(".txt"))
    ]


def history_words(name: str, text: str) -> list[str]:
    patterns = dict(DEVELOPMENT_HISTORY)
    if not name.startswith(EVIDENCE):
        patterns.update(EVIDENCE_ONLY)
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in patterns.items():
            match = re.search(pattern, line, re.IGNORECASE)
            if match:
                found.append(f"{name}:{number}: {what}: {match.group(0)!r}")
    return found


def test_the_product_text_says_what_it_does_not_how_it_was_built():
    found = []
    for name in product_files():
        path = REPO_ROOT / name
        if path.exists() and path.suffix not in (".png", ".pt", ".safetensors", ".parquet"):
            found += history_words(name, path.read_text(errors="replace"))
    assert found == [], "\n".join(found)


def test_the_patterns_catch_what_they_are_for():
    caught = [
        "runs on the lent GPU machine",
        "not yet run (no GPU in the sessions since)",
        "NOT RUN HERE. SGLang cannot run on the CPU machines this project is developed on",
        "this project has no GPU",
        "the 2-core machine",
        "on these machines",
        "Measured on 2026-11-26 on a shared 2-core CPU",
        "the tiny CPU run until commit 0581fa8",
        "see issue 16",
        "NOT RUN. No GPU was available where this recipe was written.",
        "no GPU was lent to this session",
        "Measured here (2 cores shared with other jobs)",
        "Measured 2026-11-23 on this machine",
    ]
    for line in caught:
        assert history_words("bapo_megatron/x.py", line), line
    kept = [
        "a W&B run that an earlier run of the same training run opened",
        "start_new_session=True",
        "weight_update_session: bool = False",
        "Never run on a GPU: docs/validation.md",
        "one event file per writer session",
    ]
    for line in kept:
        assert history_words("bapo_megatron/x.py", line) == [], line
    assert history_words("docs/benchmarks.md", "at commit 0581fa8 on 2026-11-26") == []


# Markdown links: [text](target) and ![alt](target), outside code blocks and code spans.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def _without_code(text: str) -> str:
    """``text`` with its fenced code blocks blanked (lines kept, for line numbers)."""
    return re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)


def heading_anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings of ``text`` (GitHub's rule: lower
    case, punctuation dropped, spaces to hyphens, a repeated heading numbered -1, -2, ...),
    and those of explicit ``<a id="...">`` / ``<a name="...">`` tags."""
    anchors, seen = set(), {}
    for line in _without_code(text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors | set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))


def broken_links(root, name: str) -> list[str]:
    """The relative links of the Markdown file ``root/name`` whose file does not exist, or
    whose anchor names no heading of the Markdown file it points to."""
    source = root / name
    found = []
    for number, line in enumerate(_without_code(source.read_text()).splitlines(), 1):
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match.group(1)
            if SCHEME.match(target):
                continue
            path, _, anchor = target.partition("#")
            resolved = source.parent / path.split("?")[0] if path else source
            if not resolved.exists():
                found.append(f"{name}:{number}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md":
                if anchor not in heading_anchors(resolved.read_text()):
                    found.append(f"{name}:{number}: {target} (no such heading)")
    return found


def test_every_relative_link_in_the_markdown_resolves():
    names = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = [
        line
        for name in names
        if (REPO_ROOT / name).exists()
        for line in broken_links(REPO_ROOT, name)
    ]
    assert found == [], "\n".join(found)


def test_the_link_check_catches_what_it_is_for(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# A heading, with words\n## Twice\n## Twice\n")
    (tmp_path / "a.md").write_text(
        "[ok](docs/b.md) [ok](docs/b.md#a-heading-with-words) [ok](docs/b.md#twice-1)\n"
        "[ok](https://example.org/missing.md) `[code](missing.md)` [ok](#top)\n"
        "```\n[in a block](missing.md)\n```\n"
        "[gone](docs/missing.md) ![gone](plots/missing.png) [gone](docs/b.md#no-such)\n"
        '<a id="top"></a>\n'
    )
    assert broken_links(tmp_path, "a.md") == [
        "a.md:6: docs/missing.md (no such file)",
        "a.md:6: plots/missing.png (no such file)",
        "a.md:6: docs/b.md#no-such (no such heading)",
    ]
