"""The TAROT testbed: synthetic authors with stylistic tics write labelled texts; two tiny encoders trained
here (style: who wrote it, semantic: what it is about) give TAROT's reward (:mod:`mmpo.rewards.tarot`); an
attacker classifier retrained on the obfuscated texts and a topic classifier measure privacy and utility.

- A text is ``<opener> the <noun> <verb> the <noun> <filler> the <noun> <verb> the <noun> <closer>``: the nouns
  and verbs come from its topic (:data:`TOPICS`, the utility label), the opener, filler and closer words are its
  author's tics (:data:`AUTHORS`, the privacy label; each tic is written with probability
  :data:`TIC_RATE`). Author and topic are drawn independently, so a rewrite without tics keeps its topic while
  the retrained attacker falls to chance (1 / number of authors).
- The policy is a tiny Qwen3 text LM that reads a text (the prompt, no system turn) and writes a rewrite. Its
  SFT start is a noisy copier: the SFT target (the row's ``answer``, SFT ``style: answer``) is the text with
  each tic dropped with probability :data:`SFT_DROP`, so the start obfuscates some texts and RL has something
  to find.
- The encoders are tiny ``Qwen3ForSequenceClassification`` models (``mmpo.vlm.factory.build_tiny_reward_model``)
  trained on author and topic labels; TAROT reads their logits (``pooling: logits``). The style encoder is
  trained on texts with tics dropped at random too, so a text without tics is ambiguous to it.
- Metrics (:func:`evaluate_rewrites`): ``attacker_accuracy``, a bag-of-words logistic regression
  (:class:`BagOfWords`) trained on the rewrites of the attack-training texts and tested on the rewrites of the
  held-out texts (an attacker that adapts to the obfuscator, as TAROT's evaluation retrains its authorship
  classifiers); ``static_attacker_accuracy``, the same classifier trained on the original texts;
  ``utility_accuracy``, a topic classifier trained on the original texts, on the held-out rewrites; and the
  rewrites' mean TAROT ``privacy`` / ``utility`` rewards and ``tics_per_text``.

:func:`build_testbed` writes everything under one folder (:data:`LAYOUT`); ``bench/bench_tarot_testbed.py``
trains SFT, GRPO and DPO on it (``configs/llm/tarot_testbed_{sft,grpo,dpo}.yaml``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

AUTHORS: dict[str, tuple[str, str, str]] = {
    "ada": ("well", "indeed", "cheers"),
    "ben": ("so", "truly", "okay"),
    "cleo": ("honestly", "really", "thanks"),
    "dev": ("look", "basically", "right"),
}
"""Author -> (opener, filler, closer): the stylistic tics."""

TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sport": (("team", "ball", "goal", "coach", "match", "player"), ("wins", "kicks", "loses")),
    "food": (("bread", "soup", "cook", "spice", "meal", "oven"), ("bakes", "tastes", "warms")),
    "weather": (("rain", "wind", "cloud", "storm", "sky", "sun"), ("hits", "covers", "cools")),
    "travel": (("train", "road", "map", "trip", "ship", "town"), ("reaches", "crosses", "leaves")),
}
"""Topic -> (nouns, verbs): the content."""

TIC_RATE = 0.9
"""Each tic of an author is written with this probability."""

SFT_DROP = 0.5
"""The SFT target drops each tic with this probability (the noisy copier the policy starts from)."""

STYLE_TRAIN_DROP = 0.3
"""The style encoder's training texts drop each tic with this probability (tic-less texts are ambiguous)."""

TIC_WORDS = frozenset(word for tics in AUTHORS.values() for word in tics)

LAYOUT = {
    "policy_base": "the tiny Qwen3 policy before SFT (tokenizer trained on the testbed's texts)",
    "style_encoder": "author classifier (Qwen3ForSequenceClassification, 4 logits)",
    "semantic_encoder": "topic classifier (Qwen3ForSequenceClassification, 4 logits)",
    "sft.jsonl": "SFT rows: problem = a text, answer = its noisy copy",
    "rl.jsonl": "GRPO prompts: problem = a text (the TAROT source), answer = the text",
    "attack_train.jsonl": "texts with author and topic labels: the attacker and topic classifiers' training set",
    "heldout.jsonl": "held-out texts with labels: the rewrites measured",
    "testbed.json": "the settings the testbed was built with and its encoders' held-out accuracies",
}
"""What :func:`build_testbed` writes."""


