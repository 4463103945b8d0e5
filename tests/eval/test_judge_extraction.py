"""Judge-scored evals (mmpo.eval.judge_extraction): MathVista's and MathVerse's official extraction prompts,
MathVista's pre-judge shortcuts, per-item records with both extractions, and rule/judge agreement on fixtures,
with a judge served over HTTP on the loopback address."""

from __future__ import annotations

import pytest
from loopback_judge import LoopbackJudge

from mmpo.eval.benchmarks import mathverse, mathvista
from mmpo.eval.judge_extraction import (
    MATHVERSE_DEMO_PROMPT,
    MATHVERSE_SCORE_PROMPT,
    MATHVISTA_DEMO_PROMPT,
    JudgeEval,
    judge_extract,
    judge_spec,
    mathverse_prompt,
    mathverse_score_prompt,
    mathvista_prompt,
    mathvista_shortcut,
    parse_judgement,
    protocol_for,
    summary,
)
from mmpo.rewards.models import ModelRewardSpec, make_judge_backend


def official_mathvista_prompt(demo_prompt, query, response):
    """lupantech/MathVista, evaluation/extract_answer.py, create_test_prompt, transcribed."""
    demo_prompt = demo_prompt.strip()
    test_prompt = f"{query}\n\n{response}"
    full_prompt = f"{demo_prompt}\n\n{test_prompt}\n\nExtracted answer: "
    return full_prompt


def official_mathverse_prompt(demo_prompt, response, inst):
    """ZrrSkywalker/MathVerse, evaluation/extract_answer_s1.py, create_test_prompt, transcribed."""
    demo_prompt = demo_prompt.strip()
    test_prompt = f"Model response: '{response}'\nExtracted Answer: "
    full_prompt = f"{demo_prompt}\n\n{test_prompt}"
    return full_prompt


# ZrrSkywalker/MathVerse, evaluation/prompts.py, demo_prompt_score, transcribed as the source file writes it
official_demo_prompt_score = """
Below are two answers to a math question. Question is [Question], [Standard Answer] is the standard answer to the question, and [Model_answer] is the answer extracted from a model's output to this question.  Determine whether these two answers are consistent.
Please note that only when the [Model_answer] completely matches the [Standard Answer] means they are consistent. For non-multiple-choice questions, if the meaning is expressed in the same way, it is also considered consistent, for example, 0.5m and 50cm.
If they are consistent, Judement is 1; if they are different, Judement is 0.

[Question]: Write the set of numbers represented on the number line in interval notation.
[Standard Answer]: (-2,1]
[Model_answer] : Extracted Answer: \\((-2, 1)\\)
Judgement: 0

[Question]: Find the domain and range of the function f using interval notation.
[Standard Answer]: domain: [-4, 0) and range: (-3, 1]
[Model_answer] : Range: \\((-4, 1]\\)
Judgement: 0


[Question]: Two curves are symmetrical about the x-axis. Use the vertical line test to determine if this relation is a function.\nChoices:\nA:This is a function\nB:This is not a function
[Standard Answer]: B
[Model_answer] : This is not a function
Judgement: 1

[Question]: Given the graph of the ellipse that intersects with x-axis at 9 and -9 and with y-axis at 3 and -3, determine its equation.A. \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1 B. Can not determine.\n
[Standard Answer]: A
[Model_answer] : \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1
Judgement: 1

[Question]: {question}
[Standard Answer]: {gt}
[Model_answer] : {extraction}
Judgement: """


def official_mathverse_score_prompt(demo_prompt, inst):
    """ZrrSkywalker/MathVerse, evaluation/score_answer_s2.py, create_test_prompt, transcribed."""
    demo_prompt = demo_prompt.strip()
    full_prompt = demo_prompt.format(question = inst['question'], gt=inst['answer'], extraction=inst['extraction'])
    return full_prompt


def official_match_answer_reading(extraction):
    """ZrrSkywalker/MathVerse, evaluation/score_answer_s2.py, match_answer's return and the caller's check."""
    judgement = extraction.replace("Judgement:", "").strip()
    return int(judgement) if judgement.strip() in ['0', '1'] else None


