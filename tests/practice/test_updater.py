"""Training-Free GRPO's update bookkeeping with a scripted extractor: which groups are used, what each stage
is asked, which operations reach the library (hand values)."""

from __future__ import annotations

import json

from mmpo.practice.backends import RuleExtractor
from mmpo.practice.updater import ExperienceUpdater, Group


class Scripted:
    """Answers each stage from a list (in call order) and records the calls."""

    def __init__(self, answers):
        self.answers = {stage: list(texts) for stage, texts in answers.items()}
        self.calls = []

    def complete(self, system, user, *, stage, context):
        self.calls.append((stage, user))
        return self.answers[stage].pop(0)


def _groups():
    return [Group({"problem": "A", "answer": "1", "task": "t"}, ["a1", "a2"], [1.0, 0.0]),   # mixed: used
            Group({"problem": "B", "answer": "2", "task": "t"}, ["b1", "b2"], [0.0, 0.0]),   # all wrong
            Group({"problem": "C", "answer": "3", "task": "u"}, ["c1", "c2"], [1.0, 1.0]),   # all right
            Group({"problem": "D", "answer": "4", "task": "u"}, ["d1", "d2"], [0.0, 1.0])]   # mixed: used


def _updater(backend, **kw):
    return ExperienceUpdater(backend, agent_objective="solve", learning_objective="learn", num_experiences=1, **kw)


def test_only_mixed_groups_reach_the_extractor_and_the_batch_plan_is_applied():
    backend = Scripted({
        "summary": ["sa1", "sa2", "sd1", "sd2"],
        "group_advantage": ["<Experiences>1. X: x.</Experiences>", "<Experiences>1. Y: y.</Experiences>"],
        "group_update": ['```json\n[{"operation": "UPDATE", "id": "G0", "content": "X: x."}]\n```',
                         'not json'],
        "batch_update": ['oops', '```json\n[{"operation": "UPDATE", "id": "G0", "content": "X: merged."},'
                         ' {"operation": "ADD", "id": null, "content": "Z: z."}]\n```'],
    })
    new, stats = _updater(backend).run(_groups(), {"G0": "X: old.", "G1": "W: w."})
    assert new == {"G0": "X: merged.", "G1": "W: w.", "G2": "Z: z."}
    assert [stage for stage, _ in backend.calls] == ["summary"] * 2 + ["group_advantage"] + ["group_update"] + \
        ["summary"] * 2 + ["group_advantage", "group_update", "batch_update", "batch_update"]
    assert "<Working Agent Input>\nA\n" in backend.calls[0][1] and "<Trajectory>\na1\n" in backend.calls[0][1]
    assert "Attempt 1 (Reward 1.0):\nsa1\n\nAttempt 2 (Reward 0.0):\nsa2" in backend.calls[2][1]
    assert "<Existing Experiences>\n[G0]. X: old.\n[G1]. W: w.\n" in backend.calls[3][1]
    assert stats.as_dict() == {"groups": 4, "groups_used": 2, "groups_with_experiences": 2,
                               "group_update_failures": 1, "proposed_operations": 1, "batch_update_failures": 1,
                               "applied_operations": {"UPDATE": 1, "ADD": 1}}


def test_without_ground_truth_every_group_is_used_and_answers_are_redacted():
    backend = Scripted({"summary": ["s"] * 8, "group_advantage": ["no tags"] * 4})
    new, stats = _updater(backend, given_ground_truth=False).run(_groups(), {})
    assert new == {} and stats.groups_used == 4 and stats.groups_with_experiences == 0
    assert "<Ground Truth>\n[REDACTED]\n" in backend.calls[0][1]
    assert "Attempt 1 (Reward [REDACTED])" in backend.calls[2][1]


def test_batch_merge_failing_every_retry_leaves_the_library():
    backend = Scripted({"summary": ["s"] * 2, "group_advantage": ["<Experiences>1. X: x.</Experiences>"],
                        "group_update": ['[{"operation": "ADD", "content": "X: x."}]'],
                        "batch_update": ["bad"] * 3})
    new, stats = _updater(backend, retries=3).run(_groups()[:1], {"G0": "Q: q."})
    assert new == {"G0": "Q: q."} and stats.batch_update_failures == 3


def test_rule_extractor_rules():
    groups = _groups()
    new, stats = _updater(RuleExtractor()).run(groups, {"G0": "t: old.", "G1": "v: other."})
    # group A (task t) -> UPDATE G0; group D (task u) -> ADD
    assert new == {"G0": "t: the answer to 'A' is 1.", "G1": "v: other.", "G2": "u: the answer to 'D' is 4."}
    assert stats.applied_operations == {"UPDATE": 1, "ADD": 1}
    # batch merge keeps the last proposal per target
    merged = RuleExtractor().complete("", "", stage="batch_update", context={"operations": [
        {"operation": "ADD", "content": "a: 1"}, {"operation": "UPDATE", "id": "G0", "content": "b: 1"},
        {"operation": "ADD", "content": "a: 2"}]})
    assert json.loads(merged.split("```json")[-1].split("```")[0]) == [
        {"operation": "ADD", "content": "a: 2"}, {"operation": "UPDATE", "id": "G0", "content": "b: 1"}]


def test_chat_endpoint_backend_posts_the_two_turns():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from mmpo.practice.backends import build_backend

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Authorization"),
                         json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            body = json.dumps({"choices": [{"message": {"content": "<Experiences>1. A: b.</Experiences>"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        backend = build_backend({"base_url": f"http://127.0.0.1:{server.server_port}/v1", "model": "judge"})
        answer = backend.complete("sys", "usr", stage="group_advantage", context={})
    finally:
        server.shutdown()
    assert answer == "<Experiences>1. A: b.</Experiences>"
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth is None
    assert body["model"] == "judge" and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "usr"}]


def test_build_backend_refuses_unknown_specs():
    import pytest

    from mmpo.practice.backends import build_backend

    with pytest.raises(ValueError, match="extractor must be"):
        build_backend("judge")
    with pytest.raises(ValueError, match="needs the loaded policy"):
        build_backend("policy")


def test_group_size_one_never_updates_the_library_with_ground_truth():
    """The paper's G = 1 ablation: a single rollout's mean reward is 0 or 1, so no group is partially correct."""
    groups = [Group({"problem": p, "answer": "1", "task": "t"}, [p], [r]) for p, r in (("A", 1.0), ("B", 0.0))]
    backend = Scripted({})
    new, stats = _updater(backend).run(groups, {"G0": "t: kept."})
    assert new == {"G0": "t: kept."} and stats.groups_used == 0 and backend.calls == []
