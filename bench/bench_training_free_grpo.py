"""Training-Free GRPO testbed: does a learned experience library raise held-out accuracy of a frozen policy, and
does it need groups (G = 5 vs G = 1)?

The testbed (docs/prompt_space.md):
- task: ``Repeat the word W.``; correct = ``<answer>W in capitals</answer>``. Practice words and held-out words
  are disjoint, so only a general rule can carry over.
- policy: a tiny Qwen3 text LM fine-tuned here (a few hundred CPU steps) to copy the word, in capitals always
  when its prompt's experiences contain the line ``Format: write the answer in capital letters.``, otherwise in
  capitals 1 time in 5. Its weights are frozen afterwards.
- extractor: :class:`ContrastExtractor`, the rule extractor with one checkable group-advantage rule: when every
  rewarded attempt of a group wrote the answer in capitals and some unrewarded one did not, the group's
  experience is the format line.

Run: ``python bench/bench_training_free_grpo.py --out DIR [--seeds 5]`` (CPU, a few minutes). It prints a
Markdown table: held-out sampled accuracy with the learned library and with none, for G = 5 and G = 1, each
mean over seeds with a 95% Student-t interval.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import torch

from mmpo.eval.stats import format_interval, seed_t_interval
from mmpo.practice.backends import RuleExtractor
from mmpo.practice.experience import problem_with_experiences
from mmpo.practice.loop import PracticeConfig, TrainingFreeGRPO

WORDS = ["apple", "river", "stone", "cloud", "green", "piano", "tiger", "lemon", "chair", "ocean", "house", "plant"]
TRAIN_WORDS, HELDOUT_WORDS = WORDS[:8], WORDS[8:]
RULE = "Format: write the answer in capital letters."
DISTRACTOR = "Checks: read the problem twice."


def rows_for(words, repeats: int, prefix: str) -> list[dict]:
    return [{"id": f"{prefix}-{w}-{i}", "problem": f"Repeat the word {w}.", "answer": w.upper(), "task": "repeat_word"}
            for i in range(repeats) for w in words]


def exact_answer(completions, answer, **columns):
    """1 when the completion holds ``<answer>ANSWER</answer>`` (case-sensitive), else 0."""
    return [float(f"<answer>{a}</answer>" in text) for text, a in zip(completions, answer)]


class ContrastExtractor(RuleExtractor):
    """RuleExtractor whose group advantage is the capitals rule when the group's contrast shows it (see module doc)."""

    def complete(self, system, user, *, stage, context):
        if stage != "group_advantage":
            return super().complete(system, user, stage=stage, context=context)
        answers = [re.findall(r"<answer>(.*?)</answer>", s) for s in context["summaries"]]
        good = [a for a, r in zip(answers, context["rewards"]) if r > 0]
        bad = [a for a, r in zip(answers, context["rewards"]) if r <= 0]
        capitals = lambda found: bool(found) and found[0].isupper()  # noqa: E731
        if good and all(capitals(a) for a in good) and any(not capitals(a) for a in bad):
            return f"<Experiences>\n1. {RULE}\n</Experiences>"
        return "no pattern"


def sft_policy(base: Path, out: Path, *, steps: int, seed: int) -> Path:
    """Fine-tune the tiny LM to copy the word: capitals with the rule in its prompt, else capitals 1 time in 5."""
    from mmpo.vlm.factory import build_tiny_text_lm, load_vlm
    from mmpo.vlm.processing import encode_completions, encode_prompts

    corpus = [problem_with_experiences(f"Repeat the word {w}.", {"G0": RULE, "G1": DISTRACTOR}) for w in WORDS]
    corpus += [f"<answer>{w}</answer> <answer>{w.upper()}</answer>" for w in WORDS] * 4
    build_tiny_text_lm(base, corpus=corpus, vocab_size=500, hidden_size=64, intermediate_size=128, num_layers=2,
                       seed=seed)
    model, processor = load_vlm(base)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        rows, targets = [], []
        for _ in range(32):
            word = rng.choice(WORDS)
            library = rng.choice([{}, {"G0": DISTRACTOR}, {"G0": RULE}, {"G0": DISTRACTOR, "G1": RULE},
                                  {"G0": RULE, "G1": DISTRACTOR}])
            upper = RULE in library.values() or rng.random() < 0.2
            rows.append({"problem": problem_with_experiences(f"Repeat the word {word}.", library)})
            targets.append(f"<answer>{word.upper() if upper else word}</answer>")
        prompts = encode_prompts(processor, rows)
        ids, mask = encode_completions(processor, targets)
        input_ids = torch.cat([prompts["input_ids"], ids], 1)
        attention = torch.cat([prompts["attention_mask"], mask], 1)
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompts["input_ids"].shape[1] - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1),
                                                 reduction="none")
        loss = (loss * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            print(f"sft step {step}: loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sft-steps", type=int, default=300)
    args = parser.parse_args()
    out = Path(args.out)
    policy_path = sft_policy(out / "base", out / "policy", steps=args.sft_steps, seed=0)
    from mmpo.vlm.factory import load_vlm

    policy = load_vlm(policy_path)
    reward = {f"{Path(__file__).resolve()}:exact_answer": 1.0}
    heldout = rows_for(HELDOUT_WORDS, 4, "test")
    results: dict[str, list[float]] = {}
    libraries = {}
    for group_size in (5, 1):
        for seed in range(args.seeds):
            config = PracticeConfig(model_path=str(policy_path), output_dir=str(out / f"g{group_size}_s{seed}"),
                                    tasks=["repeat_word"], train_size=1, epochs=1, batch_size=8, grpo_n=group_size,
                                    temperature=0.7, max_new_tokens=12, extractor="rules", rewards=reward,
                                    num_experiences_per_query=1, seed=seed)
            runner = TrainingFreeGRPO(config, policy=policy, backend=ContrastExtractor(),
                                      rows=rows_for(TRAIN_WORDS, 2, "train"))
            state = runner.run(progress=False)
            library = state["experiences"]
            libraries[f"G={group_size} seed {seed}"] = library
            for name, lib in (("with library", library), ("no library", {})):
                groups = runner.rollout(heldout, lib, seed=10_000 + seed)
                accuracy = sum(r for g in groups for r in g.rewards) / sum(len(g.rewards) for g in groups)
                results.setdefault(f"G={group_size}, {name}", []).append(accuracy)
    print(json.dumps(libraries, indent=1))
    print("| setting | held-out sampled accuracy, mean [95% t-interval] | per seed |")
    print("| --- | --- | --- |")
    for name, values in results.items():
        mean = sum(values) / len(values)
        print(f"| {name} | {mean:.3f} {format_interval(seed_t_interval(values))} | "
              f"{', '.join(f'{v:.3f}' for v in values)} |")


if __name__ == "__main__":
    main()