def test_mathverse_second_stage_prompt_matches_the_official_builder():
    inst = {"question": "Find x.\nChoices:\nA:1\nB:2", "answer": "B", "extraction": "x = 2"}
    assert MATHVERSE_SCORE_PROMPT == official_demo_prompt_score
    assert mathverse_score_prompt(inst["question"], inst["answer"], inst["extraction"]) == \
        official_mathverse_score_prompt(official_demo_prompt_score, inst)
    prompt = mathverse_score_prompt("Q?", "5", "{x}")  # braces in the extraction are kept, not formatted
    # strip() drops the template's trailing space, as the official builder does
    assert prompt.endswith("[Question]: Q?\n[Standard Answer]: 5\n[Model_answer] : {x}\nJudgement:")
    assert prompt.count("Judgement:") == 5 and "\\frac{x^2}{81}" in prompt  # 4 examples; {{ }} became { }
    for reply, expected in [("1", 1), (" Judgement: 0\n", 0), ("Judgement:1", 1), ("yes", None), ("1.", None),
                            ("", None), ("10", None)]:
        assert parse_judgement(reply) == official_match_answer_reading(reply) == expected, reply


def test_prompts_match_the_official_builders():
    assert mathvista_prompt("Question: q?", "It is 14.") == \
        official_mathvista_prompt(MATHVISTA_DEMO_PROMPT, "Question: q?", "It is 14.")
    assert mathverse_prompt("so x = 3") == official_mathverse_prompt(MATHVERSE_DEMO_PROMPT, "so x = 3", None)
    assert MATHVISTA_DEMO_PROMPT.count("Extracted answer:") == 5  # the five in-context examples
    assert MATHVERSE_DEMO_PROMPT.count("Model response:") == 6


def test_mathvista_shortcuts_hand_values():
    mc = {"question_type": "multi_choice", "answer_type": "text", "choices": ["3/11", "8/11"]}
    assert mathvista_shortcut("", mc) == ""
    assert mathvista_shortcut("8/11", mc) == "8/11"
    assert mathvista_shortcut("It is 8/11", mc) is None
    assert mathvista_shortcut("14", {"question_type": "free_form", "answer_type": "integer"}) == "14"
    assert mathvista_shortcut("0.60", {"question_type": "free_form", "answer_type": "float"}) == "0.6"
    assert mathvista_shortcut("about 14", {"question_type": "free_form", "answer_type": "integer"}) is None


MATHVISTA_RECORDS = [
    {"pid": "1", "question": "Which number is missing?", "image": "images/1.jpg", "decoded_image": None,
     "choices": None, "unit": None, "precision": None, "answer": "14", "question_type": "free_form",
     "answer_type": "integer", "query": "Hint: integer.\nQuestion: Which number is missing?", "metadata": {}},
    {"pid": "2", "question": "What fraction is blue?", "image": "images/2.jpg", "decoded_image": None,
     "choices": ["3/11", "8/11", "6/11"], "unit": None, "precision": None, "answer": "8/11",
     "question_type": "multi_choice", "answer_type": "text",
     "query": "Hint: letter.\nQuestion: What fraction is blue?\nChoices:\n(A) 3/11\n(B) 8/11\n(C) 6/11",
     "metadata": {}},
    {"pid": "3", "question": "Fraction facing the camera?", "image": "images/3.jpg", "decoded_image": None,
     "choices": None, "unit": None, "precision": 1.0, "answer": "0.6", "question_type": "free_form",
     "answer_type": "float", "query": "Hint: float.\nQuestion: Fraction facing the camera?", "metadata": {}},
    {"pid": "4", "question": "How many?", "image": "images/4.jpg", "decoded_image": None,
     "choices": None, "unit": None, "precision": None, "answer": "7", "question_type": "free_form",
     "answer_type": "integer", "query": "Hint: integer.\nQuestion: How many?", "metadata": {}},
]
MATHVISTA_RESPONSES = [
    "The number missing in the sequence is 14.",          # rule: last number 14 -> right; judge: 14 -> right
    "Of the 11 parts, 8 are blue, so 8/11 of the shape is blue.",  # rule: no letter at the end -> wrong; judge: B
    "0.6",                                                # shortcut, no judge request
    "There are seven of them.",                           # rule: none; the judge server is down for it
]
# what the loopback judge answers, by the response it reads at the end of the prompt
JUDGE_REPLIES = {MATHVISTA_RESPONSES[0]: " 14", MATHVISTA_RESPONSES[1]: "B\n",
                 "so the answer is C. done": "C", "I cannot tell.": "null"}


