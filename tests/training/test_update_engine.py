"""The update engine (mmpo/training/update.py) and the variants written once against it
(mmpo/training/variants.py), on hand-computed values; and the shape it promises: one clip and one
optimizer-step site, no module overriding training_step."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from mmpo.core import Aggregation
from mmpo.training.nonfinite import NonFiniteGuard, NonFiniteGuardMixin
from mmpo.training.step_state import StepState
from mmpo.training.update import (
    CoreLossSpec,
    MicroLoss,
    PassContext,
    ScoredMicroBatch,
    UpdateEngine,
    UpdateSchedule,
    core_loss_parts,
    micro_batch_metrics,
    total_loss,
)
from mmpo.training.variants import LengthBands, SlowFastUpdate

REPO = Path(__file__).resolve().parents[2]


class Toy(NonFiniteGuardMixin, torch.nn.Module):
    """Two scalar weights, each with its own SGD (lr 1): an actor and a critic, outside a Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = torch.nn.Parameter(torch.tensor([0.0]))
        self.critic = torch.nn.Parameter(torch.tensor([0.0]))
        self.nonfinite = NonFiniteGuard(3)
        self._optimizers = [torch.optim.SGD([self.actor], lr=1.0), torch.optim.SGD([self.critic], lr=1.0)]

    def optimizers(self):
        return self._optimizers

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def test_schedule_walks_in_order_or_by_the_seeded_permutation():
    in_order = UpdateSchedule(5, 2, epochs=2, shuffle=False)
    assert [(e, i.tolist()) for e, i in in_order.minibatches()] == [
        (0, [0, 1]), (0, [2, 3]), (0, [4]), (1, [0, 1]), (1, [2, 3]), (1, [4])]
    dropped = UpdateSchedule(5, 2, drop_last=True, shuffle=False)
    assert [i.tolist() for _, i in dropped.minibatches()] == [[0, 1], [2, 3]]
    assert UpdateSchedule(3, 10, shuffle=False).minibatches_per_epoch == 1  # clamped to the batch
    expected = torch.randperm(4, generator=torch.Generator().manual_seed(7)).tolist()
    shuffled = [i.tolist() for _, i in UpdateSchedule(4, 4).minibatches(torch.Generator().manual_seed(7))]
    assert shuffled == [expected]
    with pytest.raises(ValueError):
        UpdateSchedule(0, 1)


def test_core_loss_parts_hand_computed():
    # PPO, ratio 1 (log pi = log pi_old), token-mean over 3 tokens: policy = -mean(A) = -(2 + 2 - 1) / 3
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    scored = ScoredMicroBatch(log_probs, log_probs.detach(), torch.tensor([2.0, -1.0]), mask,
                              ref_log_probs=log_probs.detach() - 1.0, entropy=torch.full((2, 2), 0.3))
    parts, metrics = core_loss_parts(scored, CoreLossSpec("ppo", beta=0.1, entropy_coef=0.5), Aggregation("token-mean"))
    assert float(parts["policy"]) == pytest.approx(-1.0)
    # k3 with log(ref / pi) = -1 on every token: e^-1 - (-1) - 1 = e^-1
    assert float(parts["kl"]) == pytest.approx(math.exp(-1.0))
    assert float(parts["entropy"]) == pytest.approx(0.3)
    loss, named = total_loss(parts, parts.__class__().add("bonus", torch.tensor(2.0), 0.25))
    assert float(loss) == pytest.approx(-1.0 + 0.1 * math.exp(-1.0) - 0.5 * 0.3 + 0.5)
    assert sorted(named.metrics()) == ["losses/bonus", "losses/entropy", "losses/kl", "losses/policy"]
    assert metrics["policy/clipfrac"] == 0.0
    # without a reference the KL part is logged as 0 with coefficient 0 (never summed)
    bare, _ = core_loss_parts(ScoredMicroBatch(log_probs, log_probs.detach(), torch.tensor([2.0, -1.0]), mask),
                              CoreLossSpec("ppo"), Aggregation("token-mean"))
    assert float(bare["kl"]) == 0.0 and bare.coefficient("kl") == 0.0 and float(bare.total()) == pytest.approx(-1.0)


