"""Are the synthetic tasks learnable from their small images, and do they need them?

For each visual task, a tiny classifier (one 14 x 14 patch-embedding conv, like a ViT
patch layer, plus an MLP over [patch features, question bag-of-words]) is trained on
``--train`` items and scored on ``--test`` held-out items (the test split). Three
conditions: image + question, question only (the image replaced by zeros), and the
majority answer. If a task needs the image, the question-only score stays near
majority; if it is learnable from the pixels, image + question is well above it.

Usage: python bench/data_learnability.py [--train 1500] [--test 300] [--epochs 60]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch
from torch import nn

from mmpo.data.synthetic import VISUAL_TASKS, make_items


def encode(rows, vocab, answers, image_size):
    images = np.stack([np.asarray(r["images"][0], dtype=np.float32) / 255.0 for r in rows])
    x_img = torch.from_numpy(images).permute(0, 3, 1, 2)
    x_txt = torch.zeros(len(rows), len(vocab))
    for i, r in enumerate(rows):
        for w in r["problem"].lower().rstrip("?").replace(",", "").split():
            if w in vocab:
                x_txt[i, vocab[w]] = 1.0
    y = torch.tensor([answers.get(r["answer"], -1) for r in rows])
    return x_img, x_txt, y


class PatchClassifier(nn.Module):
    def __init__(self, vocab_size: int, classes: int, image_size: int, width: int = 32, hidden: int = 256):
        super().__init__()
        self.patch = nn.Conv2d(3, width, kernel_size=14, stride=14)
        patches = (image_size // 14) ** 2
        self.mlp = nn.Sequential(nn.Linear(patches * width + vocab_size, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, image, text):
        feats = torch.relu(self.patch(image)).flatten(1)
        return self.mlp(torch.cat([feats, text], dim=1))


def train_and_score(task, n_train, n_test, epochs, image_size, seed, use_image):
    torch.manual_seed(seed)
    train = make_items(task, n_train, seed=seed, split="train", image_size=image_size)
    test = make_items(task, n_test, seed=seed, split="test", image_size=image_size)
    vocab = {w: i for i, w in enumerate(sorted({w for r in train for w in
                                                 r["problem"].lower().rstrip("?").replace(",", "").split()}))}
    answers = {a: i for i, a in enumerate(sorted({r["answer"] for r in train}))}
    xi, xt, y = encode(train, vocab, answers, image_size)
    ti, tt, ty = encode(test, vocab, answers, image_size)
    if not use_image:
        xi, ti = torch.zeros_like(xi), torch.zeros_like(ti)
    model = PatchClassifier(len(vocab), len(answers), image_size)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(len(y))
        for start in range(0, len(y), 64):
            idx = perm[start:start + 64]
            loss = nn.functional.cross_entropy(model(xi[idx], xt[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| task | image + question | question only | majority answer | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for task in VISUAL_TASKS:
        start = time.time()
        with_image, majority = train_and_score(task, args.train, args.test, args.epochs, args.image_size,
                                               args.seed, use_image=True)
        text_only, _ = train_and_score(task, args.train, args.test, args.epochs, args.image_size,
                                       args.seed, use_image=False)
        print(f"| {task} | {with_image:.3f} | {text_only:.3f} | {majority:.3f} | {time.time() - start:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
