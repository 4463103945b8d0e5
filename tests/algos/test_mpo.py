"""MPO (mmpo.algos.mpo): rubric text, the update trigger, one meta update, the testbed's judges, the
checkpointed rubric; parity with the official rubric merge (minnesotanlp/mpo)."""

from __future__ import annotations

import random
import re

import pytest

from mmpo.algos.mpo import (
    DEFAULT_ANALYZE_PROMPT,
    RubricState,
    format_rubric,
    is_update_batch,
    merge_items,
    meta_update,
    rubric_items,
)
from mmpo.algos.mpo_testbed import (
    ANSWER_CHECK,
    HACKING_RUBRIC,
    JUDGE_RUBRIC,
    DroppingRuleMetaJudge,
    RuleJudge,
    RuleMetaJudge,
    check,
    kind,
    oracle,
)
from mmpo.rewards.models import JudgeReward, ModelRewardSpec, judge_prompt, parse_score
from mmpo.training.state_hooks import CheckpointedState

GAMEABLE = format_rubric(['mentions "answer"', "at least 4 words"])


def official_merge(merged_criteria: str) -> str:
    """minnesotanlp/mpo, trl/extras/mpo/__init__.py, MetaRewardModel.meta_evaluate_and_update ("Keep only
    unique criteria"), transcribed."""
    regex = r"<item>(.*?)<\/item>"
    matches = re.findall(regex, merged_criteria, re.MULTILINE | re.DOTALL)
    rubric_items = {m.strip() for m in matches}
    rubric_items = [f"<item>\n{item}\n</item>" for item in rubric_items]
    merged_criteria = "<rubric>\n" + "\n\n".join(rubric_items) + "</rubric>"
    return merged_criteria


def official_is_update(update: int, num_mpo_interval: int) -> bool:
    """minnesotanlp/mpo, trl/trainer/mpo_trainer.py, train(): `if update > 0 and update % args.num_mpo_interval == 0`."""
    return update > 0 and update % num_mpo_interval == 0


def test_rubric_text_hand_values():
    assert format_rubric(["a", "b c"]) == "<rubric>\n<item>\na\n</item>\n\n<item>\nb c\n</item></rubric>"
    assert rubric_items(format_rubric(["a", "b c"])) == ["a", "b c"]
    assert rubric_items("<item> x </item><item></item>junk<item>y\nz</item>") == ["x", "y\nz"]
    assert merge_items([["a", "b"], ["b ", "c"], ["a"]]) == ["a", "b", "c"]


def test_merge_matches_the_official_on_fixed_replies():
    reply = "Merged:\n<item>one</item>\n<item> two </item>\n<item>one</item>"
    ours = format_rubric(merge_items([rubric_items(reply)]))
    theirs = official_merge(reply)
    assert sorted(rubric_items(ours)) == sorted(rubric_items(theirs)) == ["one", "two"]
    single = "<item>\nonly one\n</item>"
    assert format_rubric(merge_items([rubric_items(single)])) == official_merge(single)  # one item: same text


@pytest.mark.parametrize("interval", [1, 3, 10])
def test_update_trigger_matches_the_official(interval):
    assert [is_update_batch(b, interval) for b in range(0, 25)] == \
        [official_is_update(b, interval) for b in range(0, 25)]
    assert [b for b in range(1, 25) if is_update_batch(b, 10)] == [10, 20]


def test_testbed_checks_hand_values():
    assert check('mentions "answer"', "The ANSWER is 4", "3") == 1
    assert check('mentions "answer"', "four", "3") == 0
    assert check("at least 4 words", "one two three four", "3") == 1
    assert check("at least 4 words", "one two three", "3") == 0
    assert check(ANSWER_CHECK, "<answer>3</answer>", "3") == 1
    assert check(ANSWER_CHECK, "<answer>4</answer>", "3") == 0
    assert check("be nice", "anything", "3") == 0
    assert oracle("<answer>3</answer>", "3") == 1.0 and oracle("the answer is long", "3") == 0.0


def _judge() -> JudgeReward:
    spec = ModelRewardSpec(kind="judge", backend="mmpo.algos.mpo_testbed:RuleJudge", rubric=JUDGE_RUBRIC,
                           score_pattern=r"<score>(\d+)</score>", score_reduce="sum", min_score=0, max_score=1,
                           normalize=False)
    return JudgeReward("judge", spec)


