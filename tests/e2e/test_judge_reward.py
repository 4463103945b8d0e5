"""Generative judges as rewards (``judge:FILE.yaml``, mmpo.rewards.judge) against an OpenAI-compatible server on
the loopback address started here: scores parsed from the replies, retries after failures, the per-request
timeout, the concurrency limit, the cache; unparseable or failed judgements are None and counted, never a crash;
a local judge model; configs/vlm/grpo_tiny_judge.yaml trains 2 steps through `mmpo fit` with a judge."""

from __future__ import annotations

import csv
import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tiny_vlm_support import build_small_text_lm, tiny_grpo_fit_args

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.data.synthetic import corpus
from mmpo.rewards import compute_rewards
from mmpo.rewards.judge import Judge, JudgeConfig, load_judge_config, parse_score
from mmpo.rewards.user import RewardSpecError, validate_reward_weights
from mmpo.vlm.factory import build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
RUBRIC = "Problem: {problem}\nReference: {answer}\nAnswer: {completion}\nGive Score: 0-10."


class FakeJudgeServer:
    """/v1/chat/completions: the reply is chosen by the completion text inside the prompt:
    'good' -> 'Score: 9', 'bad' -> 'Score: 2', 'rambling' -> no score, 'flaky' -> HTTP 503 twice then 'Score: 5',
    'slow' -> answers after 2 s, anything else -> 'Score: 6'. Counts requests per completion and the most requests
    in flight at once."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                completion = re.findall(r"(?i)answer: (.*)\n", prompt)[-1]  # the rubric's last "answer:" line
                with server.lock:
                    server.requests[completion] = server.requests.get(completion, 0) + 1
                    count = server.requests[completion]
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    time.sleep(0.05)
                    if completion.startswith("flaky") and count <= 2:
                        self.send_response(503)
                        self.end_headers()
                        return
                    if completion.startswith("slow"):
                        time.sleep(2.0)
                    words = completion.split()
                    reply = {"good": "Reasoning... Score: 9", "bad": "Score: 2", "rambling": "I cannot say.",
                             "flaky": "Score: 5", "slow": "Score: 8"}.get(words[0] if words else "", "Score: 6")
                    data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def server():
    fake = FakeJudgeServer()
    yield fake
    fake.close()


def _config(server, **overrides) -> JudgeConfig:
    settings = dict(backend="openai", model="judge-model", url=server.url, rubric=RUBRIC, scale=10.0, retries=2,
                    backoff_s=0.01, timeout_s=1.0, concurrency=2, name="tiny_judge")
    settings.update(overrides)
    return JudgeConfig(**settings)


def test_parse_score_reads_the_last_match_and_scales():
    assert parse_score("Score: 3 ... final Score: 7.5", JudgeConfig.score_pattern, 10.0) == pytest.approx(0.75)
    assert parse_score("no number here", JudgeConfig.score_pattern, 10.0) is None
    assert parse_score("[[8]]", r"\[\[(\d+)\]\]", 10.0) == pytest.approx(0.8)


def test_openai_judge_scores_retries_times_out_and_counts(server):
    judge = Judge(_config(server))
    rows = [{"problem": f"p{i}", "answer": "4"} for i in range(6)]
    texts = ["good one", "bad one", "rambling one", "flaky one", "slow one", "good two"]
    scores = judge(texts, rows)
    # good 9/10, bad 2/10, rambling unparsed -> None, flaky: two 503s then 5/10, slow: past the 1 s timeout on all
    # three attempts -> None
    assert scores == [pytest.approx(0.9), pytest.approx(0.2), None, pytest.approx(0.5), None, pytest.approx(0.9)]
    call = judge.last_call
    assert (call.requests, call.failed, call.unparsed, call.cached) == (6, 1, 1, 0)
    assert server.requests["flaky one"] == 3 and server.requests["slow one"] == 3
    # the cache: the same completions again are not sent again (the failed one is retried)
    before = dict(server.requests)
    again = judge(texts[:4], rows[:4])
    assert again == scores[:4] and server.requests == before and judge.last_call.cached == 4


def test_the_concurrency_limit_holds(server):
    judge = Judge(_config(server, concurrency=2))
    texts = [f"good {i}" for i in range(8)]
    assert judge(texts, [{"problem": "p", "answer": "1"}] * 8) == [pytest.approx(0.9)] * 8
    assert server.max_in_flight == 2  # 8 requests of 50 ms through 2 workers: never more than 2 at once


def test_a_judge_reward_joins_the_sum_with_none_left_out(server, tmp_path):
    path = tmp_path / "tiny_judge.yaml"
    path.write_text(yaml.safe_dump({"backend": "openai", "model": "m", "url": server.url, "rubric": RUBRIC,
                                    "scale": 10.0, "timeout_s": 1.0, "retries": 0}))
    rows = [{"problem": "2+2?", "answer": "4"}] * 3
    texts = ["good <answer>4</answer>", "rambling <answer>5</answer>", "bad <answer>4</answer>"]
    spec = f"judge:{path}"
    total, per_fn, metrics = compute_rewards({spec: 1.0, "accuracy": 1.0}, texts, rows, timeout_s=10.0)
    assert total.tolist() == pytest.approx([1.9, 0.0, 1.2])  # the unparsed judgement adds nothing
    assert math.isnan(float(per_fn[spec][1]))
    assert metrics["rewards/tiny_judge/none_frac"] == pytest.approx(1 / 3)
    assert metrics["rewards/tiny_judge/unparsed"] == 1.0 and metrics["rewards/tiny_judge/failed"] == 0.0
    assert metrics["rewards/tiny_judge/mean"] == pytest.approx(0.55)


def test_bad_judge_files_fail_before_anything_runs(tmp_path):
    cases = {
        "missing.yaml": (None, "no judge file"),
        "bad_backend.yaml": ({"backend": "grpc", "model": "m", "rubric": "{completion}"}, "backend must be"),
        "no_url.yaml": ({"backend": "openai", "model": "m", "rubric": "{completion}"}, "needs a url"),
        "no_slot.yaml": ({"backend": "local", "model": "m", "rubric": "rate it"}, "must contain {completion}"),
        "extra.yaml": ({"backend": "local", "model": "m", "rubric": "{completion}", "colour": 1}, "unknown setting"),
        "no_group.yaml": ({"backend": "local", "model": "m", "rubric": "{completion}", "score_pattern": "x"},
                          "needs a group"),
    }
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(yaml.safe_dump(content))
        with pytest.raises(RewardSpecError, match=message):
            validate_reward_weights({f"judge:{tmp_path / name}": 1.0})


def test_a_local_judge_model_runs_and_unreadable_replies_are_none(tmp_path, monkeypatch):
    """A tiny random text LM as the judge: its replies carry no score, so every judgement is None and counted;
    with its generate scripted, the scores are read from the replies."""
    judge = Judge(JudgeConfig(backend="local", model=build_small_text_lm(tmp_path / "judge"), rubric=RUBRIC,
                              max_tokens=4, name="local_judge"))
    rows = [{"problem": "2+2?", "answer": "4"}] * 2
    assert judge(["<answer>4</answer>", "<answer>5</answer>"], rows) in ([None, None],)
    assert judge.last_call.unparsed == 2 and judge.last_call.failed == 0
    engine = judge._backend._engine
    seen = []

    def scripted(judged, **kwargs):
        seen.extend(judged)
        return type("R", (), {"texts": ["Score: 10" if "4</answer>" in j["problem"] else "Score: 1" for j in judged]})()

    monkeypatch.setattr(engine, "generate", scripted)
    assert judge(["<answer>4</answer> again", "<answer>5</answer> again"], rows) == [pytest.approx(10.0),
                                                                                   pytest.approx(1.0)]
    assert seen[0]["problem"] == RUBRIC.format(problem="2+2?", answer="4", completion="<answer>4</answer> again")


def test_grpo_tiny_judge_config_trains_two_steps(server, tmp_path):
    tiny = build_tiny_vlm(tmp_path / "tiny", corpus=[SYSTEM_PROMPT, *corpus(["count_shapes", "arithmetic"], n=20)],
                          vocab_size=400, hidden_size=64, intermediate_size=128)
    config = yaml.safe_load((REPO / "configs" / "judges" / "tiny_rubric.yaml").read_text())
    config.update(backend="openai", url=server.url, model="judge-model", timeout_s=2.0)
    judge_file = tmp_path / "tiny_rubric.yaml"
    judge_file.write_text(yaml.safe_dump(config))
    args = tiny_grpo_fit_args(REPO / "configs" / "vlm" / "grpo_tiny_judge.yaml", str(tiny), tmp_path,
                              f'--model.init_args.rewards.weights={{"accuracy": 0.9, "format": 0.1, '
                              f'"judge:{judge_file}": 0.5}}')
    assert main(args) == 0
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = [r for r in csv.DictReader(path.open()) if r.get("rewards/tiny_rubric/none_frac")]
    assert len(rows) == 2
    for row in rows:  # the tiny model's completions are none of the scripted words: every reply is 'Score: 6'
        assert float(row["rewards/tiny_rubric/mean"]) == pytest.approx(0.6)
        assert float(row["rewards/tiny_rubric/none_frac"]) == 0.0 and float(row["rewards/tiny_rubric/failed"]) == 0.0