def test_optimizer_step_accumulates_scales_clips_per_group_and_steps_the_chosen_optimizers():
    toy = Toy()
    engine = UpdateEngine(toy, max_grad_norm=1.0, clip_groups=lambda: [[toy.actor], [toy.critic]])
    # two micro-batches, loss_scale 2: grads actor 2 * (3 + 1) = 8, critic 2 * (-0.5) = -1
    micro = [(3.0, 0.0), (1.0, -0.5)]
    result = engine.optimizer_step(
        micro, lambda m: MicroLoss(m[0] * toy.actor.sum() + m[1] * toy.critic.sum(), {"n": 1.0}), loss_scale=2.0)
    # the total norm before clipping is sqrt(8^2 + 1^2); each group is clipped to norm 1 and stepped (lr 1)
    assert result.metrics["policy/grad_norm"] == pytest.approx(math.sqrt(65.0))
    assert result.metrics["n"] == 2.0 and result.applied
    assert float(toy.actor) == pytest.approx(-1.0, rel=1e-5) and float(toy.critic) == pytest.approx(1.0, rel=1e-5)
    # only the critic's optimizer steps: the actor stays
    engine.optimizer_step([None], lambda _: MicroLoss(toy.actor.sum() + toy.critic.sum()), stepped=[toy.optimizers()[1]])
    assert float(toy.actor) == pytest.approx(-1.0, rel=1e-5) and float(toy.critic) == pytest.approx(0.0, abs=1e-5)


def test_a_non_finite_loss_changes_nothing_and_is_counted():
    toy = Toy()
    engine = UpdateEngine(toy, max_grad_norm=None)
    result = engine.optimizer_step([None], lambda _: MicroLoss(toy.actor.sum() * float("nan") + toy.critic.sum()))
    assert not result.applied and toy.nonfinite.skipped_steps == 1
    assert float(toy.actor) == 0.0 and float(toy.critic) == 0.0


def test_run_pass_stops_when_told():
    seen = []
    history = UpdateEngine(Toy(), max_grad_norm=None).run_pass(
        UpdateSchedule(4, 1, shuffle=False), lambda e, i: seen.append(int(i)) or {"kl": float(i)},
        stop=lambda m: m["kl"] >= 1)
    assert seen == [0, 1] and history == [{"kl": 0.0}, {"kl": 1.0}]


def test_slow_fast_wrapper_is_the_papers_composition():
    weight = torch.nn.Parameter(torch.tensor([0.0]))

    def plain() -> list[dict[str, float]]:  # one "pass" adds 1 to the weight
        with torch.no_grad():
            weight.add_(1.0)
        return [{"entropy": 2.0}]

    ensured = []
    wrapper = SlowFastUpdate(inner_steps=2, alpha=0.5, zscore_window=2)
    stats = wrapper.wrap(plain, lambda: [weight], PassContext(mean_entropy=lambda s: s[0]["entropy"],
                                                              ensure_old_log_probs=lambda: ensured.append(1)))
    # K = 2 fast passes: 0 -> 2; reposition 0 + 0.5 (2 - 0) = 1; slow pass: 2
    assert float(weight) == 2.0 and ensured == [1]
    assert stats == [{"entropy": 2.0, "sfpo/active": 1.0}]
    assert wrapper.state_dict()["entropies"] == [2.0]
    # a critic warm-up is the plain pass, untouched
    assert wrapper.wrap(plain, lambda: [weight], PassContext(trains_actor=False)) == [{"entropy": 2.0}]
    assert float(weight) == 3.0
    with pytest.raises(ValueError, match="sfpo_alpha"):
        SlowFastUpdate(alpha=0.0)