def test_rubric_conditioned_judge_sums_item_scores():
    judge = _judge()
    rows = [{"problem": "What is 1+2?", "answer": "3", "rubric": GAMEABLE}] * 3
    texts = ["the answer is surely five", "<answer>3</answer>", "answer"]
    # items: mentions "answer", at least 4 words -> 1+1, 1+0 ("<answer>3</answer>" contains "answer"), 1+0
    assert judge(texts, rows) == [2.0, 1.0, 1.0]
    fixed = [{**row, "rubric": format_rubric([ANSWER_CHECK])} for row in rows]
    assert judge(texts, fixed) == [0.0, 1.0, 0.0]
    assert parse_score("<score>1</score><score>0</score><score>1</score>", judge.spec) == 2.0
    assert parse_score("<score>1</score><score>2</score>", judge.spec) is None  # an item out of [0, 1]


def test_one_meta_update_closes_the_gamed_rubric():
    samples = [{"prompt": "What is 1+2?", "answer": "3", "completion": "the answer is surely five", "score": 2.0},
               {"prompt": "What is 1+2?", "answer": "3", "completion": "<answer>3</answer>", "score": 1.0}]
    prompt = DEFAULT_ANALYZE_PROMPT.replace("Response:", "Reference: <reference>{answer}</reference>\nResponse:")
    new, logs = meta_update(GAMEABLE, samples, RuleMetaJudge(), num_samples=20, rng=random.Random(0),
                            analyze_prompt=prompt)
    assert new == format_rubric(['mentions "answer"', "at least 4 words", ANSWER_CHECK])
    gamed = next(log for log in logs if log["score"] == 2.0)
    assert gamed["proposed_items"][-1] == ANSWER_CHECK
    honest = next(log for log in logs if log["score"] == 1.0)
    assert honest["proposed_items"] == ['mentions "answer"', "at least 4 words"]
    # only honest samples: the rubric keeps its items
    same, _ = meta_update(GAMEABLE, samples[1:], RuleMetaJudge(), num_samples=20, rng=random.Random(0),
                          analyze_prompt=prompt)
    assert same == GAMEABLE


def test_meta_update_draws_num_samples_and_survives_a_failing_meta_judge():
    class Recording(RuleMetaJudge):
        def __init__(self):
            super().__init__()
            self.requests = []

        def generate(self, texts, images):
            self.requests.append(list(texts))
            return super().generate(texts, images)

    samples = [{"prompt": f"q{i}", "answer": "3", "completion": f"c{i}", "score": 0.0} for i in range(10)]
    meta = Recording()
    meta_update(GAMEABLE, samples, meta, num_samples=4, rng=random.Random(7))
    drawn = random.Random(7).sample(range(10), 4)  # the official draw: random.sample(range(n), num_samples)
    assert [re.search(r"<response>(.*?)</response>", t).group(1) for t in meta.requests[0]] == \
        [f"c{i}" for i in drawn]
    assert len(meta.requests) == 2  # analyse (one batch) + merge

    class Down:
        def generate(self, texts, images):
            return [RuntimeError("connection refused")] * len(texts)

    new, logs = meta_update(GAMEABLE, samples, Down(), num_samples=3, rng=random.Random(0))
    assert new is None and len(logs) == 3 and logs[0]["meta_reply"].startswith("<failed")
    assert meta_update(GAMEABLE, [], Down(), num_samples=3, rng=random.Random(0)) == (None, [])


class _Base:
    def on_save_checkpoint(self, checkpoint):
        pass

    def on_load_checkpoint(self, checkpoint):
        pass


class _Holder(CheckpointedState, _Base):
    checkpointed_state = (("mpo_rubric", "rubric_state"),)

    def __init__(self, rubric):
        self.rubric_state = RubricState(rubric)


def test_rubric_state_is_checkpointed_and_resumed():
    run = _Holder(GAMEABLE)
    run.rubric_state.rubric = format_rubric([ANSWER_CHECK])
    run.rubric_state.iteration, run.rubric_state.batches, run.rubric_state.failed_updates = 2, 23, 1
    run.rubric_state.samples = [{"prompt": "q", "completion": "c", "score": None, "answer": "3"}]
    checkpoint: dict = {}
    run.on_save_checkpoint(checkpoint)
    resumed = _Holder(GAMEABLE)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.rubric_state.state_dict() == run.rubric_state.state_dict()
    assert resumed.rubric_state.rubric == format_rubric([ANSWER_CHECK]) and resumed.rubric_state.batches == 23
    fresh = _Holder(GAMEABLE)
    fresh.on_load_checkpoint({})  # a checkpoint from before MPO: the initial rubric stays
    assert fresh.rubric_state.rubric == GAMEABLE and fresh.rubric_state.iteration == 0


def test_judge_prompt_of_the_testbed_names_its_tags():
    text = judge_prompt(JUDGE_RUBRIC, "q", "resp", {"answer": "3", "rubric": GAMEABLE})
    assert "<reference>3</reference>" in text and "<response>resp</response>" in text and GAMEABLE in text


# ------------------------------------------------- the hacking testbed (configs/vlm/mpo_hacking_tiny.yaml)