def _extraction_reply(prompt):
    return next((r for key, r in JUDGE_REPLIES.items() if key in prompt.rsplit("\n\n", 2)[-2]
                 or f"Model response: '{key}'" in prompt), None)


@pytest.fixture
def judge_server():
    server = LoopbackJudge(_extraction_reply)
    yield server
    server.close()


def _backend(url):
    return make_judge_backend("extractor", ModelRewardSpec(kind="judge", url=url, max_retries=0, backoff_s=0.0))


def test_mathvista_records_keep_both_extractions_and_report_agreement(judge_server):
    rows = [mathvista.build_row(record) for record in MATHVISTA_RECORDS]
    records = judge_extract("mathvista", rows, MATHVISTA_RESPONSES, _backend(judge_server.url))
    assert [(r["rule_score"], r["judge_extraction"], r["judge_score"], r["judge_asked"], r["judge_failed"])
            for r in records] == [
        (1.0, "14", 1.0, True, False),
        (0.0, "B", 1.0, True, False),
        (1.0, "0.6", 1.0, False, False),
        (0.0, None, None, True, True),
    ]
    assert [r["agree"] for r in records] == [True, False, True, None]
    assert len(judge_server.prompts) == 3  # the shortcut item never reaches the judge
    assert mathvista_prompt(rows[0]["problem"], MATHVISTA_RESPONSES[0]) in judge_server.prompts  # (concurrent order)
    assert summary(records) == {"items": 4.0, "rule_accuracy": 0.5, "judge_accuracy": 1.0,
                                "agreement": pytest.approx(2 / 3), "judge_failed": 1.0}


def test_mathverse_records_with_null_extraction(judge_server):
    records_in = [
        {"sample_index": "1", "problem_version": "Text Dominant", "question_type": "multi-choice",
         "question": "Which?\nChoices:\nA:1\nB:2\nC:3\nD:4", "answer": "C", "image": None,
         "query_cot": "Which? Choices: A:1 B:2 C:3 D:4"},
        {"sample_index": "2", "problem_version": "Text Dominant", "question_type": "free-form",
         "question": "Find x.", "answer": "3", "image": None, "query_cot": "Find x."},
    ]
    rows = [mathverse.build_row(record) for record in records_in]
    responses = ["so the answer is C. done", "I cannot tell."]
    records = judge_extract("mathverse", rows, responses, _backend(judge_server.url), mathverse_scoring="rule")
    # "null" is kept as MathVerse stores it, and scored as no answer by the rule
    assert [(r["judge_extraction"], r["judge_score"]) for r in records] == [("C", 1.0), ("null", 0.0)]
    assert sorted(judge_server.prompts) == sorted(mathverse_prompt(r) for r in responses)
    assert summary(records)["judge_accuracy"] == 0.5


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown extraction protocol 'mmmu'"):
        judge_extract("mmmu", [], [], None)
    with pytest.raises(ValueError, match="mathverse_scoring must be one of"):
        judge_extract("mathverse", [], [], None, mathverse_scoring="gpt")


class _ScriptedBackend:
    """A judge backend answering from a list, recording the prompts (``generate(texts, images)``)."""

    def __init__(self, *batches):
        self.batches = list(batches)
        self.prompts = []

    def generate(self, texts, images):
        self.prompts.append(list(texts))
        replies = self.batches.pop(0)
        assert len(replies) == len(texts)
        return replies


