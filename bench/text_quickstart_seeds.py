"""Summarise ``mmpo quickstart --kind text`` runs over seeds (bench/RESULTS.md "text-quickstart-teacher").

Reads ``ROOT/seed*/`` (each the ``--out`` of one quickstart run) and prints, in markdown:

- one row per seed: greedy held-out accuracy after SFT and after GRPO, the gain with its 95% paired bootstrap
  interval over the items (the run's own ``grpo_vs_sft``, ``mmpo.quickstart.paired_gain``), the held-out
  abstention shares, the accuracy on the questions about the colours the teacher never abstains on (``--control``,
  default purple and orange: what GRPO does to the lookup itself), and the training reward's first / last 10%;
- the pooled gain over items x seeds (``mmpo.eval.stats.paired_difference``: hierarchical bootstrap over seeds
  then items, and the seed-t interval), on all items and on the control questions.

Usage::

    for S in 0 1 2 3 4; do mmpo quickstart --kind text --seed $S --threads 1 --no-progress --out ROOT/seed$S; done
    python bench/text_quickstart_seeds.py ROOT
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from mmpo.eval.stats import format_interval, paired_difference
from mmpo.quickstart import item_correctness, prediction_records


def runs(root: Path) -> list[Path]:
    """The finished runs under ``root`` (``seed*/quickstart.json``), in name order."""
    found = sorted(path for path in root.glob("seed*") if (path / "quickstart.json").is_file())
    if not found:
        raise FileNotFoundError(f"no finished quickstart run (seed*/quickstart.json) under {root}")
    return found


def asked_in(run: Path, colours: Sequence[str]) -> set[str]:
    """The item keys (``benchmark/id``) whose question asks about one of ``colours`` (``How many <colour> ...``)."""
    pattern = re.compile(r"How many (" + "|".join(map(re.escape, colours)) + r") ")
    return {f"{benchmark}/{record['id']}" for benchmark, record in prediction_records(run / "eval" / "after_sft")
            if pattern.match(str(record["prompt"]))}


def paired_items(run: Path, keys: set[str] | None = None) -> tuple[list[float], list[float]]:
    """(after SFT, after GRPO) correctness of the items both evaluations scored (restricted to ``keys``)."""
    sft, grpo = item_correctness(run / "eval" / "after_sft"), item_correctness(run / "eval" / "after_grpo")
    shared = sorted(sft.keys() & grpo.keys() & (keys if keys is not None else sft.keys()))
    return [sft[k] for k in shared], [grpo[k] for k in shared]


def seed_row(run: Path, control: Sequence[str]) -> dict[str, Any]:
    summary = json.loads((run / "quickstart.json").read_text())
    before, after = paired_items(run, asked_in(run, control))
    return {"seed": summary["seed"], "sft": summary["accuracy"]["after SFT"]["mean"],
            "grpo": summary["accuracy"]["after GRPO"]["mean"], "gain": summary["grpo_vs_sft"],
            "abstained": summary["abstained"], "reward": summary["reward"],
            "control": (sum(before) / len(before), sum(after) / len(after), len(before)) if before else None}


def pooled(root: Path, keys_of=None) -> dict[str, Any]:
    """``paired_difference`` of GRPO - SFT over the runs (``keys_of(run)``: the item keys to keep; None: all)."""
    pairs = [paired_items(run, keys_of(run) if keys_of else None) for run in runs(root)]
    result = paired_difference([after for _, after in pairs], [before for before, _ in pairs])
    return {**result, "items": sum(len(before) for before, _ in pairs)}


def report(root: Path, control: Sequence[str] = ("purple", "orange")) -> str:
    lines = ["| seed | after SFT | after GRPO | gain | 95% interval (items) | held-out abstentions SFT -> GRPO | "
             f"{'/'.join(control)} questions SFT -> GRPO (items) | training reward first -> last 10% |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs(root):
        row = seed_row(run, control)
        ctl = row["control"]
        lines.append(
            f"| {row['seed']} | {row['sft']:.3f} | {row['grpo']:.3f} | {row['gain']['gain']:+.3f} | "
            f"{format_interval(row['gain']['interval'])} | {row['abstained']['after SFT']:.0%} -> "
            f"{row['abstained']['after GRPO']:.0%} | "
            + (f"{ctl[0]:.3f} -> {ctl[1]:.3f} ({ctl[2]})" if ctl else "-")
            + f" | {row['reward']['first']:.3f} -> {row['reward']['last']:.3f} |")
    for name, keys_of in (("all items", None), (f"{'/'.join(control)} questions", lambda run: asked_in(run, control))):
        result = pooled(root, keys_of)
        lines.append(f"\nPooled GRPO - SFT, {name} ({result['items']} paired items): {result['estimate']:+.4f}, "
                     f"bootstrap {format_interval(result['bootstrap'])}, seed-t {format_interval(result['seed_t'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the directory holding seed*/ (one quickstart --out each)")
    parser.add_argument("--control", default="purple,orange",
                        help="comma-separated colours whose questions the teacher never abstains on")
    args = parser.parse_args(argv)
    try:
        print(report(args.root, tuple(c.strip() for c in args.control.split(",") if c.strip())))
    except FileNotFoundError as error:
        print(f"text_quickstart_seeds: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
