"""Judge-scored evals: MathVista's and MathVerse's official LLM answer-extraction protocols over any judge
backend (mmpo.rewards.models: an OpenAI-compatible server, a local model, or a judge of your own).

- MathVista (lupantech/MathVista, ``evaluation/extract_answer.py``): ``extract_answer`` returns ``""`` for an
  empty response, the response itself when a multiple-choice response is one of the choices, the response when
  it already parses as the integer / float the item asks for; otherwise the judge completes
  ``create_test_prompt(demo_prompt, query, response)`` = ``demo_prompt.strip() + "\\n\\n" + query + "\\n\\n" +
  response + "\\n\\nExtracted answer: "`` with the five in-context examples of ``evaluation/prompts/ext_ans.py``
  (:data:`MATHVISTA_DEMO_PROMPT`, verbatim).
- MathVerse (ZrrSkywalker/MathVerse, ``evaluation/extract_answer_s1.py``): the judge completes
  ``demo_prompt.strip() + "\\n\\nModel response: '<response>'\\nExtracted Answer: "`` with the six examples of
  ``evaluation/prompts.py`` ``demo_prompt_extract`` (:data:`MATHVERSE_DEMO_PROMPT`, verbatim); ``null`` means
  no answer.

The judge's extraction is then scored by the benchmark's own rule (``mmpo.eval.benchmarks.scoring.RULES``), so
each record keeps both extractions and both scores: ``rule_extraction`` / ``rule_score`` (mmpo's rule-based
extraction, ``scoring.judge``) and ``judge_extraction`` / ``judge_score``. A failed judge request leaves the
judge side None (counted, never raised). :func:`summary` reports both accuracies and their agreement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mmpo.eval.benchmarks.scoring import RULES, judge as rule_judge, score_number

MATHVISTA_DEMO_PROMPT = '\nPlease read the following example. Then extract the answer from the model response and type it at the end of the prompt.\n\nHint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.\nQuestion: Which number is missing?\n\nModel response: The number missing in the sequence is 14.\n\nExtracted answer: 14\n\nHint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.\nQuestion: What is the fraction of females facing the camera?\n\nModel response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the group are facing the camera.\n\nExtracted answer: 0.6\n\nHint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.\nQuestion: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)\n\nModel response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.\n\nExtracted answer: 1.45\n\nHint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.\nQuestion: Between which two years does the line  graph saw its maximum peak?\n\nModel response: The line graph saw its maximum peak between 2007 and 2008.\n\nExtracted answer: [2007, 2008]\n\nHint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.\nQuestion: What fraction of the shape is blue?\nChoices:\n(A) 3/11\n(B) 8/11\n(C) 6/11\n(D) 3/5\n\nModel response: The correct answer is (B) 8/11.\n\nExtracted answer: B\n'
"""lupantech/MathVista, evaluation/prompts/ext_ans.py, ``demo_prompt`` (pids 852, 104, 824, 506, 540), verbatim."""

MATHVERSE_DEMO_PROMPT = '\nI am providing you a response from a model to a math problem, termed \'Model Response\'. You should extract the answer from the response as \'Extracted Answer\'. Directly output the extracted answer with no explanation.\n\n1.\nModel response: \'Rounded to two decimal places, the perimeter of the sector is approximately:\n\n(-2, 1)\'\nExtracted Answer: (-2, 1)\n\n2.\nModel response: \'at those points.\n\nTherefore, the correct option that represents the meaning of the intersection points of the graphs is:\n\nD. They give the solutions to the equation $f(t)=g(t)$.",\'\nExtracted Answer: D\n\n3.\nModel response: \' at 1 (there\'s a closed circle at y = 1), the range in interval notation is \\((-4, 1]\\).\n\nFinal values:\nDomain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)\'\nExtracted Answer: Domain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)\n\n4.\nModel response: \'As it stands, I cannot provide the correct option letter because there isn\'t enough information to solve for \'y\'.\'\nExtracted Answer: null\n\n5.\nModel response: \'Given that AB = 17.6 meters, we can now substitute into the equation:\n\nd = 17.6 / cos(38°)\n\nTherefore, to one decimal place, the distance d between Ned and Bart is approximately 22.3 meters.\'\nExtracted answer: 22.3\n\n6.\nModel response:  have all the coefficients for the quadratic function:\n\\( f(x) = ax^2 + bx + c \\)\n\\( f(x) = -1x^2 - 2x + 1 \\)\n\nTherefore, the equation for the graphed function \\( f \\) is:\n\\( f(x) = -x^2 - 2x + 1 \\)"\'\nExtracted answer: f(x) = -x^2 - 2x + 1\n\n7.\n'
"""ZrrSkywalker/MathVerse, evaluation/prompts.py, ``demo_prompt_extract``, verbatim."""

PROTOCOLS = ("mathvista", "mathverse")


def mathvista_prompt(query: str, response: str) -> str:
    """MathVista's ``create_test_prompt(demo_prompt, query, response)``."""
    return f"{MATHVISTA_DEMO_PROMPT.strip()}\n\n{query}\n\n{response}\n\nExtracted answer: "


