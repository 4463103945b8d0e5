"""Multi-turn vs single-turn rollout cost at the same generated tokens (issue 39: at most 1.3x).

Side ``multi``: :class:`mmpo.vlm.multiturn.MultiTurnEngine` (``--schedule continuous``, the default: continuous
batching across turns; ``turns``: the turn-synchronous schedule with the KV cache kept across turns) runs
``--turns`` model turns per trajectory; a scripted environment answers every turn but the last with a short tool
message (``result k``), so the later turns also prefill the environment's tokens, the cost multi-turn adds. A turn ends at the model's
end-of-turn token (its logit raised by ``--eos-bias`` so turns are short; a turn cut by ``--tokens-per-turn``
would end the trajectory). Each rollout starts from the same seed, so every repeat draws the same tokens.
Side ``single``: the same engine's one-turn :meth:`~mmpo.vlm.rollout.HFGenerateEngine.generate` with the
end-of-turn token suppressed and ``max_new_tokens`` = the multi side's model tokens per trajectory (measured by a
probe run first), so both sides generate the same number of model tokens up to rounding (both counts recorded);
the ratios are per rollout and per generated token. Each side also counts its decoder forwards per rollout (the
prefills and the decode steps, each over the batch's active rows) and the token positions its prefills run
(:func:`count_forwards`: the prompts, and on the multi side the environment's answers): with the turn-synchronous
schedule the batch decodes each turn until its longest turn ends, so a rollout of several turns runs more sequential steps than one turn
of the same tokens; continuous batching runs 1 + the longest trajectory's model tokens.

``--mode`` picks what the single side is compared with (the multi side above unless said otherwise):

- ``mean`` (default, the comparison above): every single-turn completion has the multi side's MEAN model tokens per
  trajectory, so the multi side's spread of trajectory lengths (its longest sets its decode steps) counts against it.
- ``matched``: single-turn completion ``i`` has exactly as many model tokens as multi-turn trajectory ``i`` (same
  prompt and sample index; the probe's per-trajectory counts) through :class:`TurnEndForcing` (the end-of-turn token
  suppressed before row ``i``'s count and forced at it), so both sides have the same per-trajectory tokens and the
  same longest trajectory: the ratio is the multi-turn mechanics' cost alone, at the model-drawn length spread.
- ``fixed``: every multi-side turn is exactly ``--turn-length`` L tokens (the end-of-turn token banned through the
  generation config's ``min_new_tokens`` = L - 1 and forced at the L-th token by a logit bias of
  :data:`FORCE_BIAS`, which leaves every other token probability 0 in float32), and every single-side completion
  ``--turns`` * L tokens (the same mechanism): no length spread on either side, so the ratio isolates the cost of the
  turns themselves (answer prefills, environment steps, chat-template encoding, per-turn bookkeeping).

Each side runs in its own subprocess on the same tiny text LM (``build_tiny_text_lm``, built once), one torch
thread, ``--repeats`` timed rollouts after one warm-up; the sides alternate A B B A over ``--rounds`` rounds. The
ratio multi / single is reported per round and as the median, for wall and CPU seconds per rollout.

    python bench/bench_multiturn_cost.py --rounds 3 --out bench/records/multiturn_cost.json
    python bench/bench_multiturn_cost.py --mode matched --rounds 3 --repeats 3 --eos-bias 3
    python bench/bench_multiturn_cost.py --mode fixed --turn-length 22 --rounds 3 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

FORCE_BIAS = 1.0e4
"""The end-of-turn logit bias that forces it once ``min_new_tokens`` no longer bans it (``--mode fixed``): every other
token's probability, ``exp(-FORCE_BIAS)`` relative, is exactly 0 in float32."""


