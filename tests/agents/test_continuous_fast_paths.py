"""The continuous-batching decode loop's fast paths (the direct layer step, in the decode steps and the answers' chunk;
one column slice per decode step while every cache row has the same length; no gathered copy when every running row
starts a turn at once; the turn end banned in place before ``min_new_tokens``; a plain step's ids and positions from the
last step's tensors; the turns ending at one step decoded, and their answers tokenized, in one call each) change no
token: on fixed seeds the engine draws the same tokens, masks, turn counts and transcripts, and log-probs within 1e-6,
as the loop before them.

The reference below is that loop and its cache, transcribed unchanged from this repository at commit f1ae32c
(mmpo/vlm/multiturn.py: ``MultiTurnEngine._decode_continuous`` and ``_RowCache``; only renamed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from agent_envs_support import ScriptedEnvironment, VariedAnswers, VariedCrops, biased_turn_end_head
from tiny_vlm_support import build_small_text_lm, build_small_vlm
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

import mmpo.vlm.multiturn as multiturn
from mmpo.data.synthetic import make_items
from mmpo.tools.env import Environment
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.multiturn import (MultiTurnEngine, _embed_chunk, _multimodal_positions, _Trajectory,
                                completion_attention_mask)
from mmpo.vlm.rollout import HFGenerateEngine


# ---------------------------------------------------------------- the reference: commit f1ae32c, unchanged but names

def _reference_decode_continuous(self, prefilled: Mapping[str, Any], prompts: Mapping[str, Any],
                       trajectories: list[_Trajectory], envs: Sequence[Environment], *, copies: int,
                       temperature: float, top_p: float, do_sample: bool) -> None:
    """``MultiTurnEngine._decode_continuous`` at commit f1ae32c."""
    engine = self.engine
    model = engine.model
    text = getattr(model.model, "language_model", model.model)
    multimodal = text is not model.model
    backbone = model.model
    device = prefilled["input_ids"].device
    eos, pad = engine.eos_token_id, engine.pad_token_id
    forbidden = set(engine.forbidden_ids)
    attention = prefilled["attention_mask"]
    banned = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool, device=device)
    banned[engine.suppressed_token_ids() or []] = True
    banned_early = banned.clone()
    banned_early[eos] = True
    min_new_tokens = model.generation_config.min_new_tokens or 0
    warpers = [TemperatureLogitsWarper(temperature)] if do_sample and temperature != 1.0 else []
    warpers += [TopPLogitsWarper(top_p)] if do_sample and top_p < 1.0 else []
    first_limit = min(self.max_tokens_per_turn, self.max_total_tokens)
    with torch.inference_mode():
        cache = _ReferenceRowCache(prefilled["cache"], attention[:, :-1].bool(), copies=copies,
                          extra=first_limit + 1)
    # per running row: its trajectory, the tokens it feeds next (and their images), its real tokens in the cache,
    # its RoPE offset (Qwen-VL), the current turn's tokens and log-probs, and the turn's token limit
    rows = list(range(len(trajectories)))
    feed = [[int(token)] for token in prefilled["input_ids"][:, -1].tolist()]
    feed_images: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
    counts = [int(c) for c in attention[:, :-1].sum(-1).tolist()]
    deltas = [int(d) for d in backbone.rope_deltas.reshape(-1).tolist()] if multimodal else [0] * len(rows)
    turn_ids: list[list[int]] = [[] for _ in rows]
    turn_log_probs: list[list[float]] = [[] for _ in rows]
    limits = [first_limit] * len(rows)
    while rows:
        # trajectories starting a turn: the environment's answer (all but the new turn's header's last token) onto
        # their own cache rows first, in one forward over just those rows, so the step below stays one token wide
        starting = [row for row, tokens in enumerate(feed) if len(tokens) > 1]
        if starting:
            chunks = [feed[row][:-1] for row in starting]
            width = max(len(chunk) for chunk in chunks)
            ids = torch.tensor([chunk + [pad] * (width - len(chunk)) for chunk in chunks], dtype=torch.long)
            places = torch.tensor([[counts[row] + deltas[row] + k for k in range(width)] for row in starting],
                                  dtype=torch.long)
            if multimodal:
                places = places.unsqueeze(0).repeat(3, 1, 1)
                for index, row in enumerate(starting):
                    if feed_images[row]:
                        i = rows[row]
                        position, delta = _multimodal_positions(backbone, engine.processor, prompts, i,
                                                                trajectories[i], len(feed[row]))
                        places[:, index, :len(chunks[index])] = position[:, :-1]
                        deltas[row] = int(delta.reshape(-1)[0])
            with torch.inference_mode():
                ids = ids.to(device)
                hidden = _embed_chunk(model, ids, [image for row in starting for image in feed_images[row]])
                rope = text.rotary_emb(hidden, places.to(device))
                mask = cache.begin(width, starting)
                for layer in text.layers:
                    hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=None,
                                   cache=cache, use_cache=True)
                cache.advance([len(chunk) for chunk in chunks], starting)
            for row, chunk in zip(starting, chunks):
                counts[row] += len(chunk)
                feed[row], feed_images[row] = feed[row][-1:], []
            self.last_prefill_tokens += sum(len(chunk) for chunk in chunks)
        # one token per running trajectory
        ids = torch.tensor(feed, dtype=torch.long)
        places = torch.tensor([[c + d] for c, d in zip(counts, deltas)], dtype=torch.long)
        if multimodal:
            places = places.unsqueeze(0).expand(3, -1, -1)
        early = [len(turn) < min_new_tokens for turn in turn_ids]
        with torch.inference_mode():
            ids = ids.to(device)
            hidden = text.embed_tokens(ids)
            rope = text.rotary_emb(hidden, places.to(device))
            mask = cache.begin(1)
            for layer in text.layers:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=None,
                               cache=cache, use_cache=True)
            scores = model.lm_head(text.norm(hidden)[:, -1]).float()
            cache.advance([1] * len(rows))
            if any(early):
                scores = scores.masked_fill(torch.where(torch.tensor(early, device=device)[:, None],
                                                        banned_early, banned), -math.inf)
            else:
                scores = scores.masked_fill(banned, -math.inf)
            for warper in warpers:
                scores = warper(ids, scores)
            if do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)
            log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        ended = []
        for row, (token, log_prob) in enumerate(zip(tokens.tolist(), log_probs.tolist())):
            counts[row] += 1
            if token not in forbidden:  # never drawn while suppressed; should one be, it cuts the turn
                turn_ids[row].append(token)
                turn_log_probs[row].append(log_prob)
            if token in forbidden or token == eos or len(turn_ids[row]) >= limits[row]:
                trajectory = trajectories[rows[row]]
                self._add_turn(trajectory, turn_ids[row], turn_log_probs[row])
                trajectory.pending = turn_ids[row][-1:]
                ended.append(row)
            else:
                feed[row] = [token]
        if not ended:
            continue
        self._step_environments(trajectories, envs)
        keep = []
        for row in range(len(rows)):
            trajectory = trajectories[rows[row]]
            if row in ended:
                if trajectory.done:
                    continue
                feed[row], feed_images[row] = trajectory.pending, trajectory.pending_images
                trajectory.pending, trajectory.pending_images = [], []
                turn_ids[row], turn_log_probs[row] = [], []
                limits[row] = min(self.max_tokens_per_turn, self.max_total_tokens - len(trajectory.tokens))
            keep.append(row)
        if len(keep) < len(rows):
            with torch.inference_mode():
                cache.select(keep)
            rows, feed, feed_images, counts, deltas, turn_ids, turn_log_probs, limits = (
                [values[row] for row in keep] for values in (rows, feed, feed_images, counts, deltas, turn_ids,
                                                             turn_log_probs, limits))


class _ReferenceRowCache:
    """``_RowCache`` at commit f1ae32c."""

    def __init__(self, cache: Any, prompt_valid: torch.Tensor, *, copies: int, extra: int) -> None:
        """``cache``: each prompt but its last token, one row per prompt, each to become ``copies`` rows;
        ``prompt_valid`` (rows, length): the real positions of every row (the prompts' attention masks, repeated)."""
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        length = prompt_valid.shape[1]
        for layer in cache.layers:
            for source, buffers in ((layer.keys, self.keys), (layer.values, self.values)):
                rows, heads, _, dim = source.shape
                # zeros, never garbage: a masked position's value still enters attention's weighted sum (times 0)
                buffer = source.new_zeros((rows * copies, heads, length + extra, dim))
                buffer[:, :, :length].unflatten(0, (rows, copies)).copy_(source[:, :, :length].unsqueeze(1))
                buffers.append(buffer)
        device = self.keys[0].device
        self.valid = torch.zeros(prompt_valid.shape[0], length + extra, dtype=torch.bool, device=device)
        self.valid[:, :length] = prompt_valid
        self.lengths = torch.full((self.valid.shape[0],), length, dtype=torch.long, device=device)
        self.end = length  # the longest row's length
        self._write: torch.Tensor | None = None
        self._subset: torch.Tensor | None = None

    def begin(self, width: int, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Room for a chunk of ``width`` columns of ``rows`` (default: all, in order; else a forward over just those
        rows); returns its attention mask (rows, 1, width, keys): a real column of row ``r`` sees the row's real
        positions and its own chunk up to itself."""
        need = self.end + width
        if self.valid.shape[1] < need:
            grow = max(need, 2 * self.valid.shape[1])
            for buffers in (self.keys, self.values):
                for index, buffer in enumerate(buffers):
                    grown = buffer.new_zeros((*buffer.shape[:2], grow, buffer.shape[3]))
                    grown[:, :, :self.end] = buffer[:, :, :self.end]
                    buffers[index] = grown
            valid = self.valid.new_zeros((self.valid.shape[0], grow))
            valid[:, :self.end] = self.valid[:, :self.end]
            self.valid = valid
        device = self.valid.device
        columns = torch.arange(width, device=device)
        if rows is None:
            self._subset = None
            index = torch.arange(self.valid.shape[0], device=device)
            lengths, valid = self.lengths, self.valid
        else:
            index = self._subset = torch.as_tensor(list(rows), dtype=torch.long, device=device)
            lengths, valid = self.lengths[index], self.valid[index]
            need = int(lengths.max()) + width
        self._write = lengths[:, None] + columns  # (rows, width)
        self._rows = index[:, None]
        self._stop = need
        if width == 1 and rows is None:  # a decode step: each row's new position is real; it sees those
            self.valid[self._rows, self._write] = True
            return self.valid[:, None, None, :need]
        relative = torch.arange(need, device=device)[None, :] - lengths[:, None]  # (rows, keys)
        own = (relative[:, None, :] >= 0) & (relative[:, None, :] <= columns[None, :, None])
        return (valid[:, None, :need] | own).unsqueeze(1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer_idx][self._rows, :, self._write] = key_states.transpose(1, 2)
        self.values[layer_idx][self._rows, :, self._write] = value_states.transpose(1, 2)
        keys, values = self.keys[layer_idx][:, :, :self._stop], self.values[layer_idx][:, :, :self._stop]
        if self._subset is not None:
            keys, values = keys.index_select(0, self._subset), values.index_select(0, self._subset)
        return keys, values

    def advance(self, widths: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """The chunk's real columns (``widths[k]`` of its ``k``-th row) are in the cache now."""
        if self._write.shape[1] == 1 and rows is None:  # a decode step (``begin`` marked its positions)
            self.lengths = self.lengths + 1
            self.end += 1
            return
        columns = torch.arange(self._write.shape[1], device=self.valid.device)
        widths = torch.tensor(widths, device=self.valid.device)
        self.valid[self._rows, self._write] |= columns[None, :] < widths[:, None]
        if rows is None:
            self.lengths = self.lengths + widths
        else:
            self.lengths = self.lengths.index_add(0, self._rows[:, 0], widths)
        self.end = int(self.lengths.max())

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order), e.g. the trajectories still running."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.valid.device)
        self.keys = [buffer.index_select(0, index) for buffer in self.keys]
        self.values = [buffer.index_select(0, index) for buffer in self.values]
        self.valid = self.valid.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self.end = int(self.lengths.max()) if len(index) else 0


class _ReferenceEngine(MultiTurnEngine):
    _decode_continuous = _reference_decode_continuous


# ---------------------------------------------------------------- the comparison

FORCE_BIAS = 1.0e4  # the turn end's logit once min_new_tokens lets it: every other token at probability 0


def _policy(path, *, eos_bias: float, eos_row_scale: float, seed: int = 0):
    """The tiny model at ``path`` with a context-dependent, biased turn-end logit (:func:`biased_turn_end_head`)."""
    return biased_turn_end_head(*load_vlm(path), eos_bias=eos_bias, eos_row_scale=eos_row_scale, seed=seed)


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    return build_small_text_lm(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return build_small_vlm(tmp_path_factory.mktemp("vlm"))


class _Watch:
    """Counts the fast paths the engine takes: direct layer steps (decode steps and answer chunks), uniform decode
    steps (one column slice), and answer chunks run over every row in place."""

    def __init__(self, monkeypatch) -> None:
        self.direct_chunks = self.direct_steps = self.uniform_steps = self.steps = self.whole_chunks = self.chunks = 0
        step, begin = multiturn.decode_layer_step, multiturn._RowCache.begin

        def counted_step(layer, hidden, *args):
            if hidden.shape[1] == 1:
                self.direct_steps += 1
            else:
                self.direct_chunks += 1
            return step(layer, hidden, *args)

        def counted_begin(cache, width, rows=None):
            mask = begin(cache, width, rows)
            if width == 1 and rows is None:
                self.steps += 1
                self.uniform_steps += cache._column is not None
            else:
                self.chunks += 1
                self.whole_chunks += rows is None
            return mask

        monkeypatch.setattr(multiturn, "decode_layer_step", counted_step)
        monkeypatch.setattr(multiturn._RowCache, "begin", counted_begin)


def _run(engine_class, policy, task, environments, *, rows, num_samples, seed, per_turn, total, **sampling):
    model, processor = policy
    engine = engine_class(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=total,
                          max_tokens_per_turn=per_turn)
    torch.manual_seed(seed)
    rollout = engine.generate(make_items(task, rows, seed=0), environments(rows * num_samples),
                              num_samples=num_samples, **sampling)
    assert engine.last_schedule == "continuous"
    return rollout, engine


def _assert_same(new, new_engine, old, old_engine):
    assert torch.equal(new.completion_ids, old.completion_ids)
    assert torch.equal(new.completion_mask, old.completion_mask)
    assert torch.equal(completion_attention_mask(new), completion_attention_mask(old))
    difference = (new.extras["engine_log_probs"] - old.extras["engine_log_probs"]).abs().max()
    assert float(difference) <= 1e-6
    for key in ("turns", "tool_calls", "env_rewards"):
        assert torch.equal(new.extras[key], old.extras[key]), key
    assert new.texts == old.texts
    assert new_engine.last_transcripts == old_engine.last_transcripts
    assert new_engine.last_prefill_tokens == old_engine.last_prefill_tokens


CASES = {
    # name: (model, eos bias, eos row scale, min_new_tokens, environment(n), task, tokens per turn, total, sampling)
    # every turn exactly 6 tokens, every answer as long: the rows stay of one length, all start turns together
    "fixed": ("text", FORCE_BIAS, 0.0, 5, lambda n: [ScriptedEnvironment() for _ in range(n)], "long_arithmetic",
              24, 300, {}),
    # turns the model ends, answers of different lengths: rows of different lengths, some start turns alone
    "varied": ("text", 1.0, 2.0, 0, lambda n: [VariedAnswers(salt) for salt in range(n)], "long_arithmetic", 24, 300,
               {"temperature": 0.7, "top_p": 0.9}),
    # the turn end banned in some rows' first 3 tokens of a turn and not in others'
    "min_new_tokens": ("text", 1.0, 2.0, 3, lambda n: [VariedAnswers(salt) for salt in range(n)], "long_arithmetic", 24,
                       300, {}),
    # turns cut at 3 tokens, trajectories at 40: rows dropped mid-rollout
    "cut": ("text", 1.0, 2.0, 0, lambda n: [VariedAnswers(salt, 10) for salt in range(n)], "long_arithmetic", 3, 40, {}),
    # a VLM whose tool answers are images (its layers take HF's call; the cache's fast paths still apply)
    "vlm_images": ("vlm", -4.0, 2.0, 0, lambda n: [VariedCrops(salt) for salt in range(n)], "zoom", 24, 300, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_paths_draw_the_tokens_and_log_probs_of_the_loop_before_them(name, text_path, vlm_path, monkeypatch):
    kind, eos_bias, scale, min_new_tokens, environments, task, per_turn, total, sampling = CASES[name]
    policy = _policy(text_path if kind == "text" else vlm_path, eos_bias=eos_bias, eos_row_scale=scale,
                     seed=2 if kind == "vlm" else 0)
    policy[0].generation_config.min_new_tokens = min_new_tokens or None
    settings = dict(rows=2, num_samples=3, per_turn=per_turn, total=total, **sampling)
    for seed in (0, 1):
        old, old_engine = _run(_ReferenceEngine, policy, task, environments, seed=seed, **settings)
        watch = _Watch(monkeypatch)
        new, new_engine = _run(MultiTurnEngine, policy, task, environments, seed=seed, **settings)
        monkeypatch.undo()
        _assert_same(new, new_engine, old, old_engine)
        assert max(new.extras["turns"].tolist()) >= 2  # later turns ran: answers were prefilled
        assert watch.chunks >= 1
        layers = len(policy[0].model.layers) if kind == "text" else 0
        assert watch.direct_steps == layers * watch.steps  # a text LM's every layer, every step: the direct step
        assert watch.direct_chunks == layers * watch.chunks
        if name == "fixed":  # every turn 6 tokens: 3 turns, every step uniform, every chunk over all rows
            assert new.extras["turns"].tolist() == [3] * 6
            assert new.completion_mask.sum(-1).tolist() == [18] * 6
            assert watch.uniform_steps == watch.steps == 18 and watch.whole_chunks == watch.chunks == 2
        if name in ("varied", "cut"):  # rows of different lengths: the indexed writes and gathered chunks ran too
            assert watch.uniform_steps < watch.steps and watch.whole_chunks < watch.chunks


def test_answers_encoded_together_are_the_answers_encoded_one_by_one(text_path):
    """The environment answers of one step go through the tokenizer in one call: the same tokens as one call each."""
    _, processor = load_vlm(text_path)
    answers = [[{"role": "tool", "content": "result 1"}], [{"role": "tool", "content": "ok ok result 12 14"}],
               [{"role": "user", "content": "try again"}, {"role": "tool", "content": ""}],
               [{"role": "tool", "content": "x"}, {"role": "tool", "content": "y z"}]]
    together = multiturn.encode_observations(processor, answers)
    one_by_one = [multiturn.encode_observation(processor, answer) for answer in answers]
    assert together == one_by_one
    assert len({tuple(ids) for ids, _ in together}) == 4 and all(images == [] for _, images in together)
    assert multiturn.encode_observations(processor, []) == []
