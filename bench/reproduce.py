"""Rerun the cheap recorded results of bench/RESULTS.md with their recorded commands and compare.

Each item runs the command recorded in bench/RESULTS.md (threads pinned: OMP_NUM_THREADS=1,
MKL_NUM_THREADS=1, as recorded; the deterministic items also pin AVX2 code paths, see
mmpo/training/machine.py), reads the numbers it produced, reads the numbers recorded in
bench/RESULTS.md, and prints one table: claim, recorded, now, status. Deterministic results (fixed
seeds, one CPU thread) must match to the printed precision; noisy ones (CPU time on a shared machine)
within the stated relative tolerance. Not part of the unit test suite: it runs real trainings.

    python bench/reproduce.py --list              # the items, how long each takes, their commands
    python bench/reproduce.py                     # every item not marked slow
    python bench/reproduce.py --only quickstart   # one item
    python bench/reproduce.py --slow              # also the slow items (dLLM tiny configs, core at full size)

Exit status 0 when every compared claim reproduces, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mmpo.training.machine import PORTABLE_CPU_NUMERICS, cpu_fingerprint, describe_machine

REPO = Path(__file__).resolve().parents[1]
RESULTS_MD = REPO / "bench" / "RESULTS.md"
PINNED_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# the deterministic items also pin the SIMD level (mmpo/training/machine.py): recorded on one processor type,
# they then reproduce exactly on another (AMD EPYC -> Intel AVX-512 checked on 2026-12-01)
PINNED_SIMD = {key: value for key, value in PORTABLE_CPU_NUMERICS.items() if key not in PINNED_THREADS}

OK, DIFFERS, MISSING, NOT_RECORDED = "ok", "DIFFERS", "MISSING", "not recorded"


# ------------------------------------------------------------------------------ reading RESULTS.md
def section(text: str, anchor: str) -> str:
    """The text of RESULTS.md from ``<a id="anchor">`` to the next anchor."""
    match = re.search(rf'<a id="{re.escape(anchor)}"></a>(.*?)(?=<a id="|\Z)', text, re.S)
    if match is None:
        raise KeyError(f"no section <a id={anchor!r}> in bench/RESULTS.md")
    return match.group(1)


def table_after(text: str, heading: str) -> list[dict[str, str]]:
    """Rows ({column: cell}) of the first markdown table after the first line containing ``heading``."""
    start = text.find(heading)
    if start < 0:
        raise KeyError(f"no {heading!r} in bench/RESULTS.md")
    lines = text[start:].splitlines()[1:]
    table: list[list[str]] = []
    for line in lines:
        if line.strip().startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    if len(table) < 2:
        raise KeyError(f"no table after {heading!r} in bench/RESULTS.md")
    header, rows = table[0], [row for row in table[1:] if not set("".join(row)) <= set("-: ")]
    return [dict(zip(header, row)) for row in rows]


def number(cell: str) -> float | None:
    """The first number in a table cell (``**0.337**`` -> 0.337, ``1.15x`` -> 1.15); None if there is none."""
    match = re.search(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", cell.replace("**", ""))
    return float(match.group()) if match else None


# ------------------------------------------------------------------------------ claims and comparison
@dataclass(frozen=True)
class Claim:
    """One recorded number and how closely a rerun must match it."""

    name: str
    recorded: float | None
    rel_tol: float = 0.0  # 0: equal once both are rounded to ``decimals``
    decimals: int = 3

    def status(self, now: float | None) -> str:
        if self.recorded is None:
            return NOT_RECORDED
        if now is None:
            return MISSING
        if self.rel_tol == 0.0:
            return OK if round(now, self.decimals) == round(self.recorded, self.decimals) else DIFFERS
        return OK if abs(now - self.recorded) <= self.rel_tol * abs(self.recorded) else DIFFERS


def compare(claims: list[Claim], now: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """(claim, recorded, now, status) rows; a claim the rerun did not produce is MISSING."""
    rows = []
    for claim in claims:
        value = now.get(claim.name)
        tolerance = "" if claim.rel_tol == 0.0 else f" (+-{claim.rel_tol:.0%})"
        rows.append((claim.name, "n/a" if claim.recorded is None else f"{claim.recorded:.{claim.decimals}f}",
                     "n/a" if value is None else f"{value:.{claim.decimals}f}", claim.status(value) + tolerance))
    return rows


def format_table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("claim", "recorded", "now", "status")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(4)]
    lines = [" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the items
@dataclass(frozen=True)
class Item:
    """A recorded benchmark: its command(s), how long it takes, its recorded claims, its fresh numbers."""

    name: str
    minutes: str  # how long it takes on 2 shared CPU cores, stated before it runs
    slow: bool
    commands: Callable[[Path], list[list[str]]]  # argv lists, run in order with the threads pinned
    recorded: Callable[[str], list[Claim]]  # from the text of RESULTS.md
    measured: Callable[[Path, str], dict[str, float]]  # from (work dir, stdout of the commands)
    note: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)


def _mmpo() -> list[str]:
    return [sys.executable, "-m", "mmpo.cli"]


# quickstart: `OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 mmpo quickstart --out DIR`
QUICKSTART_STAGES = ("before SFT", "after SFT", "after GRPO")


# the reference table: the newest pinned run (the 2026-11-29 table moved with the processor type; see RESULTS)
QUICKSTART_HEADING = "### Reference table (2026-12-05, commit 21ceec3, SIMD level pinned)"


def quickstart_recorded(text: str) -> list[Claim]:
    rows = table_after(section(text, "quickstart"), QUICKSTART_HEADING)
    return [Claim(f"quickstart {row['task']} {stage}", number(row[stage]))
            for row in rows for stage in QUICKSTART_STAGES]


def quickstart_measured(work: Path, stdout: str) -> dict[str, float]:
    accuracy = json.loads((work / "quickstart" / "quickstart.json").read_text())["accuracy"]
    return {f"quickstart {task} {stage}": value for stage in QUICKSTART_STAGES
            for task, value in accuracy.get(stage, {}).items()}


# env throughput: `for n in 1 2 4; do OMP_NUM_THREADS=1 python bench/robotics_envs.py throughput ...; done`
THROUGHPUT_ENVS = (1, 2, 4)


def throughput_recorded(text: str) -> list[Claim]:
    rows = table_after(section(text, "robotics-envs"), "### Env steps per second")
    claims = []
    for row in rows:
        n = int(number(row["num_envs"]))
        # CPU seconds per simulator step do not depend on the load; the wall-clock rates do (3-4x here)
        claims.append(Claim(f"env lift num_envs={n} raw CPU s per step", number(row["raw CPU s per step"]),
                            rel_tol=0.3, decimals=4))
    return claims


def throughput_measured(work: Path, stdout: str) -> dict[str, float]:
    now = {}
    for line in stdout.splitlines():
        if line.startswith("{") and '"raw_cpu_s_per_step"' in line:
            result = json.loads(line)
            now[f"env lift num_envs={int(result['num_envs'])} raw CPU s per step"] = result["raw_cpu_s_per_step"]
    return now


# core memory table (CPU): the recorded full-size command; memory in MiB is load-independent
def core_recorded(text: str) -> list[Claim]:
    rows = table_after(section(text, "core"), "#### CPU (the target configuration)")
    claims = [Claim(f"core {row['phase']} {row['path']} peak MiB", number(row["peak RSS over inputs (MiB)"]),
                    rel_tol=0.05, decimals=0) for row in rows]
    claims += [Claim(f"core {row['phase']} memory ratio naive/chunked", number(row["memory ratio naive/chunked"]),
                     rel_tol=0.05, decimals=1) for row in rows if number(row["memory ratio naive/chunked"])]
    return claims


def core_measured(work: Path, stdout: str) -> dict[str, float]:
    rows = table_after((work / "core_table.md").read_text(), "V=")
    now = {f"core {row['phase']} {row['path']} peak MiB": number(row[next(k for k in row if k.startswith("peak"))])
           for row in rows}
    now.update({f"core {row['phase']} memory ratio naive/chunked": number(row["memory ratio naive/chunked"])
                for row in rows if number(row["memory ratio naive/chunked"])})
    return now


# the same script at a reduced size (B=1, T=256): only the size-independent claim, that both paths agree
AGREEMENT = "results equal (log-probs, grad hidden, grad lm_head rows):"


def _agreement(text: str) -> float | None:
    match = re.search(re.escape(AGREEMENT) + r"\s*(yes|NO)", text)
    return None if match is None else float(match.group(1) == "yes")


def core_agreement_recorded(text: str) -> list[Claim]:
    cpu = section(text, "core").split("#### CPU (the target configuration)")[1].split("####")[0]
    return [Claim("core naive and chunked paths agree (1 = yes)", _agreement(cpu), decimals=0)]


def core_agreement_measured(work: Path, stdout: str) -> dict[str, float]:
    value = _agreement(stdout)
    return {} if value is None else {"core naive and chunked paths agree (1 = yes)": value}


# GRPO step vs TRL (issue 13): `python bench/bench_grpo_vs_trl.py --tokens 32 128 --rounds 3 --steps 5`; TRL comes
# from the `bench` extra or a folder given by MMPO_TRL_PATH (passed as --trl-path)
TRL_TOKENS = (32, 128)
TRL_RATIO_TOLERANCE = 0.15  # wall-clock ratios of two interleaved subprocesses on a shared machine


def trl_recorded(text: str) -> list[Claim]:
    claims = []
    for tokens in TRL_TOKENS:
        text_of_section = section(text, "grpo-vs-trl")
        header = f"| {tokens} tokens | mmpo | TRL | mmpo / TRL |"
        start = text_of_section.find(header)
        if start < 0:
            raise KeyError(f"no {header!r} in bench/RESULTS.md")
        rows = table_after("table\n" + text_of_section[start:], "table")  # the table starts at its own header
        row = next(r for r in rows if r[f"{tokens} tokens"].startswith("s / step (wall)"))
        claims.append(Claim(f"GRPO step mmpo / TRL wall at {tokens} tokens", number(row["mmpo / TRL"]),
                            rel_tol=TRL_RATIO_TOLERANCE, decimals=2))
    return claims


def trl_commands(work: Path) -> list[list[str]]:
    trl_path = os.environ.get("MMPO_TRL_PATH")
    return [[sys.executable, "bench/bench_grpo_vs_trl.py", "--tokens", *map(str, TRL_TOKENS), "--rounds", "3",
             "--steps", "5", "--json", str(work / "grpo_vs_trl.json"), *(["--trl-path", trl_path] if trl_path else [])]]


def trl_measured(work: Path, stdout: str) -> dict[str, float]:
    import statistics

    runs = json.loads((work / "grpo_vs_trl.json").read_text())["runs"]
    return {f"GRPO step mmpo / TRL wall at {tokens} tokens":
            statistics.median(r["wall_s"] for r in runs[str(tokens)]["mmpo"])
            / statistics.median(r["wall_s"] for r in runs[str(tokens)]["trl"]) for tokens in TRL_TOKENS}


# dLLM tiny configs end to end: sft_tiny, grpo_tiny, igpo_tiny, then `mmpo eval ... --benchmarks mmpo/dllm/arith`
DLLM_MODELS = {"SFT": "sft_tiny", "GRPO": "grpo_tiny", "IGPO": "igpo_tiny"}


def dllm_recorded(text: str) -> list[Claim]:
    rows = table_after(section(text, "dllm"), "### The tiny configs end to end: reference")
    claims = []
    for row in rows:
        label = next(name for name in DLLM_MODELS if row["model"].startswith(name))
        accuracy_column = next(key for key in row if "mmpo eval" in key)
        claims.append(Claim(f"dllm {label} eval mmpo/dllm/arith accuracy", number(row[accuracy_column])))
    return claims


def dllm_commands(work: Path) -> list[list[str]]:
    """The recorded commands; only the output folders are redirected into ``work`` (paths, not numerics)."""
    commands = []
    for label, name in DLLM_MODELS.items():
        root = work / name
        paths = [f"--trainer.default_root_dir={root}", f"--trainer.callbacks.init_args.dirpath={root / 'checkpoints'}",
                 f"--model.init_args.save_dir={root / 'model'}"]
        if name != "sft_tiny":
            paths += [f"--model.init_args.model_path={work / 'sft_tiny' / 'model'}"]
        commands.append([*_mmpo(), "fit", "-c", f"configs/dllm/{name}.yaml", *paths])
    for name in DLLM_MODELS.values():
        commands.append([*_mmpo(), "eval", "--model", str(work / name / "model"), "--benchmarks", "mmpo/dllm/arith",
                         "--out", str(work / f"eval_{name}")])
    return commands


def dllm_measured(work: Path, stdout: str) -> dict[str, float]:
    now = {}
    for label, name in DLLM_MODELS.items():
        results = work / f"eval_{name}" / "results.json"
        if results.is_file():
            benchmarks = json.loads(results.read_text())["benchmarks"]
            now[f"dllm {label} eval mmpo/dllm/arith accuracy"] = benchmarks["mmpo/dllm/arith"]["accuracy"]
    return now


ITEMS = [
    Item("quickstart", "3 min on an idle core, up to 15 min on loaded shared cores", False,
         lambda work: [[*_mmpo(), "quickstart", "--out", str(work / "quickstart")]],
         quickstart_recorded, quickstart_measured, extra_env=PINNED_SIMD,
         note="deterministic on CPU at one thread with the SIMD level pinned: exact to 3 decimals"),
    Item("env_throughput", "about 1-2 min (3 runs of 400 raw + 400 vector-env steps)", False,
         lambda work: [[sys.executable, "bench/robotics_envs.py", "throughput", "--task", "lift", "--num-envs", str(n),
                        "--steps", "400"] for n in THROUGHPUT_ENVS],
         throughput_recorded, throughput_measured,
         note="CPU time per step within 30% (load-dependent wall-clock rates are not compared)"),
    Item("core_agreement", "about 1 min (the core script at B=1, T=256)", False,
         lambda work: [[sys.executable, "bench/bench_logprob_memory.py", "--batch", "1", "--time", "256"]],
         core_agreement_recorded, core_agreement_measured,
         note="reduced size: only the agreement of the two paths compares (memory and time scale with B x T)"),
    Item("core_memory", "about 8-10 min, ~11 GB RAM (the recorded full size)", True,
         lambda work: [[sys.executable, "bench/bench_logprob_memory.py", "--out", str(work / "core_table.md")]],
         core_recorded, core_measured, note="peak RSS and memory ratios within 5% (timings are load-dependent)"),
    Item("grpo_vs_trl", "about 3 min (2 lengths x 3 interleaved rounds of 5 steps per side); needs TRL (the bench "
         "extra, or MMPO_TRL_PATH=DIR holding trl)", True, trl_commands, trl_recorded, trl_measured,
         note=f"wall-clock ratio mmpo / TRL within {TRL_RATIO_TOLERANCE:.0%}"),
    Item("dllm_tiny", "about 40 min (SFT ~25 min, GRPO ~5 min, IGPO ~6 min, 3 evals)", True,
         dllm_commands, dllm_recorded, dllm_measured, extra_env=PINNED_SIMD,
         note="deterministic on CPU at one thread with the SIMD level pinned: exact to 3 decimals"),
]


# ------------------------------------------------------------------------------ running
def run_item(item: Item, work: Path) -> tuple[dict[str, float], str]:
    """Run the item's commands with the threads pinned and the current checkout first on the path."""
    work.mkdir(parents=True, exist_ok=False)  # a fresh folder: never reuse or overwrite earlier outputs
    env = dict(os.environ, **PINNED_THREADS, **item.extra_env,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    stdout = []
    for command in item.commands(work):
        print(f"[reproduce] {item.name}: {' '.join(command)}", flush=True)
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        stdout.append(done.stdout)
        if done.returncode != 0:
            print(f"[reproduce] {item.name}: exit {done.returncode}\n{done.stderr[-3000:]}", flush=True)
            break
    output = "\n".join(stdout)
    try:
        return item.measured(work, output), output
    except (OSError, KeyError, ValueError) as error:  # a failed run leaves its claims MISSING
        print(f"[reproduce] {item.name}: could not read its results: {error!r}", flush=True)
        return {}, output


def describe(items: list[Item], text: str) -> str:
    lines = []
    for item in items:
        claims = item.recorded(text)
        lines.append(f"{item.name}{' (slow: needs --slow)' if item.slow else ''}: {item.minutes}; "
                     f"{len(claims)} recorded numbers; {item.note}")
        for command in item.commands(Path("DIR")):
            env = {**PINNED_THREADS, **item.extra_env}
            lines.append("    " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(command))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the items, their durations and commands; run nothing")
    parser.add_argument("--only", choices=[item.name for item in ITEMS], action="append",
                        help="run only this item (repeatable)")
    parser.add_argument("--slow", action="store_true", help="also run the slow items")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the runs' outputs (default: a new temp dir)")
    parser.add_argument("--results", type=Path, default=RESULTS_MD, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    text = args.results.read_text()
    chosen = [item for item in ITEMS if (item.name in args.only if args.only else (args.slow or not item.slow))]
    if args.list:
        print(describe(ITEMS, text))
        return 0
    print("[reproduce] this will take: " + "; ".join(f"{item.name} {item.minutes}" for item in chosen), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="mmpo_reproduce_"))
    rows: list[tuple[str, str, str, str]] = []
    for item in chosen:
        started = time.monotonic()
        now, _ = run_item(item, work / item.name)
        rows += compare(item.recorded(text), now)
        print(f"[reproduce] {item.name}: {time.monotonic() - started:.0f} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    print(f"\nbench/RESULTS.md vs a rerun at {commit or 'unknown commit'} on {describe_machine(cpu_fingerprint())} "
          f"(outputs in {work}); deterministic items ran with {PINNED_SIMD}:\n")
    print(format_table(rows))
    return 0 if all(row[3].startswith(OK) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