class TurnEndForcing:
    """A logits processor with a token budget per row: row ``i`` (of the batch in the engine's order, prompt
    ``i // G``, sample ``i % G``) draws exactly ``lengths[i]`` tokens, the last one ``eos_token_id``: before that
    the end-of-turn token is at -inf, at it every other token is (the end-of-turn token at 0: probability 1).
    The number drawn so far is the width of ``input_ids`` less its width at the first call (the prompt's), so
    one instance serves one ``generate`` call. Rows past their budget (already ended, padded by the engine) are
    left alone."""

    def __init__(self, eos_token_id: int, lengths: Sequence[int]) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every row needs a budget of at least 1 token, got {list(lengths)}")
        self.eos_token_id = int(eos_token_id)
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        self.start: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != len(self.lengths):
            raise ValueError(f"{input_ids.shape[0]} rows for {len(self.lengths)} budgets")
        if self.start is None:
            self.start = input_ids.shape[1]
        drawn = input_ids.shape[1] - self.start
        lengths = self.lengths.to(scores.device)
        scores = scores.clone()
        before = drawn < lengths - 1
        scores[before, self.eos_token_id] = -math.inf
        last = drawn == lengths - 1
        scores[last] = -math.inf
        scores[last, self.eos_token_id] = 0.0
        return scores


def trajectory_tokens(rollout: Any) -> list[int]:
    """Model tokens (trained tokens: the environment's are out of the mask) per trajectory of a rollout."""
    return [int(n) for n in rollout.completion_mask.sum(-1).tolist()]


class ScriptedToolEnvironment:
    """Answers each model turn with one tool message ``result k`` until ``answers`` turns were answered; the next
    turn ends the episode."""

    tools: list = []

    def __init__(self, answers: int) -> None:
        self.answers, self.steps = answers, 0

    def reset(self, row: dict[str, Any]) -> str:
        self.steps = 0
        return row["problem"]

    def step(self, assistant_message: str):
        from mmpo.tools.env import StepResult

        self.steps += 1
        if self.steps > self.answers:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"result {self.steps}"}], reward=0.0, info={"tool_calls": 1})


