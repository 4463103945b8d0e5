"""Are the synthetic tasks learnable from their small images, and do they need them?

For each visual task, a tiny classifier (one 14 x 14 patch-embedding conv, like a ViT
patch layer, plus an MLP over [patch features, question bag-of-words]) is trained on
``--train`` items and scored on ``--test`` held-out items (the test split). Three
conditions: image + question, question only (the image replaced by zeros), and the
majority answer. If a task needs the image, the question-only score stays near
majority; if it is learnable from the pixels, image + question is well above it.

Usage: python bench/data_learnability.py [--probe mlp|transformer] [--train 1500] [--test 300] [--epochs 60]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch
from torch import nn

from mmpo.data.synthetic import VISUAL_TASKS, make_items


def words(problem: str) -> list[str]:
    return problem.lower().rstrip("?").replace(",", "").split()


def encode(rows, vocab, answers, max_words):
    """Images (N, 3, H, W) in [0, 1], question word ids (N, max_words) with 0 = padding, labels (N,)."""
    images = np.stack([np.asarray(r["images"][0], dtype=np.float32) / 255.0 for r in rows])
    x_img = torch.from_numpy(images).permute(0, 3, 1, 2)
    x_txt = torch.zeros(len(rows), max_words, dtype=torch.long)
    for i, r in enumerate(rows):
        ids = [vocab.get(w, 0) for w in words(r["problem"])][:max_words]
        x_txt[i, : len(ids)] = torch.tensor(ids)
    y = torch.tensor([answers.get(r["answer"], -1) for r in rows])
    return x_img, x_txt, y


class PatchClassifier(nn.Module):
    """MLP over [patch features, one-hot question words by position] (word order kept:
    "is the red shape left of the blue one" needs it)."""

    def __init__(self, vocab_size: int, classes: int, image_size: int, max_words: int, width: int = 32,
                 hidden: int = 256):
        super().__init__()
        self.vocab_size = vocab_size
        self.patch = nn.Conv2d(3, width, kernel_size=14, stride=14)
        patches = (image_size // 14) ** 2
        self.mlp = nn.Sequential(nn.Linear(patches * width + max_words * vocab_size, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, image, text):
        feats = torch.relu(self.patch(image)).flatten(1)
        one_hot = nn.functional.one_hot(text, self.vocab_size).float().flatten(1)
        return self.mlp(torch.cat([feats, one_hot], dim=1))


class PatchTransformer(nn.Module):
    """A ViT-like probe closer to the VLM: patch tokens and question-word tokens (with
    positions) in one 2-layer transformer encoder, classified from a CLS token."""

    def __init__(self, vocab_size: int, classes: int, image_size: int, max_words: int, width: int = 64):
        super().__init__()
        self.patch = nn.Conv2d(3, width, kernel_size=14, stride=14)
        self.patch_pos = nn.Parameter(torch.randn((image_size // 14) ** 2, width))
        self.words = nn.Embedding(vocab_size, width, padding_idx=0)
        self.word_pos = nn.Parameter(torch.randn(max_words, width))
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        layer = nn.TransformerEncoderLayer(width, 4, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, image, text):
        patches = self.patch(image).flatten(2).transpose(1, 2) + self.patch_pos
        tokens = torch.cat([self.cls.expand(len(image), -1, -1), patches, self.words(text) + self.word_pos], dim=1)
        pad = torch.cat([torch.zeros(len(image), 1 + patches.shape[1], dtype=torch.bool), text == 0], dim=1)
        return self.head(self.encoder(tokens, src_key_padding_mask=pad)[:, 0])


def train_and_score(task, n_train, n_test, epochs, image_size, seed, use_image, probe="mlp", difficulty=None):
    torch.manual_seed(seed)
    train = make_items(task, n_train, seed=seed, split="train", image_size=image_size, difficulty=difficulty)
    test = make_items(task, n_test, seed=seed, split="test", image_size=image_size, difficulty=difficulty)
    vocab = {w: i + 1 for i, w in enumerate(sorted({w for r in train for w in words(r["problem"])}))}
    max_words = max(len(words(r["problem"])) for r in train + test)
    answers = {a: i for i, a in enumerate(sorted({r["answer"] for r in train}))}
    xi, xt, y = encode(train, vocab, answers, max_words)
    ti, tt, ty = encode(test, vocab, answers, max_words)
    if not use_image:
        xi, ti = torch.zeros_like(xi), torch.zeros_like(ti)
    probe_cls = PatchClassifier if probe == "mlp" else PatchTransformer
    model = probe_cls(len(vocab) + 1, len(answers), image_size, max_words)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3 if probe == "mlp" else 1e-3, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(len(y))
        for start in range(0, len(y), 64):
            idx = perm[start:start + 64]
            loss = nn.functional.cross_entropy(model(xi[idx], xt[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(ti, tt).argmax(1)
    majority = collections.Counter(r["answer"] for r in train).most_common(1)[0][0]
    majority_acc = float(np.mean([r["answer"] == majority for r in test]))
    return float((pred == ty).float().mean()), majority_acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=1500)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument("--tasks", nargs="+", default=list(VISUAL_TASKS))
    parser.add_argument("--difficulty", type=int, default=None, help="1..3; default: levels mixed")
    parser.add_argument("--skip-question-only", action="store_true", help="only the image + question condition")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| task | image + question | question only | majority answer | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for task in args.tasks:
        start = time.time()
        with_image, majority = train_and_score(task, args.train, args.test, args.epochs, args.image_size,
                                               args.seed, use_image=True, probe=args.probe,
                                               difficulty=args.difficulty)
        text_only = float("nan")
        if not args.skip_question_only:
            text_only, _ = train_and_score(task, args.train, args.test, args.epochs, args.image_size,
                                           args.seed, use_image=False, probe=args.probe,
                                           difficulty=args.difficulty)
        print(f"| {task} | {with_image:.3f} | {text_only:.3f} | {majority:.3f} | {time.time() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