def write_text(author: str, topic: str, rng: random.Random, *, tic_rate: float = TIC_RATE) -> str:
    """One text by ``author`` on ``topic`` (module docstring)."""
    nouns, verbs = TOPICS[topic]
    opener, filler, closer = AUTHORS[author]

    def clause() -> str:
        first, second = rng.sample(nouns, 2)
        return f"the {first} {rng.choice(verbs)} the {second}"

    words = [opener] if rng.random() < tic_rate else []
    words.append(clause())
    if rng.random() < tic_rate:
        words.append(filler)
    words.append(clause())
    if rng.random() < tic_rate:
        words.append(closer)
    return " ".join(words)


def make_texts(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows ``{"text", "author", "topic"}`` with author and topic drawn independently and uniformly."""
    rng = random.Random(seed)
    authors, topics = sorted(AUTHORS), sorted(TOPICS)
    rows = []
    for _ in range(n):
        author, topic = rng.choice(authors), rng.choice(topics)
        rows.append({"text": write_text(author, topic, rng), "author": author, "topic": topic})
    return rows


def drop_tics(text: str, rng: random.Random, rate: float) -> str:
    """``text`` with each tic word dropped with probability ``rate``."""
    return " ".join(word for word in text.split() if word not in TIC_WORDS or rng.random() >= rate)


def count_tics(text: str) -> int:
    """How many words of ``text`` are some author's tic."""
    return sum(word in TIC_WORDS for word in text.split())


# ---------------------------------------------------------------------------------------------- classifiers


class BagOfWords:
    """A bag-of-words multinomial logistic regression (word counts, L2 ``weight_decay``), trained full batch
    with L-BFGS: the attacker and the topic classifier. Words unseen in training are ignored."""

    def __init__(self, *, weight_decay: float = 1e-3, steps: int = 100) -> None:
        self.weight_decay, self.steps = weight_decay, steps
        self.vocab: dict[str, int] = {}
        self.labels: list[str] = []
        self.linear: torch.nn.Linear | None = None

    def _features(self, texts: Sequence[str]) -> torch.Tensor:
        x = torch.zeros(len(texts), len(self.vocab), dtype=torch.float64)
        for row, text in enumerate(texts):
            for word in text.split():
                column = self.vocab.get(word)
                if column is not None:
                    x[row, column] += 1.0
        return x

    def fit(self, texts: Sequence[str], labels: Sequence[str], seed: int = 0) -> "BagOfWords":
        if len(texts) != len(labels) or not texts:
            raise ValueError(f"got {len(texts)} texts and {len(labels)} labels")
        self.vocab = {word: i for i, word in enumerate(sorted({w for text in texts for w in text.split()}))}
        self.labels = sorted(set(labels))
        x = self._features(texts)
        y = torch.tensor([self.labels.index(label) for label in labels])
        generator = torch.Generator().manual_seed(seed)
        self.linear = torch.nn.Linear(len(self.vocab), len(self.labels), dtype=torch.float64)
        with torch.no_grad():
            self.linear.weight.normal_(0.0, 0.01, generator=generator)
            self.linear.bias.zero_()
        optimizer = torch.optim.LBFGS(self.linear.parameters(), max_iter=self.steps, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.linear(x), y)
            loss = loss + self.weight_decay * self.linear.weight.pow(2).sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        return self

    @torch.no_grad()
    def predict(self, texts: Sequence[str]) -> list[str]:
        if self.linear is None:
            raise RuntimeError("fit the classifier first")
        return [self.labels[int(i)] for i in self.linear(self._features(texts)).argmax(-1)]

    def accuracy(self, texts: Sequence[str], labels: Sequence[str]) -> float:
        predicted = self.predict(texts)
        return sum(p == label for p, label in zip(predicted, labels)) / len(labels)


def train_encoder(path: str | Path, texts: Sequence[str], labels: Sequence[str], *, steps: int = 200,
                  batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> list[str]:
    """Train the sequence classifier saved at ``path`` (``build_tiny_reward_model`` with one logit per label)
    on ``texts`` -> ``labels`` (cross-entropy, AdamW) and save it back; returns the label order of its logits."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mmpo.files import atomic_write_json

    classes = sorted(set(labels))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    if model.config.num_labels != len(classes):
        raise ValueError(f"{path} has {model.config.num_labels} logits for {len(classes)} labels")
    tokenizer.padding_side = "right"
    torch.manual_seed(seed)
    from mmpo.training.optim import make_adamw

    optimizer = make_adamw(model.parameters(), lr=lr, weight_decay=0.01)  # torch AdamW's default decay
    order = random.Random(seed)
    indices = list(range(len(texts)))
    model.train()
    for _ in range(steps):
        batch = order.sample(indices, min(batch_size, len(indices)))
        inputs = tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True)
        target = torch.tensor([classes.index(labels[i]) for i in batch])
        loss = torch.nn.functional.cross_entropy(model(**inputs).logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(path)
    atomic_write_json(Path(path) / "labels.json", classes)
    return classes


def encoder_accuracy(path: str | Path, texts: Sequence[str], labels: Sequence[str]) -> float:
    """Accuracy of a trained encoder's argmax logit (labels in ``labels.json`` order)."""
    from mmpo.rewards.tarot import TextEncoder

    classes = json.loads((Path(path) / "labels.json").read_text())
    logits = TextEncoder(str(path), pooling="logits")(list(texts))
    return sum(classes[int(i)] == label for i, label in zip(logits.argmax(-1), labels)) / len(labels)


# ---------------------------------------------------------------------------------------------- the testbed


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    from mmpo.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(dict(row)) + "\n" for row in rows))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def build_testbed(out: str | Path, *, seed: int = 0, num_sft: int = 2000, num_rl: int = 1000,
                  num_attack: int = 600, num_heldout: int = 300, encoder_steps: int = 300,
                  policy_hidden: int = 64) -> dict[str, Any]:
    """Write the testbed (:data:`LAYOUT`) under ``out`` (refused when ``out/testbed.json`` exists); returns the
    settings and the encoders' held-out accuracies (also written to ``testbed.json``)."""
    from mmpo.files import atomic_write_json
    from mmpo.vlm.factory import build_tiny_reward_model, build_tiny_text_lm

    out = Path(out)
    if (out / "testbed.json").exists():
        raise FileExistsError(f"{out} already holds a testbed (testbed.json); pick another folder")
    out.mkdir(parents=True, exist_ok=True)
    # disjoint seeds per split: every split is a fresh sample of the same authors and topics
    sft, rl, attack, heldout = (make_texts(n, seed * 10 + offset) for offset, n in
                                enumerate((num_sft, num_rl, num_attack, num_heldout), start=1))
    rng = random.Random(seed)
    _write_jsonl(out / "sft.jsonl", [{"problem": r["text"], "answer": drop_tics(r["text"], rng, SFT_DROP)}
                                     for r in sft])
    _write_jsonl(out / "rl.jsonl", [{"problem": r["text"], "answer": r["text"]} for r in rl])
    _write_jsonl(out / "attack_train.jsonl", attack)
    _write_jsonl(out / "heldout.jsonl", heldout)

    corpus = [r["text"] for r in sft + rl]
    build_tiny_text_lm(out / "policy_base", seed=seed, corpus=corpus, vocab_size=300, hidden_size=policy_hidden,
                       num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=2 * policy_hidden,
                       max_position_embeddings=256)
    style_texts = [drop_tics(r["text"], rng, STYLE_TRAIN_DROP) for r in sft]
    accuracies = {}
    for name, texts, key in (("style_encoder", style_texts, "author"), ("semantic_encoder", corpus, "topic")):
        build_tiny_reward_model(out / name, seed=seed, corpus=corpus, vocab_size=300, num_labels=4)
        labels = [r[key] for r in sft] if name == "style_encoder" else [r[key] for r in sft + rl]
        train_encoder(out / name, texts, labels, steps=encoder_steps, seed=seed)
        accuracies[name] = encoder_accuracy(out / name, [r["text"] for r in heldout], [r[key] for r in heldout])
    info = {"seed": seed, "sizes": {"sft": num_sft, "rl": num_rl, "attack_train": num_attack, "heldout": num_heldout},
            "encoder_steps": encoder_steps, "tic_rate": TIC_RATE, "sft_drop": SFT_DROP,
            "style_train_drop": STYLE_TRAIN_DROP, "heldout_accuracy": accuracies}
    atomic_write_json(out / "testbed.json", info)
    return info


