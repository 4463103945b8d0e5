"""Scripted multi-turn environments for the agent tests (shared by name: tests/ is on sys.path, see conftest.py)."""

from __future__ import annotations

from mmpo.tools.env import StepResult
from mmpo.tools.image_zoom import crop_region


class ScriptedEnvironment:
    """Answers every model turn with one tool message ``result k`` (reward 0.5) until ``answers`` turns were answered;
    the next turn ends the episode (reward 1)."""

    tools: list = []

    def __init__(self, answers: int = 2) -> None:
        self.answers = answers
        self.steps = 0

    def reset(self, row):
        self.steps = 0
        return row["problem"]

    def step(self, assistant_message: str) -> StepResult:
        self.steps += 1
        if self.steps > self.answers:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"result {self.steps}"}], reward=0.5,
                          info={"tool_calls": 1})


class VariedAnswers(ScriptedEnvironment):
    """:class:`ScriptedEnvironment` whose answers differ in length and text between trajectories (``salt``)."""

    def __init__(self, salt: int, answers: int = 2) -> None:
        super().__init__(answers)
        self.salt = salt

    def step(self, assistant_message):
        result = super().step(assistant_message)
        for message in result.observation:
            message["content"] = "ok " * self.salt + message["content"] + f" {7 * self.salt}"
        return result


def biased_turn_end_head(model, processor, *, eos_bias: float, eos_row_scale: float, seed: int = 0):
    """Gives ``model`` an lm_head whose turn-end logit is biased by ``eos_bias`` and depends on the context (a random
    extra weight row, scaled by ``eos_row_scale``), so that greedy turns end after different numbers of tokens in
    different trajectories; vision tokens at -40 (suppressed anyway). Returns (model in eval mode, processor)."""
    import torch

    from mmpo.vlm.processing import vision_token_ids

    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos] = eos_bias
        row = torch.randn(head.in_features, generator=torch.Generator().manual_seed(seed))
        biased.weight[eos] += row * eos_row_scale
        biased.bias[vision_token_ids(processor)] = -40.0
    model.lm_head = biased
    return model.eval(), processor


class ZoomingEnvironment:
    """Answers the first two model turns with crops of the row's image (112 x 112, then 224 x 112)."""

    tools: list = []

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, row):
        self.steps = 0
        self.images = row["images"]
        return row["problem"]

    def step(self, assistant_message: str) -> StepResult:
        self.steps += 1
        if self.steps > 2:
            return StepResult([], done=True)
        crop = crop_region(self.images, [0, 0, 112 * self.steps, 112])
        return StepResult([{"role": "tool", "content": [{"type": "image", "image": crop}]}], info={"tool_calls": 1})


class VariedCrops(ZoomingEnvironment):
    """:class:`ZoomingEnvironment` whose crops differ between trajectories (``salt`` shifts and widens the box)."""

    def __init__(self, salt: int) -> None:
        super().__init__()
        self.salt = salt

    def step(self, assistant_message: str) -> StepResult:
        self.steps += 1
        if self.steps > 2:
            return StepResult([], done=True)
        crop = crop_region(self.images, [28 * self.salt, 0, 28 * self.salt + 112 * self.steps + 56 * (self.salt % 2),
                                         112])
        return StepResult([{"role": "tool", "content": [{"type": "image", "image": crop}]}], info={"tool_calls": 1})


def agent_fit_args(config, base, tmp_path, *overrides: str) -> list[str]:
    """``mmpo fit`` arguments for 2 steps of an agent ``config`` from the model at ``base`` under ``tmp_path`` (logs in
    ``tmp_path / "logs"``): 8 training rows, 2 prompts a batch, one validation batch at step 2, a checkpoint at step 2
    (``overrides`` last)."""
    logs = tmp_path / "logs"
    return ["fit", "-c", str(config), f"--trainer.default_root_dir={logs}", f"--trainer.logger.init_args.save_dir={logs}",
            f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
            "--trainer.callbacks.init_args.every_n_train_steps=2", "--trainer.max_steps=2",
            "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false", "--data.init_args.train_size=8", "--data.init_args.val_size=2",
            "--data.init_args.batch_size=2", f"--model.init_args.model_path={base}",
            f"--model.init_args.output_dir={tmp_path / 'out'}", *overrides]


def trainer_segment_entropies(model, rollout, *, temperature: float, vocab_size: int, top_k: int = 10,
                              window: int = 20, suppressed=()) -> list[list[float]]:
    """ARPO's entropy of every model turn of every trajectory (:func:`mmpo.algos.arpo.top_logprob_entropy`) from the
    training forward over prompt + conversation: at each of a turn's first ``window`` positions the top ``top_k``
    log-probs of softmax(logits / temperature) with the ``suppressed`` ids (a VLM's vision tokens) at -inf, and the
    sampled token's."""
    import torch

    from mmpo.algos.arpo import top_logprob_entropy
    from mmpo.vlm.logprobs import completion_hidden_states
    from mmpo.vlm.rollout import completion_attention_mask

    attention = completion_attention_mask(rollout)
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout.prompt_inputs, rollout.completion_ids, attention)
        logits = model.get_output_embeddings()(hidden).float() / temperature
        logits[..., list(suppressed)] = float("-inf")
        log_probs = torch.log_softmax(logits, -1)
    out = []
    for i in range(len(rollout.completion_ids)):
        trained = (rollout.completion_mask[i] * attention[i]).tolist()
        turns, start = [], None
        for position, flag in enumerate(trained + [0]):
            if flag and start is None:
                start = position
            elif not flag and start is not None:
                top = []
                for t in range(start, min(position, start + window)):
                    values, indices = log_probs[i, t].topk(top_k)
                    entry = dict(zip(indices.tolist(), values.tolist()))
                    token = int(rollout.completion_ids[i, t])
                    entry.setdefault(token, float(log_probs[i, t, token]))
                    top.append(entry)
                turns.append(top_logprob_entropy(top, window=window, vocab_size=vocab_size))
                start = None
        out.append(turns)
    return out