def test_length_bands_hand_computed():
    # four groups of two, mean lengths 2, 4, 6, 8: Q(0.3) = 3.8, Q(0.65) = 5.9, Q(0.95) = 7.7 -> keep 2 and 6
    lengths = torch.tensor([1.0, 3.0, 4.0, 4.0, 6.0, 6.0, 8.0, 8.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep, metrics = LengthBands()(lengths, group_ids, None)
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    assert metrics == {"lspo/dropped_groups": 2.0, "lspo/kept_frac": 0.5}
    with pytest.raises(ValueError, match="lspo_low"):
        LengthBands(0.7, 0.6)


def test_step_state_collects_in_order():
    state = StepState(step=3, rows=[])
    state.collect("a", 1)
    state.collect("a", 2)
    assert state.collected("a") == [1, 2] and state.collected("b") == []


def _python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in (REPO / folder).rglob("*.py")]


def test_one_clip_site_and_one_optimizer_step_site_for_policy_updates():
    """Gradient clipping and optimizer steps of the RL families happen only in the update engine (supervised
    modules, SFT / BC / DPO, run under Lightning's automatic optimisation and do neither by hand)."""
    clip, step = [], []
    for path in _python_files("mmpo"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                where = f"{path.relative_to(REPO)}:{node.lineno}"
                if node.func.attr in ("clip_grad_norm_", "clip_gradients"):
                    clip.append(where)
                if node.func.attr == "step" and "opt" in ast.unparse(node.func.value).lower():
                    step.append(where)
    assert [c.split(":")[0] for c in clip] == ["mmpo/training/update.py"]
    # the engine's optimizer steps (and the guard's automatic-optimisation closure); the TAROT testbed also fits
    # its own style / topic encoders and its attacker classifier, and the TAPO testbed fine-tunes its weak start
    # (supervised tools of a benchmark, not a policy update)
    assert {s.split(":")[0] for s in step} == {"mmpo/training/update.py", "mmpo/training/nonfinite.py",
                                               "mmpo/rewards/tarot_testbed.py", "mmpo/algos/tapo_testbed.py"}


def test_every_family_builds_its_optimizer_in_one_place():
    """AdamW is constructed only by mmpo/training/optim.py; each configure_optimizers calls it."""
    sites = []
    for path in _python_files("mmpo"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("AdamW"):
                sites.append(str(path.relative_to(REPO)))
    assert set(sites) == {"mmpo/training/optim.py"}


def test_make_optimizer_drops_frozen_parameters_and_keeps_group_settings():
    from mmpo.training.optim import make_adamw, make_optimizer

    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(2))
    head = torch.nn.Parameter(torch.ones(1))
    optimizer = make_adamw([{"params": [frozen, trained]}, {"params": [head], "lr": 0.5, "weight_decay": 0.0}],
                           lr=0.1, weight_decay=0.01)
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 1]
    assert optimizer.param_groups[0]["params"][0] is trained
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"]) == (0.1, 0.5)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0 and optimizer.defaults["fused"] is None
    built = make_optimizer([trained], lr=1.0, warmup_steps=4)
    # linear warm-up: the first step already trains at lr / warmup_steps
    assert built["optimizer"].param_groups[0]["lr"] == 0.25
    with pytest.raises(ValueError, match="needs a positive total_steps"):
        make_optimizer([trained], lr=1.0, schedule="cosine")


@pytest.mark.parametrize("fused", [True, False])
def test_every_optimizer_step_bumps_the_parameters_versions(fused):
    """The vLLM engine syncs when the parameters' version counters moved (mmpo.vlm.vllm_engine). torch's fused
    AdamW writes them without bumping the counters (the control); make_adamw's optimizer bumps them on every
    step, fused or not, and its update equals the plain fused kernel's."""
    from mmpo.training.optim import make_adamw

    torch.manual_seed(0)
    start, grad = torch.randn(5), torch.randn(5)
    raw = torch.nn.Parameter(start.clone())
    plain = torch.optim.AdamW([raw], lr=0.1, weight_decay=0.0, fused=fused)
    ours = torch.nn.Parameter(start.clone())
    optimizer = make_adamw([ours], lr=0.1, fused=fused)
    assert optimizer.defaults["fused"] is (True if fused else None)
    for step in range(2):
        raw.grad, ours.grad = grad.clone(), grad.clone()
        before_raw, before_ours = raw._version, ours._version
        plain.step()
        optimizer.step()
        assert ours._version > before_ours
        assert (raw._version > before_raw) is (not fused)  # the control: fused leaves the counter alone
    assert torch.equal(ours.detach(), raw.detach()) and not torch.equal(ours.detach(), start)


def test_no_rl_module_overrides_training_step():
    from mmpo.algos import grpo  # noqa: F401  (imports register nothing; the classes are walked below)
    import mmpo.algos
    import mmpo.dllm.variants  # noqa: F401
    import mmpo.robotics.gaussian_ppo  # noqa: F401
    import mmpo.robotics.sfpo  # noqa: F401
    import importlib
    import pkgutil

    from mmpo.algos.grpo import GRPOModule
    from mmpo.dllm.rl import DiffuGRPO
    from mmpo.robotics.dppo import DPPOModule

    for info in pkgutil.iter_modules(mmpo.algos.__path__):
        importlib.import_module(f"mmpo.algos.{info.name}")
    for base in (GRPOModule, DiffuGRPO, DPPOModule):
        subclasses, todo = [], list(base.__subclasses__())
        while todo:
            cls = todo.pop()
            subclasses.append(cls)
            todo.extend(cls.__subclasses__())
        assert subclasses, base
        offenders = [c.__qualname__ for c in subclasses
                     if c.__module__.startswith("mmpo.") and c.training_step is not base.training_step]
        assert offenders == [], f"{base.__name__} subclasses override training_step: {offenders}"


def test_global_normalisers_in_one_process():
    engine = UpdateEngine(Toy(), max_grad_norm=None)
    tokens, sequences = engine.global_normalisers(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))
    assert (float(tokens), float(sequences), engine.world_size) == (3.0, 2.0, 1)


