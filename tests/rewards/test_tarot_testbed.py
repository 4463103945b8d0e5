"""The TAROT testbed (mmpo.rewards.tarot_testbed): texts with known tics, the bag-of-words attacker on hand data,
a small built testbed's encoders and metrics, and the SFT style its policy learns."""

from __future__ import annotations

import json
import random

import pytest
import torch

from mmpo.data import render_solution, system_prompt_for
from mmpo.rewards.tarot_testbed import (
    AUTHORS,
    TIC_WORDS,
    TOPICS,
    BagOfWords,
    build_testbed,
    count_tics,
    drop_tics,
    encoders,
    evaluate_rewrites,
    make_texts,
    read_jsonl,
    write_text,
)


def test_texts_carry_their_authors_tics_and_topics_words():
    rng = random.Random(0)
    text = write_text("ben", "food", rng, tic_rate=1.0).split()
    nouns, verbs = TOPICS["food"]
    # so the N V the N truly the N V the N okay
    assert [text[0], text[6], text[-1]] == list(AUTHORS["ben"])
    assert len(text) == 13 and text[1] == text[4] == text[7] == text[10] == "the"
    assert {text[2], text[5], text[8], text[11]} <= set(nouns) and {text[3], text[9]} <= set(verbs)
    assert count_tics(" ".join(text)) == 3
    plain = write_text("ben", "food", rng, tic_rate=0.0)
    assert count_tics(plain) == 0 and len(plain.split()) == 10
    rows = make_texts(400, seed=3)
    assert rows == make_texts(400, seed=3) and rows != make_texts(400, seed=4)
    assert {r["author"] for r in rows} == set(AUTHORS) and {r["topic"] for r in rows} == set(TOPICS)


def test_drop_tics_hand_values():
    text = "well the team wins the goal indeed the ball kicks the coach cheers"
    assert drop_tics(text, random.Random(0), 1.0) == "the team wins the goal the ball kicks the coach"
    assert drop_tics(text, random.Random(0), 0.0) == text
    assert count_tics(text) == 3 and TIC_WORDS == {w for tics in AUTHORS.values() for w in tics}


def test_bag_of_words_attacker_learns_a_hand_dataset():
    texts = ["well the rain", "well the sun", "so the rain", "so the sun", "well the storm", "so the storm"]
    labels = ["ada", "ada", "ben", "ben", "ada", "ben"]
    model = BagOfWords().fit(texts, labels)
    assert model.labels == ["ada", "ben"]
    assert model.predict(["well the cloud", "so the cloud", "the rain well"]) == ["ada", "ben", "ada"]
    assert model.accuracy(["well the rain", "so the rain"], ["ada", "ben"]) == 1.0
    assert model.accuracy(["well x", "so y", "well z"], ["ben", "ben", "ada"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="got 2 texts and 1 labels"):
        BagOfWords().fit(["a", "b"], ["x"])


def test_answer_style_renders_the_answer_without_a_system_turn():
    assert render_solution({"answer": " the team wins ", "steps": ["ignored"]}, style="answer") == "the team wins"
    assert system_prompt_for("answer") == ""
    with pytest.raises(ValueError, match="'think-answer', 'steps', 'answer'"):
        system_prompt_for("plain")


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tarot") / "testbed"
    build_testbed(out, seed=0, num_sft=200, num_rl=40, num_attack=120, num_heldout=60, encoder_steps=60,
                  policy_hidden=32)
    return out


def test_build_testbed_writes_its_layout_and_refuses_to_overwrite(testbed):
    info = json.loads((testbed / "testbed.json").read_text())
    assert info["sizes"] == {"sft": 200, "rl": 40, "attack_train": 120, "heldout": 60}
    assert set(info["heldout_accuracy"]) == {"style_encoder", "semantic_encoder"}
    sft = read_jsonl(testbed / "sft.jsonl")
    assert len(sft) == 200 and all(set(r) == {"problem", "answer"} for r in sft)
    # the SFT target is its text with some tics dropped, the content kept in order
    for row in sft:
        assert [w for w in row["problem"].split() if w not in TIC_WORDS] == \
            [w for w in row["answer"].split() if w not in TIC_WORDS]
    assert sum(count_tics(r["answer"]) for r in sft) < sum(count_tics(r["problem"]) for r in sft)
    assert json.loads((testbed / "style_encoder" / "labels.json").read_text()) == sorted(AUTHORS)
    assert (testbed / "policy_base" / "config.json").is_file()
    with pytest.raises(FileExistsError, match="already holds a testbed"):
        build_testbed(testbed)


def test_metrics_of_known_rewrites(testbed):
    attack = [r["text"] for r in read_jsonl(testbed / "attack_train.jsonl")]
    heldout = read_jsonl(testbed / "heldout.jsonl")
    texts = [r["text"] for r in heldout]
    copied = evaluate_rewrites(testbed, attack, texts)
    # copying: the retrained and the static attacker are the same classifier; TAROT's privacy is 0, its utility 1
    assert copied["attacker_accuracy"] == copied["static_attacker_accuracy"]
    assert copied["privacy"] == pytest.approx(0.0, abs=1e-12) and copied["utility"] == pytest.approx(1.0, abs=1e-12)
    assert copied["tics_per_text"] == sum(count_tics(t) for t in texts) / len(texts)
    assert copied["words_per_text"] == sum(len(t.split()) for t in texts) / len(texts)
    stripped = evaluate_rewrites(testbed, [drop_tics(t, random.Random(0), 1.0) for t in attack],
                                 [drop_tics(t, random.Random(0), 1.0) for t in texts])
    assert stripped["tics_per_text"] == 0.0 and stripped["words_per_text"] == 10.0
    assert stripped["privacy"] > copied["privacy"]
    with pytest.raises(ValueError, match="expected 120 and 60 rewrites, got 1 and 60"):
        evaluate_rewrites(testbed, attack[:1], texts)


def test_an_empty_rewrite_embeds_as_zero(testbed):
    style, _ = encoders(testbed)
    text = read_jsonl(testbed / "heldout.jsonl")[0]["text"]
    both = style(["", text])
    assert both.shape == (2, 4) and torch.equal(both[0], torch.zeros(4))
    assert torch.allclose(both[1], style([text])[0], atol=1e-6)
    assert torch.equal(style(["", ""]), torch.zeros(2, 4))
