"""No tracked file points at this machine or at notes outside it: docs and code must stand alone.

Two kinds of pointer are caught: machine paths (``MACHINE_PATH``), and citations of the project's
research notes, which live outside the repository (``OUTSIDE_NOTES``: a note's name followed by its
section number, the notes' file names, their folder). What the code relies on from those notes
is in docs/algorithm_sources.md with its primary source; cite that page's sections instead, and
every "algorithm_sources.md section N" must name a section the page has.

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


#: citations of the research notes kept outside the repository. "digest" alone is not enough (hashlib
#: digests are everywhere): only with a section number after it, after "project" / "anchors" / "in the",
#: before "says", or as "(name:".
OUTSIDE_NOTES = re.compile("|".join((
    r"\b" + "dig" + r"est\s+(?:section\b|§|\d)",
    r"\b(?:project|anchors)\s+" + "dig" + r"est\b",
    r"\(" + "dig" + r"est:|\b" + "dig" + r"est(?:'s|\s+says)\b|\b(?:in|through)\s+the\s+" + "dig" + r"est\b",
    r"\b" + "dig" + r"ested\s+in\b",
    r"\b(?:" + "|".join(("core_" + "variants", "dllm_" + "dppo", "anch" + "ors", "vlm_" + "algos",
                        "rewards_critic_" + "robot", "agents_prompt_" + "space")) + r")\.md\b",
    r"(?<![\w.-])" + "rese" + "arch/",  # the notes' folder, but not facebookresearch/igpo
)), re.IGNORECASE)

SOURCES_DOC = "docs/algorithm_sources.md"


def outside_note_hits(name: str, text: str) -> list[str]:
    """``name:line: text`` for each line of ``text`` that cites the research notes outside the repository."""
    return [f"{name}:{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), start=1)
            if OUTSIDE_NOTES.search(line)]


def source_sections(doc_text: str) -> set[str]:
    """Section numbers of docs/algorithm_sources.md: ``## 17. ...`` -> "17", ``### 17.3 ...`` -> "17.3"."""
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.?\s", doc_text, flags=re.M))


def dangling_source_pointers(name: str, text: str, sections: set[str]) -> list[str]:
    """Each "algorithm_sources.md section N" (or "§N", or "algorithm_sources.md N.M") whose N is not a section."""
    bad = []
    for found in re.finditer(r"algorithm_sources\.md(?:`{1,2})?\s*(?:section\s+|§\s*)?(\d+(?:\.\d+)?)\b", text):
        if found.group(1) not in sections:
            line = text.count("\n", 0, found.start()) + 1
            bad.append(f"{name}:{line}: " + " ".join(found.group(0).split()))
    return bad


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
        names = list(filter(None, listed.decode().split("\0")))
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist): every file
        skip = {".git", ".venv", "runs", "__pycache__", ".pytest_cache"}
        names = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and not p.name.endswith(".egg-info")]
    files = []
    for name in names:
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


def test_no_tracked_file_cites_the_outside_research_notes():
    files = _tracked_text_files()
    assert len(files) > 100
    hits = [hit for name, text in files for hit in outside_note_hits(name, text)]
    assert not hits, (f"citations of research notes outside the repository (put the fact with its primary source "
                      f"into {SOURCES_DOC} and cite its section):\n" + "\n".join(hits))


def test_every_pointer_into_algorithm_sources_names_a_section_it_has():
    sections = source_sections((ROOT / SOURCES_DOC).read_text())
    assert {"0", "5", "6", "7", "17", "17.0", "17.7", "18"} <= sections
    files = _tracked_text_files()
    bad = [hit for name, text in files if name != SOURCES_DOC for hit in dangling_source_pointers(name, text, sections)]
    assert not bad, f"pointers to sections {SOURCES_DOC} does not have:\n" + "\n".join(bad)


