"""Generative backends for the Training-Free GRPO extractor, and the prompts of its four stages.

A backend is any object with ``complete(system, user, *, stage, context) -> str``. ``stage`` is one of
``summary``, ``group_advantage``, ``group_update``, ``batch_update``; ``context`` carries the structured
inputs the prompts were rendered from (question, answer, rewards, current library, operations), which a
language model ignores and a rule-based extractor reads. Three backends:

- :class:`LocalModelBackend`: a saved HF model (the frozen policy itself or another local model);
- :class:`ChatEndpointBackend`: an OpenAI-compatible ``/chat/completions`` endpoint (a judge server);
- :class:`RuleExtractor`: fixed, checkable rules producing answers in the same formats, so that the loop's
  bookkeeping can be tested exactly and tiny models can run the loop end to end.

The prompts keep the official contract (TencentCloudADP/youtu-agent ``utu/prompts/practice/experience.yaml``):
the summary of one attempt; a group critique whose experiences sit in ``<Experiences>`` tags (at most
``num_experiences``); and group / batch updates answering a JSON array of
``{"operation": ADD|UPDATE|DELETE|NONE, "id": ..., "content": "Name: description."}``. Their wording is
shortened here.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Mapping, Protocol

STAGES = ("summary", "group_advantage", "group_update", "batch_update")

_ROLE = ("Your goal is to improve a working agent by extracting useful experiences from its past attempts; they "
         "will be added to its prompts.\n<Working Agent Objective>\n{agent}\n</Working Agent Objective>\n"
         "<Learning Objective>\n{learning}\n</Learning Objective>\n\n")

SYSTEM_PROMPTS = {
    "summary": _ROLE + (
        "Summarise the single attempt below step by step: what the agent did, its reasoning, where it went wrong "
        "or right with respect to the ground truth, and what it missed. End with 'Overall Strategies:'."),
    "group_advantage": _ROLE + (
        "Several attempts at one problem follow, each with its reward (0 to 1, 1 is best). Compare the good and "
        "bad attempts, diagnose the failures, name what made the successes work, and write general insights "
        "(as 'When [condition], [strategy]' where a condition is needed). Put AT MOST {num_experiences} "
        "experiences, numbered, inside <Experiences>...</Experiences>."),
    "group_update": _ROLE + (
        "Given the existing experiences (with ids) and new ones, decide for each new experience one operation: "
        "ADD (new information; no id), UPDATE (refines the existing experience with that id; the content replaces "
        "it), DELETE (contradicts the existing experience with that id), NONE (already covered). Each experience "
        "reads 'Name: one-sentence description.' Answer one JSON array in a ```json fence, one object per new "
        "experience: {{\"operation\": \"ADD|UPDATE|DELETE|NONE\", \"id\": \"id or null\", \"content\": \"...\"}}."),
    "batch_update": _ROLE + (
        "A batch of proposed operations follows, grouped by the existing experience they name. Merge them into "
        "the net set of operations: synthesise several UPDATEs of one id into one, merge similar ADDs, resolve "
        "conflicts. Answer one JSON array in a ```json fence of {{\"operation\": \"ADD|UPDATE|DELETE|NONE\", "
        "\"id\": \"id or null\", \"content\": \"Name: description.\"}}."),
}

USER_PROMPTS = {
    "summary": ("<Working Agent Input>\n{question}\n</Working Agent Input>\n\n<Ground Truth>\n{answer}\n</Ground Truth>"
                "\n\n<Trajectory>\n{trajectory}\n</Trajectory>"),
    "group_advantage": ("<Agent Input>\n{question}\n</Agent Input>\n\n<Ground Truth>\n{answer}\n</Ground Truth>\n\n"
                        "<Trajectories>\n{trajectories}\n</Trajectories>"),
    "group_update": ("<Existing Experiences>\n{existing}\n</Existing Experiences>\n\n<New Experiences>\n{new}\n"
                     "</New Experiences>"),
    "batch_update": "<Experiences and Proposed Operations>\n{listing}\n</Experiences and Proposed Operations>",
}


def render(stage: str, *, agent_objective: str, learning_objective: str, num_experiences: int = 1,
           **fields: Any) -> tuple[str, str]:
    """(system, user) prompts of ``stage`` with its fields filled in."""
    system = SYSTEM_PROMPTS[stage].format(agent=agent_objective.strip(), learning=learning_objective.strip(),
                                          num_experiences=num_experiences)
    return system, USER_PROMPTS[stage].format(**fields)


class GenerativeBackend(Protocol):
    def complete(self, system: str, user: str, *, stage: str, context: Mapping[str, Any]) -> str: ...


class LocalModelBackend:
    """A saved HF text LM or VLM answering the extractor's prompts (greedy unless ``temperature`` > 0).

    ``model``/``processor`` may be passed already loaded (the frozen policy itself serves as its own extractor).
    """

    def __init__(self, model_path: str | None = None, *, model: Any = None, processor: Any = None,
                 max_new_tokens: int = 512, temperature: float = 0.0) -> None:
        if model is None:
            if model_path is None:
                raise ValueError("LocalModelBackend needs model_path or a loaded model and processor")
            from mmpo.vlm.factory import load_vlm

            model, processor = load_vlm(model_path)
        from mmpo.vlm.rollout import HFGenerateEngine

        self.engine = HFGenerateEngine(model, processor, system_prompt=None)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def complete(self, system: str, user: str, *, stage: str, context: Mapping[str, Any]) -> str:
        rollout = self.engine.generate([{"id": f"extractor-{stage}", "problem": user, "system_prompt": system}],
                                       num_samples=1, max_new_tokens=self.max_new_tokens,
                                       temperature=self.temperature or 1.0, do_sample=self.temperature > 0)
        return rollout.texts[0]


class ChatEndpointBackend:
    """An OpenAI-compatible chat endpoint: POST ``{base_url}/chat/completions`` with the system and user turns."""

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 2048, timeout_s: float = 300.0) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens, self.timeout_s = model, temperature, max_tokens, timeout_s
        self.api_key_env = api_key_env

    def complete(self, system: str, user: str, *, stage: str, context: Mapping[str, Any]) -> str:
        import os

        body = {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"environment variable {self.api_key_env} (the endpoint's key) is not set")
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            answer = json.loads(response.read())
        return answer["choices"][0]["message"]["content"]


class RuleExtractor:
    """A deterministic extractor with rules that can be checked by hand (the testbed of the loop's bookkeeping).

    - summary: ``"answer: <the attempt's text, stripped>"``;
    - group_advantage: one experience, ``"<task>: the answer to '<question>' is <ground truth>."`` (the task is
      the row's ``task``, or ``"task"``), inside ``<Experiences>`` tags;
    - group_update: for each new experience line (the leading ``1.`` numbering removed), UPDATE the existing
      experience whose name (text before the first ``:``) is the same, else ADD;
    - batch_update: the proposed operations, keeping only the last one per target (the id for an UPDATE or
      DELETE, the name for an ADD), in first-seen order.
    """

    def complete(self, system: str, user: str, *, stage: str, context: Mapping[str, Any]) -> str:
        if stage == "summary":
            return "answer: " + context["trajectory"].strip()
        if stage == "group_advantage":
            row = context["row"]
            return (f"<Experiences>\n1. {row.get('task') or 'task'}: the answer to '{row['problem']}' is "
                    f"{row['answer']}.\n</Experiences>")
        if stage == "group_update":
            existing = context["experiences"]
            operations = []
            for line in context["new_experiences"].splitlines():
                content = line.strip().split(". ", 1)[-1] if line.strip()[:1].isdigit() else line.strip()
                if not content:
                    continue
                name = content.split(":", 1)[0]
                match = next((key for key, text in existing.items() if text.split(":", 1)[0] == name), None)
                operations.append({"operation": "UPDATE" if match else "ADD", "id": match, "content": content})
            return "```json\n" + json.dumps(operations) + "\n```"
        if stage == "batch_update":
            merged: dict[str, dict] = {}
            for op in context["operations"]:
                key = op.get("id") or "name:" + str(op.get("content", "")).split(":", 1)[0]
                merged[key] = op
            return "```json\n" + json.dumps(list(merged.values())) + "\n```"
        raise ValueError(f"unknown extractor stage {stage!r} (expected one of {', '.join(STAGES)})")


def build_backend(spec: Mapping[str, Any] | str, *, policy: Any = None) -> GenerativeBackend:
    """A backend from its config: ``"policy"``, ``"rules"``, ``{"model_path": ...}`` or ``{"base_url": ..., "model": ...}``.

    ``policy`` is the (model, processor) pair of the frozen policy, used by ``"policy"``.
    """
    if spec == "rules":
        return RuleExtractor()
    if spec == "policy":
        if policy is None:
            raise ValueError("extractor 'policy' needs the loaded policy")
        return LocalModelBackend(model=policy[0], processor=policy[1])
    if isinstance(spec, Mapping):
        options = dict(spec)
        if "base_url" in options:
            return ChatEndpointBackend(**options)
        if "model_path" in options:
            return LocalModelBackend(**options)
    raise ValueError(f"extractor must be 'policy', 'rules', {{model_path: ...}} or {{base_url: ..., model: ...}}, "
                     f"got {spec!r}")
