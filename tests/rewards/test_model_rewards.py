"""Model rewards (mmpo.rewards.models): a reward-model checkpoint and generative judges (local and HTTP),
weighted with the other rewards by compute_rewards."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from mmpo.rewards import compute_rewards
from mmpo.rewards.models import (
    MODEL_REWARDS,
    ClassifierReward,
    JudgeReward,
    ModelRewardSpec,
    judge_prompt,
    parse_score,
    register_model_rewards,
)
from mmpo.rewards.user import validate_reward_weights

CORPUS = ["What is 2+3? <think>2+3=5</think><answer>5</answer>", "Score: 7 out of 10", "0123456789"] * 5
ROWS = [{"problem": "What is 2+3?", "answer": "5"}, {"problem": "What is 4+4?", "answer": "8"},
        {"problem": "What is 2+3?", "answer": "5"}]
TEXTS = ["<answer>5</answer>", "I think it is 9", "<think>2+3=5</think><answer>5</answer>"]


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    from mmpo.vlm.factory import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("rm"), corpus=CORPUS))


@pytest.fixture(autouse=True)
def _fresh_registry():
    MODEL_REWARDS.clear()
    yield
    MODEL_REWARDS.clear()


# ---------------------------------------------------------------------------- classifier


def _direct_scores(path: str, texts: list[str], rows: list[dict]) -> list[float]:
    """The reward model called by hand, one completion at a time (no padding): its chat template over a
    user / assistant turn, logits[0, 0] at the last token (TRL's GRPOTrainer takes logits[:, 0])."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for text, row in zip(texts, rows):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": row["problem"]},
                                              {"role": "assistant", "content": text}], tokenize=False)
        ids = tokenizer(chat, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_classifier_scores_equal_the_model_called_by_hand_in_any_batch_size(reward_model_path):
    expected = _direct_scores(reward_model_path, TEXTS, ROWS)
    assert len(set(round(e, 6) for e in expected)) == 3  # distinct texts, distinct scores: the check can fail
    for batch_size in (1, 2, 16):  # right-padded batches give the unpadded scores
        reward = ClassifierReward("rm", ModelRewardSpec(kind="classifier", path=reward_model_path,
                                                        batch_size=batch_size, device="cpu"))
        assert reward(TEXTS, ROWS).tolist() == pytest.approx(expected, abs=1e-5)


def test_classifier_is_loaded_once_and_kept_resident(reward_model_path, monkeypatch):
    settings = {"rm": {"kind": "classifier", "path": reward_model_path}}
    first = register_model_rewards(settings)["rm"]
    assert register_model_rewards(settings)["rm"] is first  # same settings: no reload
    assert first.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")  # device: auto
    bf16 = register_model_rewards({"rm": {"kind": "classifier", "path": reward_model_path, "dtype": "bfloat16",
                                          "device": "cpu"}})["rm"]
    assert bf16 is not first and next(bf16.model.parameters()).dtype == torch.bfloat16


def test_classifier_is_weighted_with_other_rewards_under_its_name(reward_model_path):
    validate_reward_weights({"format": 0.5, "rm": 2.0}, models={"rm": {"kind": "classifier",
                                                                        "path": reward_model_path}})
    scores = _direct_scores(reward_model_path, TEXTS, ROWS)
    fmt = [0.0, 0.0, 1.0]  # only the third has <think>...</think><answer>...</answer>
    total, per_fn, metrics = compute_rewards({"format": 0.5, "rm": 2.0}, TEXTS, ROWS, timeout_s=30.0)
    assert total.tolist() == pytest.approx([0.5 * f + 2.0 * s for f, s in zip(fmt, scores)], abs=1e-5)
    assert per_fn["rm"].tolist() == pytest.approx(scores, abs=1e-5)
    assert metrics["rewards/rm/mean"] == pytest.approx(sum(scores) / 3, abs=1e-5)
    assert metrics["rewards/rm/errors"] == 0.0 and metrics["rewards/rm/none_frac"] == 0.0


def test_model_reward_settings_fail_with_clear_errors(reward_model_path, tmp_path):
    with pytest.raises(ValueError, match="gives them no weight"):
        validate_reward_weights({"accuracy": 1.0}, models={"rm": {"kind": "classifier", "path": reward_model_path}})
    with pytest.raises(ValueError, match="rewards.models.rm: unknown setting"):
        register_model_rewards({"rm": {"kind": "classifier", "path": reward_model_path, "devise": "cpu"}})
    with pytest.raises(ValueError, match="cannot load a sequence classifier"):
        register_model_rewards({"rm": {"kind": "classifier", "path": str(tmp_path / "missing")}})
    with pytest.raises(ValueError, match="is a registered reward"):
        register_model_rewards({"accuracy": {"kind": "classifier", "path": reward_model_path}})
    with pytest.raises(ValueError, match="exactly one of path"):
        register_model_rewards({"j": {"kind": "judge"}})
    with pytest.raises(ValueError, match="must contain {completion}"):
        register_model_rewards({"j": {"kind": "judge", "url": "http://127.0.0.1:1", "rubric": "Rate {prompt}"}})
    with pytest.raises(ValueError, match="label_index 3"):
        register_model_rewards({"rm": {"kind": "classifier", "path": reward_model_path, "label_index": 3}})


# ---------------------------------------------------------------------------- score parsing


@pytest.mark.parametrize("reply, expected", [
    ("Good answer.\nScore: 7", 0.7),
    ("score=2.5 ... on reflection Score: **9**", 0.9),  # the last match counts
    ("Score: 10", 1.0),
    ("Score: 0", 0.0),
    ("Score: 11", None),  # out of [0, 10]
    ("Score: -1", None),
    ("I would give it a seven", None),
    ("", None),
])
def test_parse_score_hand_values(reply, expected):
    spec = ModelRewardSpec(kind="judge", url="http://127.0.0.1:1")
    assert parse_score(reply, spec) == (pytest.approx(expected) if expected is not None else None)


def test_parse_score_without_normalisation_and_custom_pattern():
    spec = ModelRewardSpec(kind="judge", url="http://127.0.0.1:1", score_pattern=r"\[\[(\d)\]\]",
                           min_score=1, max_score=5, normalize=False)
    assert parse_score("Rating: [[4]]", spec) == 4.0
    assert parse_score("Rating: [[0]]", spec) is None


def test_judge_prompt_fills_row_columns():
    rubric = "Q: {prompt}\nReference: {answer}\nA: {completion}"
    assert judge_prompt(rubric, "What is 2+3?", "5 {braces}", {"answer": "5"}) == \
        "Q: What is 2+3?\nReference: 5\nA: 5 {braces}"
    with pytest.raises(KeyError, match="no such column"):
        judge_prompt("{completion} {difficulty}", "q", "c", {"answer": "5"})


# ---------------------------------------------------------------------------- HTTP judge


class _JudgeServer:
    """An OpenAI-compatible /v1/chat/completions server on 127.0.0.1: the reply is ``Score: <n>`` where n is
    the number of characters of the graded answer (after ``Answer: ``) modulo 11; answers containing
    ``FAIL`` get HTTP 500 every time, ``FLAKY`` a 503 on its first request, ``SLOW`` a 2 s delay,
    ``GARBLE`` a reply without a score."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.seen: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append(body)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                done = False

                def release() -> None:
                    # before the reply goes out: a client thread that gets its reply may send its next request
                    # before this handler thread runs again, which must not count as one more in flight
                    nonlocal done
                    if not done:
                        done = True
                        with lock:
                            server.in_flight -= 1

                try:
                    content = body["messages"][-1]["content"]
                    text = content if isinstance(content, str) else content[-1]["text"]
                    answer = text.split("Answer: ", 1)[1].split("\n", 1)[0]
                    with lock:
                        server.seen[answer] = server.seen.get(answer, 0) + 1
                        first = server.seen[answer] == 1
                    time.sleep(0.05)
                    if "SLOW" in answer:
                        time.sleep(2.0)
                    release()
                    if "FAIL" in answer or ("FLAKY" in answer and first):
                        self.send_response(500 if "FAIL" in answer else 503)
                        self.end_headers()
                        return
                    reply = "no verdict" if "GARBLE" in answer else f"Fine.\nScore: {len(answer) % 11}"
                    data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except BrokenPipeError:  # the client gave up (its timeout) before the SLOW reply
                    pass
                finally:
                    release()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def judge_server():
    server = _JudgeServer()
    yield server
    server.close()


def _judge_rows(n: int) -> list[dict]:
    return [{"problem": f"Question {i}?", "answer": str(i)} for i in range(n)]


def test_http_judge_scores_retries_counts_failures_and_caches(judge_server):
    judge = JudgeReward("judge", ModelRewardSpec(kind="judge", url=judge_server.url, model="tiny-judge",
                                                 request_timeout_s=1.0, max_retries=2, backoff_s=0.01,
                                                 max_concurrency=2))
    texts = ["abc", "seven77", "FLAKY", "FAIL", "GARBLE", "SLOW", "abcdefghijkl"]
    scores = judge(texts, _judge_rows(len(texts)))
    # hand values: len % 11 / 10 for answered ones; FLAKY (5 chars) succeeds on its retry
    assert scores[0] == pytest.approx(0.3) and scores[1] == pytest.approx(0.7)
    assert scores[2] == pytest.approx(0.5)
    assert scores[3] is None and scores[4] is None and scores[5] is None  # 500s, no score, timeouts
    assert scores[6] == pytest.approx(0.1)  # 12 % 11 = 1
    assert judge.metrics["failed"] == 2.0 and judge.metrics["unparseable"] == 1.0
    assert judge_server.seen["FAIL"] == 3 and judge_server.seen["FLAKY"] == 2  # 1 + max_retries; 1 retry
    first = judge_server.requests[0]
    assert first["model"] == "tiny-judge" and first["temperature"] == 0.0 and first["max_tokens"] == 64
    # the same requests again: successful replies come from the cache, failures are asked again
    before = len(judge_server.requests)
    assert judge(texts[:2], _judge_rows(2)) == scores[:2]
    assert len(judge_server.requests) == before and judge.metrics["cache_hits"] == 2.0


def test_http_judge_keeps_to_its_concurrency_limit(judge_server):
    for limit in (1, 3):
        judge_server.max_in_flight = 0
        judge = JudgeReward("judge", ModelRewardSpec(kind="judge", url=judge_server.url, max_concurrency=limit))
        texts = [f"answer number {i} {limit}" for i in range(8)]  # 50 ms each on the server
        assert judge(texts, _judge_rows(8)) == [pytest.approx((len(t) % 11) / 10) for t in texts]
        assert 1 <= judge_server.max_in_flight <= limit


def test_http_judge_passes_images_as_data_urls(judge_server):
    from PIL import Image

    judge = JudgeReward("judge", ModelRewardSpec(kind="judge", url=judge_server.url, backoff_s=0.0))
    row = {"problem": "How many?", "images": [Image.new("RGB", (4, 4), "red")]}
    assert judge(["four"], [row]) == [pytest.approx(0.4)]
    content = judge_server.requests[-1]["messages"][-1]["content"]
    assert content[0]["type"] == "image_url" and content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert content[1]["text"].startswith("You are grading")


def test_http_judge_in_compute_rewards_none_is_not_applicable(judge_server):
    validate_reward_weights({"format": 1.0, "judge": 2.0},
                            models={"judge": {"kind": "judge", "url": judge_server.url, "max_retries": 0}})
    texts = ["abc", "FAIL", "<think>x</think><answer>1</answer>"]
    total, per_fn, metrics = compute_rewards({"format": 1.0, "judge": 2.0}, texts, _judge_rows(3), timeout_s=30.0)
    # judge: 3 % 11 = 3 -> 0.3; FAIL -> None; 34 chars % 11 = 1 -> 0.1; format: 0, 0, 1
    assert total.tolist() == pytest.approx([0.6, 0.0, 1.0 + 0.2])
    assert metrics["rewards/judge/mean"] == pytest.approx(0.2)
    assert metrics["rewards/judge/none_frac"] == pytest.approx(1 / 3)
    assert metrics["rewards/judge/failed"] == 1.0 and metrics["rewards/judge/errors"] == 0.0


def test_http_judge_with_no_server_scores_none_and_never_raises():
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    judge = JudgeReward("judge", ModelRewardSpec(kind="judge", url=f"http://127.0.0.1:{port}", max_retries=1,
                                                 backoff_s=0.0, request_timeout_s=0.5))
    assert judge(["a", "b"], _judge_rows(2)) == [None, None]
    assert judge.metrics["failed"] == 2.0


# ---------------------------------------------------------------------------- local judge


@pytest.fixture(scope="module")
def judge_lm_path(tmp_path_factory):
    from mmpo.vlm.factory import build_tiny_text_lm

    return str(build_tiny_text_lm(tmp_path_factory.mktemp("judge"), corpus=CORPUS, vocab_size=300,
                                  hidden_size=32, intermediate_size=64, num_layers=1))


def test_local_judge_replies_are_greedy_generations_of_the_rubric(judge_lm_path):
    from mmpo.vlm.factory import load_vlm

    spec = ModelRewardSpec(kind="judge", path=judge_lm_path, device="cpu", max_new_tokens=6, batch_size=2)
    judge = JudgeReward("local", spec)
    scores = judge(TEXTS, ROWS)
    model, processor = load_vlm(judge_lm_path)
    tokenizer = processor.tokenizer
    for text, row, reply, score in zip(TEXTS, ROWS, judge.last_replies, scores):
        prompt = judge_prompt(spec.rubric, row["problem"], text, row)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(chat, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert reply == tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert score == parse_score(reply, spec)  # an untrained judge: usually None, counted
    assert judge.metrics["unparseable"] == sum(s is None for s in scores)
    assert judge.metrics["failed"] == 0.0


def test_local_judge_parses_its_reply_into_the_reward(judge_lm_path, monkeypatch):
    judge = JudgeReward("local", ModelRewardSpec(kind="judge", path=judge_lm_path, device="cpu"))
    monkeypatch.setattr(judge.backend, "_generate_batch", lambda texts, images: ["Score: 8", "meh"][:len(texts)])
    assert judge(TEXTS[:2], ROWS[:2]) == [pytest.approx(0.8), None]
    assert judge.metrics["unparseable"] == 1.0
    judge.backend.cache.__init__(0)

    def broken(texts, images):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(judge.backend, "_generate_batch", broken)
    assert judge(["x"], ROWS[:1]) == [None] and judge.metrics["failed"] == 1.0