def encoders(testbed: str | Path) -> tuple[Any, Any]:
    """The testbed's (style, semantic) encoders as TAROT reads them (``pooling: logits``)."""
    from mmpo.rewards.tarot import TextEncoder

    testbed = Path(testbed)
    return (TextEncoder(str(testbed / "style_encoder"), pooling="logits"),
            TextEncoder(str(testbed / "semantic_encoder"), pooling="logits"))


@torch.no_grad()
def rewrite(model_dir: str | Path, texts: Sequence[str], *, num_samples: int = 1, temperature: float | None = None,
            max_new_tokens: int = 32, batch_size: int = 64, seed: int = 0) -> list[list[str]]:
    """The policy's rewrites of ``texts`` (no system turn, as in training): ``num_samples`` per text, greedy when
    ``temperature`` is None."""
    from mmpo.vlm.factory import load_vlm
    from mmpo.vlm.rollout import HFGenerateEngine

    model, processor = load_vlm(str(model_dir))
    model.eval()
    engine = HFGenerateEngine(model, processor, system_prompt="")
    out: list[list[str]] = []
    torch.manual_seed(seed)
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        rows = [{"id": str(start + i), "problem": text, "images": []} for i, text in enumerate(chunk)]
        rollout = engine.generate(rows, max_new_tokens=max_new_tokens, num_samples=num_samples,
                                  temperature=temperature or 1.0, top_p=1.0, do_sample=temperature is not None)
        texts_out = list(rollout.texts)
        out += [[t.strip() for t in texts_out[i * num_samples:(i + 1) * num_samples]] for i in range(len(chunk))]
    return out


