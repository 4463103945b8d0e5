"""TAROT (mmpo.rewards.tarot): hand values of the reward, the DPO pair builder with the official thresholds,
parity with hornetsecurity/tarot on fixed vectors, encoders from checkpoints and the `kind: tarot` reward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmpo.rewards import compute_rewards
from mmpo.rewards.models import MODEL_REWARDS
from mmpo.rewards.tarot import TextEncoder, cosine, dpo_pairs, tarot_rewards
from mmpo.rewards.user import validate_reward_weights


def st_cos_sim(a, b):
    """sentence_transformers.util.cos_sim (the function the official code imports), transcribed."""
    a, b = torch.as_tensor(np.asarray(a, dtype=np.float64)), torch.as_tensor(np.asarray(b, dtype=np.float64))
    if a.dim() == 1:
        a = a.unsqueeze(0)
    if b.dim() == 1:
        b = b.unsqueeze(0)
    a_norm = torch.nn.functional.normalize(a, p=2, dim=1)
    b_norm = torch.nn.functional.normalize(b, p=2, dim=1)
    return torch.mm(a_norm, b_norm.transpose(0, 1))


def official_rewards(q_priv, r_priv, q_util, r_util):
    """hornetsecurity/tarot, tarot/train_ppo.py, rewards_function (loop body) and the PPO sum, transcribed:
    author_rewards.append(1 - cos_sim(q_priv, r_priv)); utility_rewards.append(cos_sim(q_util, r_util));
    reward = torch.tensor(utility_rewards[i] + author_rewards[i])[0][0]."""
    author = 1 - st_cos_sim(q_priv, r_priv)
    utility = st_cos_sim(q_util, r_util)
    return float(torch.tensor(utility + author)[0][0]), float(author[0][0]), float(utility[0][0])


def official_pairs(input_texts, right, left, queries_repr_privacy, right_repr_privacy, left_repr_privacy,
                   gte_emb_prompt, gte_emb_right, gte_emb_left):
    """hornetsecurity/tarot, tarot/create_dpo_dataset.py, the selection loop, transcribed."""
    prompt, chosen, reject = [], [], []
    for i in range(len(input_texts)):
        q_priv, r_priv, l_priv = queries_repr_privacy[i], right_repr_privacy[i], left_repr_privacy[i]
        q_util, r_util, l_util = gte_emb_prompt[i], gte_emb_right[i], gte_emb_left[i]
        reward_right_priv = 1 - st_cos_sim(q_priv, r_priv)
        reward_left_priv = 1 - st_cos_sim(q_priv, l_priv)
        reward_right_util = st_cos_sim(q_util, r_util)
        reward_left_util = st_cos_sim(q_util, l_util)
        if (np.abs(reward_right_priv - reward_left_priv) > 0.10
                and np.abs(reward_right_util - reward_left_util) < 0.05):
            if reward_right_priv > reward_left_priv:
                prompt.append(input_texts[i]); chosen.append(right[i]); reject.append(left[i])  # noqa: E702
            elif reward_right_priv < reward_left_priv:
                prompt.append(input_texts[i]); chosen.append(left[i]); reject.append(right[i])  # noqa: E702
            else:
                continue
        else:
            continue
    return prompt, chosen, reject


def test_reward_hand_values():
    style_x, style_y = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    sem_x, sem_y = torch.tensor([[1.0, 1.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [4.0, 3.0]])
    total, privacy, utility = tarot_rewards(style_x, style_y, sem_x, sem_y)
    assert privacy.tolist() == pytest.approx([1.0, 0.0])  # orthogonal styles; the same direction
    assert utility.tolist() == pytest.approx([1 / math.sqrt(2), 24 / 25])
    assert total.tolist() == pytest.approx([1 + 1 / math.sqrt(2), 24 / 25])
    assert cosine(torch.zeros(1, 2), torch.ones(1, 2)).tolist() == [0.0]


def test_reward_parity_with_the_official_on_fixed_vectors():
    gen = torch.Generator().manual_seed(0)
    q_p, r_p, q_u, r_u = (torch.randn(6, 5, generator=gen) for _ in range(4))
    total, privacy, utility = tarot_rewards(q_p, r_p, q_u, r_u)
    for i in range(6):
        ref_total, ref_privacy, ref_utility = official_rewards(q_p[i].numpy(), r_p[i].numpy(), q_u[i].numpy(),
                                                               r_u[i].numpy())
        assert float(total[i]) == pytest.approx(ref_total, abs=1e-9)
        assert float(privacy[i]) == pytest.approx(ref_privacy, abs=1e-9)
        assert float(utility[i]) == pytest.approx(ref_utility, abs=1e-9)


def _table_encoder(table):
    return lambda texts: torch.tensor([table[t] for t in texts], dtype=torch.float64)


def test_dpo_pairs_hand_values_with_the_official_thresholds():
    style = _table_encoder({"x": [1, 0], "a": [0, 1], "b": [1, 0], "c": [1, 0.1], "y": [1, 0], "d": [0, 1], "e": [1, 1]})
    semantic = _table_encoder({"x": [1, 0], "a": [1, 0], "b": [1, 0], "c": [1, 0],
                               "y": [1, 0], "d": [1, 0], "e": [0, 1]})
    # x: a has privacy 1, b privacy 0 -> kept, a chosen; x with (b, c): privacy gap 1 - cos([1,0],[1,.1]) < 0.10
    # -> dropped; y: (d, e) privacy 1 vs 1 - 1/sqrt 2 but utility 1 vs 0 -> dropped (utility gap >= 0.05)
    pairs = dpo_pairs(["x", "x", "y"], ["b", "b", "d"], ["a", "c", "e"], style=style, semantic=semantic)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [("x", "a", "b")]
    assert pairs[0]["privacy_chosen"] == pytest.approx(1.0) and pairs[0]["privacy_rejected"] == pytest.approx(0.0)
    assert pairs[0]["utility_chosen"] == pytest.approx(1.0) == pairs[0]["utility_rejected"]


def test_dpo_pairs_parity_with_the_official_on_fixed_vectors():
    gen = torch.Generator().manual_seed(3)
    n = 40
    texts = [f"t{i}" for i in range(n)]
    right, left = [f"r{i}" for i in range(n)], [f"l{i}" for i in range(n)]
    style_vectors = {t: torch.randn(4, generator=gen) for t in texts + right + left}
    # semantic rewrites close to their source, so the utility gate passes for some and fails for others
    semantic_vectors = {t: torch.randn(8, generator=gen) for t in texts}
    for i in range(n):
        semantic_vectors[right[i]] = semantic_vectors[texts[i]] + 0.3 * torch.randn(8, generator=gen)
        semantic_vectors[left[i]] = semantic_vectors[texts[i]] + 0.3 * torch.randn(8, generator=gen)
    style = lambda ts: torch.stack([style_vectors[t] for t in ts])  # noqa: E731
    semantic = lambda ts: torch.stack([semantic_vectors[t] for t in ts])  # noqa: E731
    ours = dpo_pairs(texts, right, left, style=style, semantic=semantic)
    theirs = official_pairs(texts, right, left, style(texts).numpy(), style(right).numpy(), style(left).numpy(),
                            semantic(texts).numpy(), semantic(right).numpy(), semantic(left).numpy())
    assert 0 < len(ours) < n  # both gates bite on these inputs
    assert ([p["prompt"] for p in ours], [p["chosen"] for p in ours], [p["rejected"] for p in ours]) == theirs


@pytest.fixture(scope="module")
def encoder_path(tmp_path_factory):
    from mmpo.vlm.factory import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("enc"), corpus=["an author writes like this"] * 4,
                                       num_labels=3))


def test_text_encoders_from_a_checkpoint(encoder_path):
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(encoder_path)
    texts = ["an author", "writes like this, at length"]
    logits = TextEncoder(encoder_path, pooling="logits", batch_size=1)(texts)
    mean = TextEncoder(encoder_path, pooling="mean")(texts)
    classifier = AutoModelForSequenceClassification.from_pretrained(encoder_path).eval()
    base = AutoModel.from_pretrained(encoder_path).eval()
    with torch.no_grad():
        for i, text in enumerate(texts):  # unpadded, one at a time
            ids = tokenizer(text, return_tensors="pt")
            assert logits[i].tolist() == pytest.approx(classifier(**ids).logits[0].tolist(), abs=1e-5)
            assert mean[i].tolist() == pytest.approx(base(**ids).last_hidden_state[0].mean(0).tolist(), abs=1e-5)
    assert logits.shape == (2, 3)


def test_tarot_model_reward_in_compute_rewards(encoder_path):
    MODEL_REWARDS.clear()
    try:
        models = {"tarot": {"kind": "tarot", "source_column": "text",
                            "style_encoder": {"path": encoder_path, "pooling": "logits"},
                            "semantic_encoder": {"path": encoder_path, "pooling": "mean"}}}
        validate_reward_weights({"tarot": 1.0}, models=models)
        rows = [{"problem": "Rewrite it.", "text": "an author writes like this"}] * 2
        texts = ["an author writes like this", "writes"]
        total, per_fn, metrics = compute_rewards({"tarot": 1.0}, texts, rows, timeout_s=30.0)
        style = TextEncoder(encoder_path, pooling="logits")
        semantic = TextEncoder(encoder_path, pooling="mean")
        expected, privacy, utility = tarot_rewards(style([rows[0]["text"]] * 2), style(texts),
                                                   semantic([rows[0]["text"]] * 2), semantic(texts))
        assert total.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
        assert total[0] == pytest.approx(1.0, abs=1e-5)  # y = x: privacy 0, utility 1
        assert metrics["rewards/tarot/privacy"] == pytest.approx(float(privacy.mean()), abs=1e-5)
        assert metrics["rewards/tarot/utility"] == pytest.approx(float(utility.mean()), abs=1e-5)
    finally:
        MODEL_REWARDS.clear()


def test_dpo_pairs_file_loads_as_preference_data(tmp_path):
    from mmpo.data.loaders import ColumnKeys
    from mmpo.data.preference import load_preference_rows
    from mmpo.rewards.tarot import write_dpo_pairs

    style = _table_encoder({"x": [1, 0], "a": [0, 1], "b": [1, 0]})
    semantic = _table_encoder({"x": [1, 0], "a": [1, 0], "b": [1, 0]})
    pairs = dpo_pairs(["x"], ["b"], ["a"], style=style, semantic=semantic)
    path = write_dpo_pairs(str(tmp_path / "pairs.jsonl"), pairs)
    with pytest.raises(FileExistsError):
        write_dpo_pairs(path, pairs)
    rows, stats = load_preference_rows(path, keys=ColumnKeys(prompt_key="prompt"))
    assert stats["loaded"] == 1 and rows[0]["problem"] == "x"
    assert rows[0]["chosen"] == "a" and rows[0]["rejected"] == "b"
