"""IGPO hint construction rules (chunks, eta, stretch, free tail)."""

from __future__ import annotations

import math

import pytest
import torch

from mmpo.dllm.hints import HintConfig, build_group_hints, build_hint, chunk_trace, sample_hint_ratios


def test_chunks_have_allowed_sizes_and_a_short_tail_is_dropped():
    config = HintConfig(min_chunk=5, max_chunk=10, free_tail=0)
    for seed in range(30):
        chunks = chunk_trace(47, config, torch.Generator().manual_seed(seed))
        assert chunks[0][0] == 0
        for (s0, e0), (s1, _) in zip(chunks, chunks[1:]):
            assert e0 == s1  # consecutive, left to right
        assert all(5 <= end - start <= 10 for start, end in chunks)
        assert 47 - chunks[-1][1] < 5  # only a piece shorter than min_chunk is left over
    # 12 tokens with chunk size exactly 5: [0,5), [5,10); the 2-token tail is never revealed.
    assert chunk_trace(12, HintConfig(min_chunk=5, max_chunk=5)) == [(0, 5), (5, 10)]


def test_eta_is_sorted_and_in_range():
    config = HintConfig(eta_low=0.2, eta_high=0.6)
    eta = sample_hint_ratios(8, config, torch.Generator().manual_seed(0))
    assert eta.shape == (8,)
    assert torch.all(eta[1:] >= eta[:-1])
    assert bool(((eta >= 0.2) & (eta <= 0.6)).all())


def test_stretched_positions_follow_the_formula():
    # Trace of 9 tokens, chunks of exactly 3: [0,3), [3,6), [6,9). L = 17, free tail 4 -> hint area 13,
    # stretch s = clip(13 / 9, 1, 1.5) = 1.444. eta = 0.5 hides floor(3 * 0.5) = 1 chunk.
    trace = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    config = HintConfig(min_chunk=3, max_chunk=3, free_tail=4)
    s = 13 / 9
    expected = {
        # middle hidden: first at floor(0 * s) = 0; second after a gap of 3 -> 3 + floor(3 * s) = 3 + 4 = 7
        "middle": {0: 10, 1: 11, 2: 12, 7: 16, 8: 17, 9: 18},
        # first hidden: first revealed starts at floor(3 * s) = 4; the next is contiguous (gap 0)
        "first": {4: 13, 5: 14, 6: 15, 7: 16, 8: 17, 9: 18},
        # last hidden: [0,3) and [3,6) stay contiguous at 0
        "last": {0: 10, 1: 11, 2: 12, 3: 13, 4: 14, 5: 15},
    }
    assert math.floor(3 * s) == 4
    seen = set()
    for seed in range(40):
        tokens, mask = build_hint(trace, 17, 0.5, config, torch.Generator().manual_seed(seed))
        got = {int(i): int(tokens[i]) for i in torch.nonzero(mask).flatten()}
        case = next(name for name, want in expected.items() if want == got)
        seen.add(case)
        assert not mask[13:].any()  # the free tail is never hinted
    assert seen == set(expected)


def test_stretch_is_capped_and_hints_are_truncated_at_the_hint_area():
    trace = list(range(10, 16))  # 6 tokens, one chunk of 6
    config = HintConfig(min_chunk=6, max_chunk=6, free_tail=0, max_stretch=1.5)
    tokens, mask = build_hint(trace, 40, 1.0, config)
    # s = clip(40 / 6, 1, 1.5) = 1.5; the only chunk starts at floor(0 * 1.5) = 0.
    assert torch.nonzero(mask).flatten().tolist() == [0, 1, 2, 3, 4, 5]
    # A trace longer than the hint area is cut to it: L = 8, free tail 3 -> 5 positions, chunk [0,5) of 5.
    config = HintConfig(min_chunk=5, max_chunk=5, free_tail=3)
    tokens, mask = build_hint(list(range(10, 22)), 8, 1.0, config)
    assert tokens[mask].tolist() == [10, 11, 12, 13, 14]
    assert not mask[5:].any()


def test_trace_free_tail_never_reveals_the_end_of_the_trace():
    trace = list(range(10, 22))  # 12 tokens; the last 4 (say, the answer line) stay hidden
    config = HintConfig(min_chunk=4, max_chunk=4, free_tail=0, max_stretch=1.5, trace_free_tail=4)
    tokens, mask = build_hint(trace, 18, 1.0, config)
    # revealable prefix: 8 tokens = 2 chunks; the stretch still uses the whole trace: s = 18 / 12 = 1.5
    # chunk [0, 4) -> 0..3; chunk [4, 8): previous end 4 + floor(0 * 1.5) -> 4..7
    assert torch.nonzero(mask).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert tokens[mask].tolist() == list(range(10, 18))
    assert not (set(tokens[mask].tolist()) & set(range(18, 22)))
    # the default (0) is the official rule: with eta = 1 the whole trace is revealed
    _, mask = build_hint(trace, 18, 1.0, HintConfig(min_chunk=4, max_chunk=4, free_tail=0, max_stretch=1.0))
    assert int(mask.sum()) == 12
    # nothing revealable: no hints
    _, mask = build_hint(trace, 18, 1.0, HintConfig(min_chunk=4, max_chunk=4, free_tail=0, trace_free_tail=12))
    assert not mask.any()


def test_reveal_count_follows_eta():
    trace = list(range(20, 40))  # 20 tokens -> 5 chunks of 4
    config = HintConfig(min_chunk=4, max_chunk=4, free_tail=0)
    for eta, revealed_chunks in ((0.2, 5 - math.floor(5 * 0.8)), (0.6, 5 - math.floor(5 * 0.4)), (1.0, 5)):
        _, mask = build_hint(trace, 20, eta, config, torch.Generator().manual_seed(0))
        assert int(mask.sum()) == 4 * revealed_chunks  # 5 - 4 = 1, 5 - 2 = 3, 5 chunks


def test_group_hints_shapes_and_monotone_hint_amount():
    trace = list(range(3, 43))
    tokens, mask, eta = build_group_hints(trace, 8, 64, HintConfig(free_tail=8), torch.Generator().manual_seed(0))
    assert tokens.shape == mask.shape == (8, 64) and eta.shape == (8,)
    assert torch.all(eta[1:] >= eta[:-1])
    assert not mask[:, 56:].any()


def test_bad_hint_settings_fail_clearly():
    with pytest.raises(ValueError, match="min_chunk"):
        HintConfig(min_chunk=6, max_chunk=5)
    with pytest.raises(ValueError, match="eta"):
        HintConfig(eta_low=0.7, eta_high=0.6)