HACKING = format_rubric(rubric_items(HACKING_RUBRIC))
LONG_WRONG = " ".join(["word"] * 21)  # 21 words, no answer: passes the 16, 18 and 20 word items
SFT_LIKE = ("<think>The blue shape is large. The red shape is small. So the blue shape is bigger.</think>"
            "<answer>blue</answer>")


def test_hacking_rubric_scores_hand_values():
    assert rubric_items(HACKING_RUBRIC) == [f"at least {n} words" for n in (16, 18, 20, 22, 24)]
    judge = _judge()
    rows = [{"problem": "Which shape is bigger?", "answer": "blue", "rubric": HACKING}] * 3
    # SFT_LIKE has 16 whitespace words (passes only "at least 16"); 24 words pass all five; LONG_WRONG three
    long_right = " ".join(["word"] * 23) + " <answer>blue</answer>"
    assert len(SFT_LIKE.split()) == 16 and len(long_right.split()) == 24
    assert judge([SFT_LIKE, long_right, LONG_WRONG], rows) == [1.0, 5.0, 3.0]
    assert [oracle(t, "blue") for t in (SFT_LIKE, long_right, LONG_WRONG)] == [1.0, 1.0, 0.0]


def test_dropping_meta_judge_drops_the_gamed_items_hand_values():
    meta = DroppingRuleMetaJudge()
    items = rubric_items(HACKING)
    # LONG_WRONG passed 16, 18, 20 with a wrong answer: every length item goes (one kind), the answer check comes in
    assert meta.refine(items, LONG_WRONG, "blue") == [ANSWER_CHECK]
    mixed = ['mentions "blue"', 'mentions "answer"', "at least 30 words"]
    assert [kind(i) for i in mixed] == ['mentions blue', 'mentions answer', "words"] and kind(ANSWER_CHECK) == "answer"
    # "the word word ... red" mentions neither word and has 21 < 30 words: passes nothing it could game
    assert meta.refine(mixed, LONG_WRONG, "blue") == [*mixed, ANSWER_CHECK]
    # "the blue one, 31 words" passes mentions "blue" and the length item with no answer: both kinds go
    assert meta.refine(mixed, "blue " * 31, "red") == ['mentions "answer"', ANSWER_CHECK]
    assert RuleMetaJudge().refine(items, LONG_WRONG, "blue") == [*items, ANSWER_CHECK]
    # merge: the refined sets win over the honest ones (which repeat the rubric)
    refined = ["at least 22 words", ANSWER_CHECK]
    assert meta.merge([items, refined, [ANSWER_CHECK]]) == refined
    assert meta.merge([items, [ANSWER_CHECK], items]) == [ANSWER_CHECK]
    assert meta.merge([items, items]) == items
    assert RuleMetaJudge().merge([items[:2], [items[1], ANSWER_CHECK]]) == [items[0], items[1], ANSWER_CHECK]


def test_dropping_meta_update_on_fixed_samples():
    samples = [{"prompt": "Which shape is bigger?", "answer": "blue", "completion": LONG_WRONG, "score": 3.0},
               {"prompt": "Which shape is bigger?", "answer": "blue", "completion": SFT_LIKE, "score": 1.0},
               {"prompt": "Which shape is bigger?", "answer": "blue", "completion": "<answer>red</answer>",
                "score": 0.0},
               {"prompt": "Which shape is bigger?", "answer": "blue",
                "completion": " ".join(["word"] * 25), "score": 5.0}]
    prompt = DEFAULT_ANALYZE_PROMPT.replace("Response:", "Reference: <reference>{answer}</reference>\nResponse:")
    new, logs = meta_update(HACKING, samples, DroppingRuleMetaJudge(), num_samples=20, rng=random.Random(0),
                            analyze_prompt=prompt)
    # the 25-word sample and LONG_WRONG passed length items with a wrong answer: each proposes the answer check
    # alone; the merge keeps the refined sets
    assert new == format_rubric([ANSWER_CHECK])
    by_score = {log["score"]: log["proposed_items"] for log in logs}
    assert by_score[5.0] == [ANSWER_CHECK] and by_score[1.0] == by_score[0.0] == rubric_items(HACKING)
    # the plain rule meta judge only adds the answer check
    plain, _ = meta_update(HACKING, samples, RuleMetaJudge(), num_samples=20, rng=random.Random(0),
                           analyze_prompt=prompt)
    assert plain == format_rubric([*rubric_items(HACKING), ANSWER_CHECK])
    # nothing gamed: the rubric stays
    same, _ = meta_update(HACKING, samples[1:3], DroppingRuleMetaJudge(), num_samples=20, rng=random.Random(0),
                          analyze_prompt=prompt)
    assert same == HACKING