def evaluate_rewrites(testbed: str | Path, attack_rewrites: Sequence[str], heldout_rewrites: Sequence[str], *,
                      seed: int = 0) -> dict[str, float]:
    """Privacy and utility of a policy's rewrites (module docstring), given the rewrites of
    ``attack_train.jsonl`` and ``heldout.jsonl`` in file order."""
    from mmpo.rewards.tarot import tarot_rewards

    testbed = Path(testbed)
    attack, heldout = read_jsonl(testbed / "attack_train.jsonl"), read_jsonl(testbed / "heldout.jsonl")
    if len(attack_rewrites) != len(attack) or len(heldout_rewrites) != len(heldout):
        raise ValueError(f"expected {len(attack)} and {len(heldout)} rewrites, got {len(attack_rewrites)} and "
                         f"{len(heldout_rewrites)}")
    authors = [r["author"] for r in heldout]
    topics = [r["topic"] for r in heldout]
    retrained = BagOfWords().fit(list(attack_rewrites), [r["author"] for r in attack], seed=seed)
    static = BagOfWords().fit([r["text"] for r in attack], [r["author"] for r in attack], seed=seed)
    topic = BagOfWords().fit([r["text"] for r in attack], [r["topic"] for r in attack], seed=seed)
    style, semantic = encoders(testbed)
    sources = [r["text"] for r in heldout]
    _, privacy, utility = tarot_rewards(style(sources), style(list(heldout_rewrites)), semantic(sources),
                                        semantic(list(heldout_rewrites)))
    return {
        "attacker_accuracy": retrained.accuracy(list(heldout_rewrites), authors),
        "static_attacker_accuracy": static.accuracy(list(heldout_rewrites), authors),
        "utility_accuracy": topic.accuracy(list(heldout_rewrites), topics),
        "privacy": float(privacy.mean()),
        "utility": float(utility.mean()),
        "tics_per_text": sum(count_tics(t) for t in heldout_rewrites) / len(heldout_rewrites),
        "words_per_text": sum(len(t.split()) for t in heldout_rewrites) / len(heldout_rewrites),
    }