def test_micro_batch_metrics_hand_computed():
    """Parts unweighted, the extra parts' weighted sum, the total, the core means x the token share; the
    ratio's extremes only for a step of one micro-batch."""
    from mmpo.core import LossParts

    parts = LossParts().add("policy", torch.tensor(0.5)).add("kl", torch.tensor(0.2), 0.1)
    extra = LossParts().add("epo", torch.tensor(0.3), -2.0)
    loss, named = total_loss(parts, extra)
    core = {"policy/clipfrac": torch.tensor(0.25), "policy/ratio_min": 0.9, "rollout_is/max": 3.0}
    metrics = micro_batch_metrics(named, loss, core, weight=0.4, extra=extra)
    assert metrics == pytest.approx({"losses/policy": 0.5, "losses/kl": 0.2, "losses/epo": 0.3,
                                     "losses/extra": -0.6, "losses/total": 0.5 + 0.02 - 0.6,
                                     "policy/clipfrac": 0.1})
    single = micro_batch_metrics(parts, parts.total(), core, single_micro_batch=True)
    assert single == pytest.approx({"losses/policy": 0.5, "losses/kl": 0.2, "losses/total": 0.52,
                                    "policy/clipfrac": 0.25, "policy/ratio_min": 0.9, "rollout_is/max": 3.0})


def test_micro_batch_metrics_summed_by_the_engine_equal_the_whole_minibatchs():
    """Two micro-batches (3 and 1 loss tokens) under global normalisers: the engine's sums of their metrics
    are the metrics of the one big batch (loss parts and the token-weighted clip fraction)."""
    from mmpo.core import LossParts

    log_probs = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.0, -1.0]])
    old = torch.tensor([[-1.5, -0.5, -1.0], [-0.1, -1.0, -1.0]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    spec = CoreLossSpec("ppo", {"clip_low": 0.2, "clip_high": 0.2})

    def metrics_of(rows, aggregation, weight):
        scored = ScoredMicroBatch(log_probs[rows], old[rows], advantages[rows], mask[rows])
        parts, core = core_loss_parts(scored, spec, aggregation)
        loss, named = total_loss(parts, LossParts())
        return micro_batch_metrics(named, loss, core, weight=weight)

    whole = metrics_of([0, 1], Aggregation("token-mean"), 1.0)
    split = Aggregation("token-mean", torch.tensor(4.0), torch.tensor(2.0))
    first, second = metrics_of([0], split, 3 / 4), metrics_of([1], split, 1 / 4)
    summed = {key: first[key] + second[key] for key in first}
    # hand values: ratios e^0.5, 1, e^-1 (A = +1) and e^-0.2 (A = -1), clip 0.2: only e^0.5 takes the
    # clipped term (-1.2 > -e^0.5), so clipfrac = 1/4 and the loss = (-1.2 - 1 - e^-1 + e^-0.2) / 4
    assert summed["policy/clipfrac"] == pytest.approx(0.25, abs=1e-7) == whole["policy/clipfrac"]
    expected_loss = (-1.2 - 1.0 - math.exp(-1.0) + math.exp(-0.2)) / 4
    assert summed["losses/policy"] == pytest.approx(expected_loss, abs=1e-6)
    assert whole["losses/policy"] == pytest.approx(expected_loss, abs=1e-6)
    assert summed["losses/total"] == pytest.approx(whole["losses/total"], abs=1e-7)
    assert summed["policy/approx_kl"] == pytest.approx(whole["policy/approx_kl"], abs=1e-7)
    assert "policy/ratio_max" not in summed  # extremes do not sum over micro-batches


def test_every_family_builds_its_step_metrics_with_the_engines_helper():
    """Each policy-gradient family builds its ``losses/*`` / ``policy/*`` with micro_batch_metrics, and no module
    that hands the engine a MicroLoss (SAC's DSRL included) spells ``losses/total`` or ``losses/policy`` itself."""
    builders = []
    for path in _python_files("mmpo"):
        source = path.read_text()
        if "MicroLoss(" in source and not path.name == "update.py":
            builders.append(str(path.relative_to(REPO)))
            if "policy_loss(" in source or "core_loss_parts(" in source or "igpo_loss_parts(" in source:
                assert "micro_batch_metrics(" in source, path
            for node in ast.walk(ast.parse(source)):  # no hand-built {"losses/total": ...} or sums["losses/total"]
                keys = node.keys if isinstance(node, ast.Dict) else [node.slice] if isinstance(node, ast.Subscript) else []
                spelled = {k.value for k in keys if isinstance(k, ast.Constant)}
                assert not spelled & {"losses/total", "losses/policy"}, (path, node.lineno, spelled)
    assert {"mmpo/algos/grpo.py", "mmpo/dllm/rl.py", "mmpo/robotics/dppo.py"} <= set(builders)
