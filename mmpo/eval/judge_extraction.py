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
  no answer. The extraction is the reply with ``Extracted Answer: `` removed and stripped, as the official script
  stores it.
- MathVerse's second stage (``evaluation/score_answer_s2.py``): the judge completes
  ``demo_prompt_score.strip().format(question=..., gt=..., extraction=...)`` (:data:`MATHVERSE_SCORE_PROMPT`, the
  four in-context examples of ``evaluation/prompts.py`` verbatim) and its reply, with ``Judgement:`` removed and
  stripped, must be ``0`` or ``1`` (the official script asks again until it is; here any other reply is a
  failed judgement). ``mathverse_scoring="rule"`` scores the extraction by the rule instead.

A MathVista extraction (and a MathVerse one under ``mathverse_scoring="rule"``) is scored by the benchmark's own
rule (``mmpo.eval.benchmarks.scoring.RULES``; MathVerse's ``null`` is no answer), so each record keeps both
extractions and both scores: ``rule_extraction`` / ``rule_score`` (mmpo's rule-based extraction,
``scoring.judge``) and ``judge_extraction`` / ``judge_score``. A failed judge request leaves the judge side None
(counted, never raised). :func:`summary` reports both accuracies and their agreement.

:class:`JudgeEval` selects the benchmarks of an ``mmpo eval`` run that a judge scores (``--judge``,
``--judge-benchmarks``); :func:`judge_benchmark` adds the judge's side to the harness's per-item predictions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmpo.eval.benchmarks.scoring import RULES, judge as rule_judge, score_number
from mmpo.rewards.models import ModelRewardSpec, parse_spec

MATHVISTA_DEMO_PROMPT = '\nPlease read the following example. Then extract the answer from the model response and type it at the end of the prompt.\n\nHint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.\nQuestion: Which number is missing?\n\nModel response: The number missing in the sequence is 14.\n\nExtracted answer: 14\n\nHint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.\nQuestion: What is the fraction of females facing the camera?\n\nModel response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the group are facing the camera.\n\nExtracted answer: 0.6\n\nHint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.\nQuestion: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)\n\nModel response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.\n\nExtracted answer: 1.45\n\nHint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.\nQuestion: Between which two years does the line  graph saw its maximum peak?\n\nModel response: The line graph saw its maximum peak between 2007 and 2008.\n\nExtracted answer: [2007, 2008]\n\nHint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.\nQuestion: What fraction of the shape is blue?\nChoices:\n(A) 3/11\n(B) 8/11\n(C) 6/11\n(D) 3/5\n\nModel response: The correct answer is (B) 8/11.\n\nExtracted answer: B\n'
"""lupantech/MathVista, evaluation/prompts/ext_ans.py, ``demo_prompt`` (pids 852, 104, 824, 506, 540), verbatim."""

MATHVERSE_DEMO_PROMPT = '\nI am providing you a response from a model to a math problem, termed \'Model Response\'. You should extract the answer from the response as \'Extracted Answer\'. Directly output the extracted answer with no explanation.\n\n1.\nModel response: \'Rounded to two decimal places, the perimeter of the sector is approximately:\n\n(-2, 1)\'\nExtracted Answer: (-2, 1)\n\n2.\nModel response: \'at those points.\n\nTherefore, the correct option that represents the meaning of the intersection points of the graphs is:\n\nD. They give the solutions to the equation $f(t)=g(t)$.",\'\nExtracted Answer: D\n\n3.\nModel response: \' at 1 (there\'s a closed circle at y = 1), the range in interval notation is \\((-4, 1]\\).\n\nFinal values:\nDomain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)\'\nExtracted Answer: Domain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)\n\n4.\nModel response: \'As it stands, I cannot provide the correct option letter because there isn\'t enough information to solve for \'y\'.\'\nExtracted Answer: null\n\n5.\nModel response: \'Given that AB = 17.6 meters, we can now substitute into the equation:\n\nd = 17.6 / cos(38°)\n\nTherefore, to one decimal place, the distance d between Ned and Bart is approximately 22.3 meters.\'\nExtracted answer: 22.3\n\n6.\nModel response:  have all the coefficients for the quadratic function:\n\\( f(x) = ax^2 + bx + c \\)\n\\( f(x) = -1x^2 - 2x + 1 \\)\n\nTherefore, the equation for the graphed function \\( f \\) is:\n\\( f(x) = -x^2 - 2x + 1 \\)"\'\nExtracted answer: f(x) = -x^2 - 2x + 1\n\n7.\n'
"""ZrrSkywalker/MathVerse, evaluation/prompts.py, ``demo_prompt_extract``, verbatim."""

MATHVERSE_SCORE_PROMPT = '\nBelow are two answers to a math question. Question is [Question], [Standard Answer] is the standard answer to the question, and [Model_answer] is the answer extracted from a model\'s output to this question.  Determine whether these two answers are consistent.\nPlease note that only when the [Model_answer] completely matches the [Standard Answer] means they are consistent. For non-multiple-choice questions, if the meaning is expressed in the same way, it is also considered consistent, for example, 0.5m and 50cm.\nIf they are consistent, Judement is 1; if they are different, Judement is 0.\n\n[Question]: Write the set of numbers represented on the number line in interval notation.\n[Standard Answer]: (-2,1]\n[Model_answer] : Extracted Answer: \\((-2, 1)\\)\nJudgement: 0\n\n[Question]: Find the domain and range of the function f using interval notation.\n[Standard Answer]: domain: [-4, 0) and range: (-3, 1]\n[Model_answer] : Range: \\((-4, 1]\\)\nJudgement: 0\n\n\n[Question]: Two curves are symmetrical about the x-axis. Use the vertical line test to determine if this relation is a function.\nChoices:\nA:This is a function\nB:This is not a function\n[Standard Answer]: B\n[Model_answer] : This is not a function\nJudgement: 1\n\n[Question]: Given the graph of the ellipse that intersects with x-axis at 9 and -9 and with y-axis at 3 and -3, determine its equation.A. \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1 B. Can not determine.\n\n[Standard Answer]: A\n[Model_answer] : \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1\nJudgement: 1\n\n[Question]: {question}\n[Standard Answer]: {gt}\n[Model_answer] : {extraction}\nJudgement: '
"""ZrrSkywalker/MathVerse, evaluation/prompts.py, ``demo_prompt_score`` (a ``str.format`` template: ``{{`` is a
literal brace), verbatim."""

PROTOCOLS = ("mathvista", "mathverse")
MATHVERSE_SCORING = ("judge", "rule")


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


def mathverse_score_prompt(question: str, answer: str, extraction: str) -> str:
    """MathVerse's second stage, ``score_answer_s2.create_test_prompt(demo_prompt_score, inst)``."""
    return MATHVERSE_SCORE_PROMPT.strip().format(question=question, gt=answer, extraction=extraction)


def parse_judgement(reply: str) -> int | None:
    """``score_answer_s2.match_answer``'s reading of a reply: ``Judgement:`` removed, stripped, ``0`` or ``1``;
    None for anything else (the official script asks again)."""
    judgement = reply.replace("Judgement:", "").strip()
    return int(judgement) if judgement in ("0", "1") else None


def _score(extraction: str | None, row: Mapping[str, Any]) -> float:
    params = row["scoring"]
    if params["rule"] == "number":
        return score_number(extraction, params)[1]
    return RULES[params["rule"]](extraction, params)[1]


def _failed(reply: Any) -> bool:
    return isinstance(reply, BaseException) or not isinstance(reply, str)


def judge_extract(protocol: str, rows: Sequence[Mapping[str, Any]], completions: Sequence[str],
                  backend: Any, *, mathverse_scoring: str = "judge") -> list[dict[str, Any]]:
    """Per-item records with the rule-based and the judge extraction and their scores (module docstring).

    Args:
        protocol: ``mathvista`` or ``mathverse``.
        rows: eval rows (``mmpo.eval.benchmarks``: ``problem`` is the benchmark's query, ``scoring`` its rule;
            a MathVerse row's ``question`` and ``answer`` fill the second-stage prompt).
        completions: the model's responses, one per row.
        backend: a judge backend, ``generate(texts, images) -> list[str | Exception]``
            (``mmpo.rewards.models.make_judge_backend``).
        mathverse_scoring: ``judge`` (MathVerse's official second stage) or ``rule``.

    Returns:
        One record per row: ``id``, ``rule_extraction``, ``rule_score``, ``judge_extraction``, ``judge_score``,
        ``judge_asked`` (the extraction went to the judge), ``judge_failed`` (a request failed, or a second-stage
        reply was neither 0 nor 1), ``agree`` (``judge_score == rule_score``; None when the judge failed) and,
        with MathVerse's second stage, ``judgement_reply`` (the judge's raw reply).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown extraction protocol {protocol!r}; valid: {PROTOCOLS}")
    if mathverse_scoring not in MATHVERSE_SCORING:
        raise ValueError(f"mathverse_scoring must be one of {MATHVERSE_SCORING}, got {mathverse_scoring!r}")
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
        if _failed(reply):
            record["judge_failed"] = True
            continue
        # MathVerse stores the reply without a repeated "Extracted Answer: " (extract_answer_s1.py)
        record["judge_extraction"] = (reply.replace("Extracted Answer: ", "") if protocol == "mathverse"
                                      else reply).strip()
    second_stage = protocol == "mathverse" and mathverse_scoring == "judge"
    if second_stage:
        scored = [index for index, record in enumerate(records) if not record["judge_failed"]]
        texts = [mathverse_score_prompt(str(rows[i].get("question", "")), str(rows[i]["answer"]),
                                        records[i]["judge_extraction"]) for i in scored]
        judgements = backend.generate(texts, [[] for _ in texts]) if texts else []
        for index, reply in zip(scored, judgements):
            record = records[index]
            record["judgement_reply"] = None if _failed(reply) else reply
            judgement = None if _failed(reply) else parse_judgement(reply)
            if judgement is None:
                record["judge_failed"] = True
            else:
                record["judge_score"] = float(judgement)
    for record, row in zip(records, rows):
        if not record["judge_failed"] and not second_stage:
            extraction = record["judge_extraction"]
            no_answer = not extraction or (protocol == "mathverse" and extraction.lower() == "null")
            record["judge_score"] = _score(None if no_answer else extraction, row)
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


# ---------------------------------------------------------------------------------------------- mmpo eval


def protocol_for(benchmark: str) -> str | None:
    """The extraction protocol of a registered benchmark name (``mathvista_testmini`` -> ``mathvista``,
    ``mathverse_testmini/vision_only`` -> ``mathverse``); None for a benchmark without one."""
    base = benchmark.split("/")[0]
    return next((protocol for protocol in PROTOCOLS if base.startswith(protocol)), None)


def judge_spec(text: str, model: str | None = None) -> ModelRewardSpec:
    """``mmpo eval --judge``: a judge backend as in ``rewards.models`` (``kind: judge``).

    ``http(s)://...`` is an OpenAI-compatible server (``url``); ``*.yaml`` / ``*.yml`` a file of
    ``rewards.models.<name>`` settings (``url`` / ``path`` / ``backend``, ``model``, timeouts, ``max_concurrency``...;
    ``kind`` may be left out); an existing directory a local causal LM or VLM (``path``); ``file.py:factory`` or
    ``package.module:factory`` a judge of your own (``backend``). ``model`` is the model name sent to a server.

    Raises:
        ValueError: text that is none of these, a settings file that is not a mapping, or a bad setting.
    """
    settings: dict[str, Any]
    if text.startswith(("http://", "https://")):
        settings = {"url": text}
    elif text.endswith((".yaml", ".yml")):
        import yaml

        if not os.path.isfile(text):
            raise ValueError(f"--judge: settings file {text!r} does not exist")
        with open(text) as handle:
            loaded = yaml.safe_load(handle)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"--judge: {text!r} must hold a mapping of judge settings, got {type(loaded).__name__}")
        settings = dict(loaded)
        if settings.setdefault("kind", "judge") != "judge":
            raise ValueError(f"--judge: {text!r} has kind {settings['kind']!r}; an eval judge is kind judge")
    elif os.path.isdir(text):
        settings = {"path": text}
    elif ":" in text:
        settings = {"backend": text}
    else:
        raise ValueError(f"--judge: {text!r} is not an http(s) URL, a settings .yaml file, a model directory "
                         "or file.py:factory")
    settings["kind"] = "judge"
    if model is not None:
        settings["model"] = model
    return parse_spec("judge", settings)


@dataclass(frozen=True)
class JudgeEval:
    """Judge-scored benchmarks of an eval run (``mmpo eval --judge SPEC --judge-benchmarks NAMES``).

    Attributes:
        spec: the judge (:func:`judge_spec`; any ``kind: judge`` setting of ``rewards.models``).
        benchmarks: benchmark names of the run, or protocol names (``mathvista``, ``mathverse``) meaning every
            benchmark of the run with that protocol; empty: every benchmark of the run that has a protocol.
        mathverse_scoring: ``judge`` (MathVerse's official second stage) or ``rule``.
    """

    spec: ModelRewardSpec
    benchmarks: tuple[str, ...] = ()
    mathverse_scoring: str = "judge"

    def __post_init__(self) -> None:
        if self.spec.kind != "judge":
            raise ValueError(f"an eval judge is kind judge, got {self.spec.kind!r}")
        if self.mathverse_scoring not in MATHVERSE_SCORING:
            raise ValueError(f"mathverse_scoring must be one of {MATHVERSE_SCORING}, got {self.mathverse_scoring!r}")

    def select(self, names: Sequence[str]) -> dict[str, str]:
        """The run's judge-scored benchmarks: ``{benchmark name: protocol}``, in run order.

        Raises:
            ValueError: a selected name that is neither a benchmark of the run nor a protocol, a selected
                benchmark without a protocol, a protocol no benchmark of the run has, or nothing selected.
        """
        selected: dict[str, str] = {}
        for wanted in self.benchmarks or PROTOCOLS:
            if wanted in PROTOCOLS:
                matches = [name for name in names if protocol_for(name) == wanted]
                if not matches and self.benchmarks:
                    raise ValueError(f"--judge-benchmarks names {wanted!r} but no benchmark of the run is a "
                                     f"{wanted} benchmark: {list(names)}")
            elif wanted in names:
                if protocol_for(wanted) is None:
                    raise ValueError(f"--judge-benchmarks: {wanted!r} has no judge extraction protocol; judge-scored "
                                     f"benchmarks are those of {PROTOCOLS}")
                matches = [wanted]
            else:
                raise ValueError(f"--judge-benchmarks: {wanted!r} is neither a benchmark of the run ({list(names)}) "
                                 f"nor a protocol {PROTOCOLS}")
            selected.update({name: str(protocol_for(name)) for name in matches})
        if not selected:
            raise ValueError(f"--judge: no benchmark of the run has a judge extraction protocol {PROTOCOLS}: "
                             f"{list(names)}")
        return {name: selected[name] for name in names if name in selected}

    def describe(self) -> dict[str, Any]:
        """What ``results.json`` records of the judge (no secrets: the API key's variable name only)."""
        spec = self.spec
        return {"url": spec.url, "path": spec.path, "backend": spec.backend, "model": spec.model,
                "max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature,
                "mathverse_scoring": self.mathverse_scoring}


def judge_benchmark(protocol: str, rows: Sequence[Mapping[str, Any]], predictions: Sequence[dict[str, Any]],
                    backend: Any, *, mathverse_scoring: str = "judge") -> dict[str, Any]:
    """Judge-score one benchmark of an eval run after its rule scoring.

    Adds to each per-item prediction (``mmpo.eval.harness.item_record``; one entry per sample, beside the rule's
    ``extracted`` / ``scores``) ``judge_extracted``, ``judge_scores`` (None where the judge failed),
    ``judge_failed`` and ``agree`` (and ``judgement_replies`` under MathVerse's second stage). Returns the
    benchmark's ``judge`` metrics: ``protocol``, ``items`` (answers), ``rule_accuracy``, ``judge_accuracy`` and
    ``agreement`` (over the answers the judge scored), ``judge_failed`` (count).
    """
    if len(rows) != len(predictions):
        raise ValueError(f"{len(rows)} rows but {len(predictions)} prediction records")
    flat_rows = [row for row, item in zip(rows, predictions) for _ in item["completions"]]
    flat_completions = [text for item in predictions for text in item["completions"]]
    records = iter(judge_extract(protocol, flat_rows, flat_completions, backend, mathverse_scoring=mathverse_scoring))
    every: list[dict[str, Any]] = []
    for item in predictions:
        mine = [next(records) for _ in item["completions"]]
        every += mine
        item["judge_extracted"] = [record["judge_extraction"] for record in mine]
        item["judge_scores"] = [record["judge_score"] for record in mine]
        item["judge_failed"] = [record["judge_failed"] for record in mine]
        item["agree"] = [record["agree"] for record in mine]
        if protocol == "mathverse" and mathverse_scoring == "judge":
            item["judgement_replies"] = [record.get("judgement_reply") for record in mine]
    return {"protocol": protocol, **summary(every)}
