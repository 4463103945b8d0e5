"""Judge-scored evals (mmpo.eval.judge_extraction): MathVista's and MathVerse's official extraction prompts,
MathVista's pre-judge shortcuts, per-item records with both extractions, and rule/judge agreement on fixtures,
with a judge served over HTTP on the loopback address."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmpo.eval.benchmarks import mathverse, mathvista
from mmpo.eval.judge_extraction import (
    MATHVERSE_DEMO_PROMPT,
    MATHVISTA_DEMO_PROMPT,
    judge_extract,
    mathverse_prompt,
    mathvista_prompt,
    mathvista_shortcut,
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


class _ExtractionJudge:
    def __init__(self):
        self.prompts = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                judge.prompts.append(prompt)
                reply = next((r for key, r in JUDGE_REPLIES.items() if key in prompt.rsplit("\n\n", 2)[-2]
                              or f"Model response: '{key}'" in prompt), None)
                if reply is None:
                    self.send_response(500)
                    self.end_headers()
                    return
                data = json.dumps({"choices": [{"message": {"content": reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def judge_server():
    server = _ExtractionJudge()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


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
    records = judge_extract("mathverse", rows, responses, _backend(judge_server.url))
    assert [(r["judge_extraction"], r["judge_score"]) for r in records] == [("C", 1.0), ("", 0.0)]
    assert sorted(judge_server.prompts) == sorted(mathverse_prompt(r) for r in responses)
    assert summary(records)["judge_accuracy"] == 0.5


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown extraction protocol 'mmmu'"):
        judge_extract("mmmu", [], [], None)