def mathverse_prompt(response: str) -> str:
    """MathVerse's ``create_test_prompt(demo_prompt_extract, response, inst)``."""
    return f"{MATHVERSE_DEMO_PROMPT.strip()}\n\nModel response: '{response}'\nExtracted Answer: "


def mathvista_shortcut(response: str, params: Mapping[str, Any]) -> str | None:
    """MathVista's extraction before the judge: ``""`` for an empty response, the response when it is one of
    a multiple-choice item's choices or parses as the integer / float the item asks for; None: ask the judge."""
    if response == "":
        return ""
    if params.get("question_type") == "multi_choice" and response in (params.get("choices") or []):
        return response
    if params.get("answer_type") == "integer":
        try:
            return str(int(response))
        except ValueError:
            pass
    if params.get("answer_type") == "float":
        try:
            return str(float(response))
        except ValueError:
            pass
    return None


def _score(extraction: str | None, row: Mapping[str, Any]) -> float:
    params = row["scoring"]
    if params["rule"] == "number":
        return score_number(extraction, params)[1]
    return RULES[params["rule"]](extraction, params)[1]


def judge_extract(protocol: str, rows: Sequence[Mapping[str, Any]], completions: Sequence[str],
                  backend: Any) -> list[dict[str, Any]]:
    """Per-item records with the rule-based and the judge extraction and their scores (module docstring).

    Args:
        protocol: ``mathvista`` or ``mathverse``.
        rows: eval rows (``mmpo.eval.benchmarks``: ``problem`` is the benchmark's query, ``scoring`` its rule).
        completions: the model's responses, one per row.
        backend: a judge backend, ``generate(texts, images) -> list[str | Exception]``
            (``mmpo.rewards.models.make_judge_backend``).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown extraction protocol {protocol!r}; valid: {PROTOCOLS}")
    if len(rows) != len(completions):
        raise ValueError(f"got {len(rows)} rows but {len(completions)} completions")
    records: list[dict[str, Any]] = []
    asks: list[int] = []
    prompts: list[str] = []
    for index, (row, completion) in enumerate(zip(rows, completions)):
        rule_extraction, rule_score = rule_judge(completion, row)
        record = {"id": row.get("id"), "rule_extraction": rule_extraction, "rule_score": rule_score,
                  "judge_extraction": None, "judge_score": None, "judge_failed": False, "judge_asked": False}
        shortcut = mathvista_shortcut(completion, row["scoring"]) if protocol == "mathvista" else None
        if shortcut is not None:
            record["judge_extraction"] = shortcut
        else:
            asks.append(index)
            prompts.append(mathvista_prompt(str(row["problem"]), completion) if protocol == "mathvista"
                           else mathverse_prompt(completion))
        records.append(record)
    replies = backend.generate(prompts, [[] for _ in prompts]) if prompts else []
    for index, reply in zip(asks, replies):
        record = records[index]
        record["judge_asked"] = True
        if isinstance(reply, BaseException) or not isinstance(reply, str):
            record["judge_failed"] = True
            continue
        extraction = reply.strip()
        if protocol == "mathverse" and extraction.lower() == "null":
            extraction = ""
        record["judge_extraction"] = extraction
    for record, row in zip(records, rows):
        if not record["judge_failed"]:
            extraction = record["judge_extraction"]
            record["judge_score"] = _score(extraction if extraction else None, row)
        record["agree"] = None if record["judge_score"] is None else record["judge_score"] == record["rule_score"]
    return records


def summary(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``rule_accuracy``, ``judge_accuracy`` and ``agreement`` (over the items the judge scored),
    ``judge_failed`` (count) and ``items``."""
    scored = [r for r in records if r["judge_score"] is not None]
    n = len(records)
    return {
        "items": float(n),
        "rule_accuracy": sum(r["rule_score"] for r in records) / n if n else float("nan"),
        "judge_accuracy": sum(r["judge_score"] for r in scored) / len(scored) if scored else float("nan"),
        "agreement": sum(r["agree"] for r in scored) / len(scored) if scored else float("nan"),
        "judge_failed": float(sum(r["judge_failed"] for r in records)),
    }