#: one line per pattern of each scan, built from pieces so the repository scan does not read them
MACHINE_PATH_LINES = [
    "see ``/" + "work/shared" + "/rese" + "arch/vlm_" + "algos.md`` section 1",
    "cd /" + "root/mmpo && pytest",
    "cp /" + "home/user/data.hdf5 .",
    "the shared" + "/research digest",
    "`../" + "shared/tools/readme-commands quickstart`",
    'GIT_DIR = "/tmp/x/.' + 'mirror/volcengine+verl/repo"',
]
OUTSIDE_NOTE_LINES = [
    "The band values are UNVERIFIED (dig" + "est section 13).",
    "the filter reweights (dig" + "est 1.4.5).",
    "loss term (Dig" + "est 1.4.5: in this mode",
    "digest ``core_" + "variants.md`` section 10",
    "read through the project dig" + "est, which read that file",
    "see anchors dig" + "est section 1.4",
    "as told in the project's `rese" + "arch/dllm_" + "dppo.md` Part 1",
    "(the notes' `dllm_" + "dppo.md` 2.2, 2.13)",
    "anch" + "ors.md section 1.4",
    "vlm_" + "algos.md 3(d)",
    "rewards_critic_" + "robot.md",
    "agents_prompt_" + "space.md",
    "the notes in `rese" + "arch/` say so",
    "whiten the kept tokens (dig" + "est: masked tokens are left out",
    "Whitening: the dig" + "est says the masked tokens stay out",
    "the dig" + "est's worked values among them",
    "UNVERIFIED; the paper's window is not in the dig" + "est).",
    "as dig" + "ested in the project's notes",
]


@pytest.mark.parametrize(("scan", "line"), [(machine_path_hits, line) for line in MACHINE_PATH_LINES]
                         + [(outside_note_hits, line) for line in OUTSIDE_NOTE_LINES])
def test_the_scans_catch_each_pattern(scan, line):
    text = "first line is fine\n" + line + "\n"
    assert scan("docs/fake.md", text) == [f"docs/fake.md:2: {line}"]


def test_the_notes_scan_passes_hash_digests_and_repository_names():
    text = "\n".join((
        "digest = hashlib.sha256()",
        "    digest.update(chunk)",
        "return digest.hexdigest()",
        "listed[name.strip()] = digest",
        "def _write_sidecar(path: Path, digest: str) -> None:",
        "the digest of the file matches its sidecar",
        'return {"mode": mode, "tokens_sha": digest, "first_wall_s": wall[0]}',
        "IGPO (``facebookresearch/igpo:utils/generate.py``)",
        "Official code: ``AIFrameResearch/SPO``",
        "see docs/algorithm_sources.md section 17.3 (IGPO)",
    ))
    assert outside_note_hits("mmpo/fake.py", text) == []


def test_dangling_pointers_into_algorithm_sources_are_caught():
    sections = {"3", "17", "17.3"}
    doc = "algorithm_" + "sources.md"  # in pieces, so the repository scan does not read these lines
    text = (f"ok: docs/{doc} section 3\nok: ``docs/{doc}``\nsection 17.3\nok: [{doc}]({doc})\n"
            f"bad: [{doc} §4]({doc})\nbad: {doc} 17.9 (IGPO)\n")
    assert dangling_source_pointers("docs/fake.md", text, sections) == [
        f"docs/fake.md:5: {doc} §4", f"docs/fake.md:6: {doc} 17.9"]


def test_the_scan_passes_repository_paths_and_user_output_dirs():
    text = "see docs/algorithm_sources.md\nmmpo quickstart --out runs/qs\npython x.py --out /tmp/x.json\n"
    assert machine_path_hits("docs/fake.md", text) == []
    # a pending line is only excused in its own file
    for pending_file, pending_text in sorted(PENDING_ELSEWHERE):
        assert machine_path_hits(pending_file, pending_text) == []
        assert machine_path_hits("docs/fake.md", pending_text) != []