def test_mathverse_second_stage_scores_by_judgement():
    question = "Find angle 2.\nChoices:\nA:30°\nB:60°"
    rows = [mathverse.build_row({"sample_index": str(i), "problem_version": "Text Lite", "question_type": qtype,
                                 "question": q, "answer": a, "image": None, "query_cot": "Q: " + q})
            for i, (qtype, q, a) in enumerate([("multi-choice", question, "B"), ("free-form", "Find x.", "5"),
                                               ("free-form", "Find y.", "2"), ("free-form", "Find z.", "7")])]
    responses = ["<answer>60°</answer>", "x is five", "y = 2", "no idea"]
    failure = RuntimeError("connection refused")
    backend = _ScriptedBackend(["Extracted Answer: 60°", "5", "2", failure],
                               ["Judgement: 1", "1", "maybe"])
    records = judge_extract("mathverse", rows, responses, backend)
    # stage 2 sees the question, the standard answer and the stored extraction of the 3 items stage 1 answered
    assert backend.prompts[1] == [mathverse_score_prompt(question, "B", "60°"), mathverse_score_prompt("Find x.", "5", "5"),
                                  mathverse_score_prompt("Find y.", "2", "2")]
    assert [r["rule_score"] for r in records] == [1.0, 0.0, 1.0, 0.0]
    assert [(r["judge_extraction"], r["judge_score"], r["judge_failed"]) for r in records] == [
        ("60°", 1.0, False), ("5", 1.0, False), ("2", None, True), (None, None, True)]
    assert [r["agree"] for r in records] == [True, False, None, None]
    assert [r.get("judgement_reply") for r in records] == ["Judgement: 1", "1", "maybe", None]
    assert summary(records) == {"items": 4.0, "rule_accuracy": 0.5, "judge_accuracy": 1.0, "agreement": 0.5,
                                "judge_failed": 2.0}


def test_judge_spec_and_benchmark_selection(tmp_path):
    assert judge_spec("http://127.0.0.1:9/", "qwen").url == "http://127.0.0.1:9/"
    assert judge_spec("http://127.0.0.1:9", "qwen").model == "qwen"
    assert judge_spec(str(tmp_path)).path == str(tmp_path)
    assert judge_spec("judges.py:make").backend == "judges.py:make"
    settings = tmp_path / "judge.yaml"
    settings.write_text("url: http://127.0.0.1:9\nmax_retries: 0\nmax_concurrency: 2\n")
    spec = judge_spec(str(settings), "m")
    assert (spec.kind, spec.url, spec.max_retries, spec.max_concurrency, spec.model) == (
        "judge", "http://127.0.0.1:9", 0, 2, "m")
    settings.write_text("kind: classifier\npath: x\n")
    with pytest.raises(ValueError, match="an eval judge is kind judge"):
        judge_spec(str(settings))
    settings.write_text("url: http://127.0.0.1:9\ntimeout: 3\n")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['timeout'\]"):
        judge_spec(str(settings))
    with pytest.raises(ValueError, match="not an http\\(s\\) URL"):
        judge_spec("gpt-4o")
    with pytest.raises(ValueError, match="does not exist"):
        judge_spec(str(tmp_path / "absent.yaml"))

    assert [protocol_for(n) for n in ["mathvista_testmini", "mathverse_testmini/vision_only", "mmmu_val"]] == [
        "mathvista", "mathverse", None]
    names = ["mathvista_testmini", "mathverse_testmini", "mathverse_testmini/text_lite", "chartqa_test"]
    spec = judge_spec("http://127.0.0.1:9")
    assert JudgeEval(spec).select(names) == {"mathvista_testmini": "mathvista", "mathverse_testmini": "mathverse",
                                            "mathverse_testmini/text_lite": "mathverse"}
    assert JudgeEval(spec, ("mathverse_testmini/text_lite", "mathvista")).select(names) == {
        "mathvista_testmini": "mathvista", "mathverse_testmini/text_lite": "mathverse"}
    with pytest.raises(ValueError, match="'chartqa_test' has no judge extraction protocol"):
        JudgeEval(spec, ("chartqa_test",)).select(names)
    with pytest.raises(ValueError, match="'mmmu_val' is neither a benchmark of the run"):
        JudgeEval(spec, ("mmmu_val",)).select(names)
    with pytest.raises(ValueError, match="no benchmark of the run is a mathverse benchmark"):
        JudgeEval(spec, ("mathverse",)).select(["mathvista_testmini"])
    with pytest.raises(ValueError, match="no benchmark of the run has a judge extraction protocol"):
        JudgeEval(spec).select(["chartqa_test"])