def ratio_summary(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per-round multi / single ratios of wall and CPU seconds per rollout and per generated token, and their medians."""
    out: dict[str, Any] = {}
    for key in ("wall_s", "cpu_s"):
        ratios = [r["multi"][key] / r["single"][key] for r in rounds]
        out[key] = {"per_round": ratios, "median": statistics.median(ratios)}
        per_token = [(r["multi"][key] / r["multi"]["generated_tokens"]) / (r["single"][key] / r["single"]["generated_tokens"])
                     for r in rounds]
        out[f"{key}_per_token"] = {"per_round": per_token, "median": statistics.median(per_token)}
    return out


def prepare_model(model: Any, *, side: str, mode: str, eos_bias: float, turns: int, turn_length: int) -> Any:
    """The model with an lm_head whose end-of-turn logit is biased for ``side`` in ``mode`` (the module docstring):
    multi ``mean`` / ``matched``: ``eos_bias`` (short turns the model ends itself); single ``mean`` / ``matched``: -40
    (one turn that runs its budget; ``matched`` forces the end through :class:`TurnEndForcing`); ``fixed``:
    :data:`FORCE_BIAS` with the generation config's ``min_new_tokens`` = L - 1 (multi) or turns * L - 1 (single),
    so a turn is exactly L (a completion turns * L) tokens."""
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    eos = model.generation_config.eos_token_id
    if mode == "fixed":
        bias = FORCE_BIAS
        model.generation_config.min_new_tokens = (turn_length if side == "multi" else turns * turn_length) - 1
    else:
        bias = eos_bias if side == "multi" else -40.0
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos] = bias
    model.lm_head = biased
    return model.eval()


def make_rollout(model: Any, processor: Any, *, side: str, mode: str, turns: int, tokens_per_turn: int,
                 prompts: int, samples: int, schedule: str = "continuous", single_tokens: int = 0,
                 single_lengths: Sequence[int] = ()) -> Any:
    """A function that runs one rollout of ``side`` (a model from :func:`prepare_model`) on ``prompts``
    long_arithmetic items x ``samples``: multi, ``turns`` model turns with a :class:`ScriptedToolEnvironment`; single,
    one turn of ``single_tokens`` tokens (``mean``), of ``single_lengths[i]`` tokens in row ``i`` (``matched``) or of
    the ``min_new_tokens`` set by :func:`prepare_model` + 1 (``fixed``)."""
    from mmpo.data.synthetic import make_items
    from mmpo.vlm.multiturn import MultiTurnEngine
    from mmpo.vlm.rollout import HFGenerateEngine

    engine = HFGenerateEngine(model, processor)
    rows = make_items("long_arithmetic", prompts, seed=0)
    multi = MultiTurnEngine(engine, max_turns=turns, max_total_tokens=10 * turns * tokens_per_turn,
                            max_tokens_per_turn=tokens_per_turn, keep_cache=True, schedule=schedule)

    def rollout():
        if side == "multi":
            envs = [ScriptedToolEnvironment(turns - 1) for _ in range(prompts * samples)]
            return multi.generate(rows, envs, num_samples=samples)
        if mode == "matched":
            return engine.generate(rows, num_samples=samples, max_new_tokens=max(single_lengths),
                                   logits_processors=[TurnEndForcing(engine.eos_token_id, single_lengths)])
        if mode == "fixed":
            return engine.generate(rows, num_samples=samples,
                                   max_new_tokens=model.generation_config.min_new_tokens + 1)
        return engine.generate(rows, num_samples=samples, max_new_tokens=single_tokens)

    return rollout


def count_forwards(model: Any) -> dict[str, int]:
    """Counts, from now on, the text decoder's forwards (``"forwards"``: a prefill, or one decode step of the batch's
    running rows) and the token positions its prefills run (``"prefill_positions"``: rows x width, padding included) at
    its rotary embedding, which every forward calls once (the lean loops run the layers themselves, not the decoder
    module). Not at a layer: a hook there would send that layer through HF's call instead of the loops' direct layer
    step (:func:`mmpo.vlm.rollout.direct_decode_layer`), on both sides."""
    counts = {"forwards": 0, "prefill_positions": 0}

    def count(module: Any, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["x"]
        counts["forwards"] += 1
        if hidden.shape[1] > 1:
            counts["prefill_positions"] += hidden.shape[0] * hidden.shape[1]

    model.model.rotary_emb.register_forward_pre_hook(count, with_kwargs=True)
    return counts


def _side(args: argparse.Namespace) -> dict[str, Any]:
    from mmpo.vlm.factory import load_vlm

    torch.set_num_threads(1)
    model, processor = load_vlm(args.model)
    model = prepare_model(model, side=args.side, mode=args.mode, eos_bias=args.eos_bias, turns=args.turns,
                          turn_length=args.turn_length)
    lengths = [int(n) for n in args.single_lengths.split(",")] if args.single_lengths else []
    rollout = make_rollout(model, processor, side=args.side, mode=args.mode, turns=args.turns,
                           tokens_per_turn=args.tokens_per_turn, prompts=args.prompts, samples=args.samples,
                           schedule=args.schedule, single_tokens=args.single_tokens, single_lengths=lengths)

    counts = count_forwards(model)
    with torch.no_grad():
        torch.manual_seed(0)
        warm = rollout()  # warm-up
        warm_forwards = counts["forwards"]
        counts.update(forwards=0, prefill_positions=0)
        walls, cpus, result = [], [], warm
        turns = float(warm.extras["turns"].float().mean()) if "turns" in warm.extras else 1.0
        for _ in range(args.repeats):
            torch.manual_seed(0)
            wall, cpu = time.perf_counter(), time.process_time()
            result = rollout()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    tokens = trajectory_tokens(result)  # model tokens per trajectory; the longest sets the decode steps
    out = {"generated_tokens": sum(tokens), "trajectories": len(tokens), "turns_mean": turns,
           "longest_trajectory_tokens": max(tokens), "trajectory_tokens": tokens}
    if not walls:  # the probe: how many model tokens the multi side generates
        return {**out, "decoder_forwards": warm_forwards}
    return {**out, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "decoder_forwards": counts["forwards"] / len(walls),
            "prefill_positions": counts["prefill_positions"] / len(walls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per side per round (median)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=64, help="a model turn's token cap")
    parser.add_argument("--eos-bias", type=float, default=2.0, help="logit bias of the end-of-turn token (multi)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt (G)")
    parser.add_argument("--schedule", choices=("continuous", "turns"), default="continuous",
                        help="the multi side's MultiTurnEngine schedule")
    parser.add_argument("--mode", choices=("mean", "matched", "fixed"), default="mean",
                        help="the single side: the multi side's mean tokens per trajectory (mean), each trajectory's "
                             "own tokens (matched), or turns x --turn-length with fixed-length multi turns (fixed)")
    parser.add_argument("--turn-length", type=int, default=22,
                        help="--mode fixed: every multi-side turn's tokens, the end-of-turn token included")
    parser.add_argument("--out", default=None, help="JSON record to write")
    parser.add_argument("--side", choices=("multi", "single"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--single-tokens", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--single-lengths", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "fixed" and not 1 <= args.turn_length <= args.tokens_per_turn:
        parser.error(f"--turn-length must be in [1, --tokens-per-turn = {args.tokens_per_turn}], got {args.turn_length}")
    if args.side:
        print(json.dumps(_side(args)))
        return 0
    from mmpo.data.synthetic import corpus
    from mmpo.vlm.factory import build_tiny_text_lm

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_text_lm(Path(tmp) / "model", corpus=corpus(["long_arithmetic"], n=50), vocab_size=400)
        common = [f"--{k}={v}" for k, v in (("turns", args.turns), ("tokens-per-turn", args.tokens_per_turn),
                                              ("prompts", args.prompts), ("samples", args.samples),
                                              ("eos-bias", args.eos_bias), ("schedule", args.schedule),
                                              ("mode", args.mode), ("turn-length", args.turn_length),
                                              ("model", model))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

        def run(side: str, repeats: int, single_tokens: int = 0, single_lengths: Sequence[int] = ()) -> dict[str, Any]:
            done = subprocess.run([sys.executable, __file__, f"--side={side}", f"--repeats={repeats}",
                                   f"--single-tokens={single_tokens}",
                                   f"--single-lengths={','.join(map(str, single_lengths))}", *common], env=env,
                                  check=True, capture_output=True, text=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        probe = run("multi", 0)
        single_tokens = max(1, round(probe["generated_tokens"] / probe["trajectories"]))
        if args.mode == "fixed":
            single_tokens = args.turns * args.turn_length
        matched = probe["trajectory_tokens"] if args.mode == "matched" else []
        print(f"multi side: {probe['generated_tokens']} model tokens over {probe['trajectories']} trajectories, "
              f"{probe['turns_mean']:.2f} turns each, the longest {probe['longest_trajectory_tokens']}; single side: "
              + (f"{matched} tokens" if matched else f"{single_tokens} tokens per trajectory"), flush=True)
        rounds = []
        load_start = os.getloadavg()
        for index in range(args.rounds):
            order = ("multi", "single", "single", "multi") if index % 2 == 0 else ("single", "multi", "multi", "single")
            runs: dict[str, list[dict[str, float]]] = {"multi": [], "single": []}
            for side in order:
                runs[side].append(run(side, args.repeats, single_tokens, matched))
            if args.mode != "mean" and runs["multi"][0]["trajectory_tokens"] != runs["single"][0]["trajectory_tokens"]:
                raise RuntimeError(f"{args.mode}: the sides' tokens per trajectory differ: multi "
                                   f"{runs['multi'][0]['trajectory_tokens']}, single {runs['single'][0]['trajectory_tokens']}")
            rounds.append({side: {key: statistics.mean(r[key] for r in results) for key in results[0]
                                  if key != "trajectory_tokens"}
                           for side, results in runs.items()})
            print(f"round {index}: " + ", ".join(f"{side} {v['wall_s']:.3f} s wall / {v['cpu_s']:.3f} s CPU "
                                                 f"({v['generated_tokens']:.0f} tokens, {v['decoder_forwards']:.0f} decoder forwards, "
                                                 f"{v['prefill_positions']:.0f} prefill positions)"
                                                 for side, v in rounds[-1].items()),
                  flush=True)
    summary = {"settings": {k: v for k, v in vars(args).items() if k not in ("side", "model", "out", "single_tokens", "single_lengths")},
               "probe": probe, "single_tokens_per_trajectory": matched or single_tokens,
               "load_average_start": load_start, "load_average": os.getloadavg(), "rounds": rounds, "ratio": ratio_summary(rounds)}
    r = summary["ratio"]
    print(f"multi / single: per rollout wall {r['wall_s']['median']:.2f}x, CPU {r['cpu_s']['median']:.2f}x; per "
          f"generated token wall {r['wall_s_per_token']['median']:.2f}x, CPU {r['cpu_s_per_token']['median']:.2f}x "
          f"(medians over rounds, --mode {args.mode}; goal <= 1.3x)")
    if args.out:
        from mmpo.files import atomic_write_json

        atomic_write_json(Path(args.out), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
