"""No tracked file points at this machine: docs and code must stand alone in the repository.

Scans every text file ``git ls-files`` lists (binary files, i.e. those with a NUL byte or not UTF-8,
are skipped). Nothing else is skipped: ``bench/records/`` and ``bench/RESULTS.md`` are scanned too,
because a record that names a machine path cannot be re-run by a reader either; the history they
hold names clones by their folder name instead. The patterns are built from pieces so this file does
not match itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: absolute paths of this machine and the shared folders beside the checkout
MACHINE_PATH = re.compile("|".join(re.escape(piece) for piece in (
    "/" + "work/", "/" + "root/", "/" + "home/", "shared" + "/research", "../" + "shared/", "/." + "mirror/",
)))

#: lines another change removes; each is (file, exact text on the line). Delete an entry once its line is gone.
PENDING_ELSEWHERE: set[tuple[str, str]] = set()


def machine_path_hits(name: str, text: str) -> list[str]:
    """``name:line: text`` for each line of ``text`` that names a machine path (pending lines excepted)."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        if MACHINE_PATH.search(line) and not any(name == f and piece in line for f, piece in PENDING_ELSEWHERE):
            hits.append(f"{name}:{number}: {line.strip()}")
    return hits


def _tracked_text_files() -> list[tuple[str, str]]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            files.append((name, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def test_no_tracked_file_names_a_machine_path():
    files = _tracked_text_files()
    assert len(files) > 100  # the scan really read the repository
    hits = [hit for name, text in files for hit in machine_path_hits(name, text)]
    assert not hits, "paths outside the repository (cite a file in the repository instead):\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    "see ``/" + "work/shared" + "/research/vlm_algos.md`` section 1",
    "cd /" + "root/mmpo && pytest",
    "cp /" + "home/user/data.hdf5 .",
    "the shared" + "/research digest",
    "`../" + "shared/tools/readme-commands quickstart`",
    'GIT_DIR = "/tmp/x/.' + 'mirror/volcengine+verl/repo"',
])
def test_the_scan_catches_machine_paths(line):
    text = "first line is fine\n" + line + "\n"
    assert machine_path_hits("docs/fake.md", text) == [f"docs/fake.md:2: {line}"]


def test_the_scan_passes_repository_paths_and_user_output_dirs():
    text = "see docs/algorithm_sources.md\nmmpo quickstart --out runs/qs\npython x.py --out /tmp/x.json\n"
    assert machine_path_hits("docs/fake.md", text) == []
    # a pending line is only excused in its own file
    for pending_file, pending_text in sorted(PENDING_ELSEWHERE):
        assert machine_path_hits(pending_file, pending_text) == []
        assert machine_path_hits("docs/fake.md", pending_text) != []
