"""The repository's text files hold no unresolved merge-conflict markers."""

from __future__ import annotations

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
