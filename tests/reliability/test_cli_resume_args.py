"""``mmpo fit --ckpt_path``: the config and command line win over the checkpoint's hyperparameters.

Before: LightningCLI replaced the model arguments with the checkpoint's, so a resumed run
ignored ``--model.init_args.optim.lr 0.5`` and exported into the checkpoint's ``output_dir``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from mmpo.cli import main
from mmpo.data import SYSTEM_PROMPT
from mmpo.training.export_guard import MARKER_NAME, OutputDirInUseError
from mmpo.vlm.factory import build_tiny_vlm

REPO = Path(__file__).resolve().parents[2]
CORPUS = [SYSTEM_PROMPT, "How many shapes? <think>3 shapes.</think><answer>3</answer> left right 0123456789"] * 20


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=CORPUS, vocab_size=350, hidden_size=64,
                          intermediate_size=128)


def _fit_grpo(model: Path, root: Path, max_steps: int, *extra: str) -> None:
    main([
        "fit", "-c", str(REPO / "configs/vlm/grpo_tiny.yaml"), f"--model.init_args.model_path={model}",
        f"--model.init_args.output_dir={root / 'out'}", "--model.init_args.sampling.max_new_tokens=4",
        "--model.init_args.sampling.num_generations=2", f"--trainer.max_steps={max_steps}",
        f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0",
        f"--trainer.callbacks.init_args.dirpath={root / 'ckpt'}", "--trainer.callbacks.init_args.every_n_train_steps=1",
        "--data.init_args.train_size=8", "--data.init_args.batch_size=2", *extra,
    ])


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_vlm_resume_keeps_command_line_lr_and_config_output_dir(tiny_vlm, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    _fit_grpo(tiny_vlm, first, 1)
    first_export = (first / "out" / "model.safetensors").read_bytes()
    run_id = (first / "out" / MARKER_NAME).read_text()
    capsys.readouterr()

    _fit_grpo(tiny_vlm, second, 2, "--model.init_args.optim.lr=0.5", f"--ckpt_path={first / 'ckpt' / 'last.ckpt'}")
    err = capsys.readouterr().err
    assert "  model.init_args.optim.lr: checkpoint=0.0001 now=0.5" in err.splitlines()
    assert f"  model.init_args.output_dir: checkpoint='{first / 'out'}' now='{second / 'out'}'" in err.splitlines()

    resumed = _load(second / "ckpt" / "last.ckpt")
    assert resumed["global_step"] == 2  # it resumed (one more step), not restarted
    assert resumed["hyper_parameters"]["optim"]["lr"] == 0.5
    assert resumed["optimizer_states"][0]["param_groups"][0]["lr"] == 0.5  # the optimizer really used 0.5
    assert resumed["lr_schedulers"][0]["base_lrs"] == [0.5]
    # the export went to the configured directory; the first run's export is untouched
    assert (second / "out" / "model.safetensors").is_file()
    assert (first / "out" / "model.safetensors").read_bytes() == first_export
    # same run (id kept in the checkpoint), so the resumed run may write its own export dir again
    assert (second / "out" / MARKER_NAME).read_text() == run_id


@pytest.mark.slow
def test_vlm_resume_changing_the_group_size_is_refused_before_training(tiny_vlm, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    _fit_grpo(tiny_vlm, first, 1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _fit_grpo(tiny_vlm, second, 2, "--model.init_args.sampling.num_generations=3",
                  f"--ckpt_path={first / 'ckpt' / 'last.ckpt'}")
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"mmpo fit: error: cannot resume from {first / 'ckpt' / 'last.ckpt'}: "
                           "model.init_args.sampling.num_generations (checkpoint=2 now=3) must stay as in the checkpoint")
    assert not (second / "ckpt").exists()  # nothing trained


@pytest.mark.slow
def test_another_runs_export_dir_is_refused_unless_overwrite(tiny_vlm, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _fit_grpo(tiny_vlm, first, 1)
    export = (first / "out" / "model.safetensors").read_bytes()
    owner = (first / "out" / MARKER_NAME).read_text()
    with pytest.raises(OutputDirInUseError, match="holds the export of another run"):
        _fit_grpo(tiny_vlm, second, 1, f"--model.init_args.output_dir={first / 'out'}")
    # refused before the first step: no checkpoint written (the run-directory lock may have made the folder)
    assert not list((second / "ckpt").glob("*.ckpt"))
    assert (first / "out" / "model.safetensors").read_bytes() == export
    _fit_grpo(tiny_vlm, second, 1, f"--model.init_args.output_dir={first / 'out'}",
              "--model.init_args.overwrite_output=true")
    assert (first / "out" / MARKER_NAME).read_text() != owner  # asked for: the new run owns the directory now


# ------------------------------------------------------------------ generic: any LightningModule


class TinyRegressor(L.LightningModule):
    """y = w.x with AdamW and a linear warm-up, for cheap CLI resumes."""

    def __init__(self, hidden: int = 4, lr: float = 0.1, warmup_steps: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TinyData(L.LightningDataModule):
    """16 fixed regression rows, 4 per batch."""

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(16, 3, generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(-1)), batch_size=4)


def _fit_tiny(root: Path, max_steps: int, *extra: str) -> None:
    main([
        "fit", f"--model={__name__}.TinyRegressor", f"--data={__name__}.TinyData", f"--trainer.max_steps={max_steps}",
        f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.accelerator=cpu",
        "--trainer.callbacks=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.init_args.dirpath={root / 'ckpt'}", "--trainer.callbacks.init_args.save_last=true",
        *extra,
    ])


def test_scheduled_lr_takes_the_new_base_and_keeps_its_place_in_the_schedule(tmp_path, capsys):
    _fit_tiny(tmp_path / "a", 2)
    _fit_tiny(tmp_path / "b", 3, "--model.init_args.lr=0.5", f"--ckpt_path={tmp_path / 'a' / 'ckpt' / 'last.ckpt'}")
    assert "  model.init_args.lr: checkpoint=0.1 now=0.5" in capsys.readouterr().err.splitlines()
    resumed = _load(tmp_path / "b" / "ckpt" / "last.ckpt")
    assert resumed["global_step"] == 3
    # warm-up factor after 3 scheduler steps is 4/4 = 1; with the old base the lr would be 0.1
    assert resumed["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.5)
    assert resumed["lr_schedulers"][0]["base_lrs"] == [0.5]
    assert resumed["lr_schedulers"][0]["last_epoch"] == 3  # the schedule continued, it did not restart


def test_a_shape_changing_argument_is_one_clear_error_before_training(tmp_path, capsys):
    _fit_tiny(tmp_path / "a", 1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _fit_tiny(tmp_path / "b", 2, "--model.init_args.hidden=8", f"--ckpt_path={tmp_path / 'a' / 'ckpt' / 'last.ckpt'}")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "  model.init_args.hidden: checkpoint=4 now=8" in err
    assert err[-1].startswith(f"mmpo fit: error: cannot resume from {tmp_path / 'a' / 'ckpt' / 'last.ckpt'}: the "
                              "configured model does not match the checkpoint's weights (layer.0.weight "
                              "checkpoint=[4, 3] now=[8, 3]; layer.0.bias checkpoint=[4] now=[8]; "
                              "layer.1.weight checkpoint=[1, 4] now=[1, 8])")
    assert not (tmp_path / "b" / "ckpt").exists()


def test_differences_and_resume_conflicts_per_key():
    from mmpo.training.resume_args import fixed_args_for, hparam_differences, resume_conflicts

    saved = {"_class_path": "mmpo.algos.grpo.GRPOModule", "model_path": "a", "lr": 1e-4, "_instantiator": "x"}
    now = {"class_path": "mmpo.algos.papo.PAPOModule", "init_args": {"model_path": "a", "lr": 0.5}}
    differences = hparam_differences(saved, now, "model")
    assert differences == [("model.class_path", "mmpo.algos.grpo.GRPOModule", "mmpo.algos.papo.PAPOModule"),
                           ("model.init_args.lr", 1e-4, 0.5)]
    # a subclass inherits its base's fixed arguments; a class change always conflicts
    assert fixed_args_for("mmpo.algos.papo.PAPOModule") >= {"model_path", "sampling.num_generations"}
    assert resume_conflicts(differences, {"model_path"}) == differences[:1]


def test_config_groups_are_compared_field_by_field():
    """A config group (mmpo.training.config, saved as a dict) differs per field, and a fixed field of a
    group (``sampling.num_generations``) is a conflict while its other fields are not."""
    from mmpo.training.resume_args import fixed_args_for, hparam_differences, resume_conflicts

    saved = {"_class_path": "mmpo.algos.grpo.GRPOModule", "model_path": "a",
             "sampling": {"num_generations": 2, "temperature": 1.0}, "optim": {"lr": 1e-4, "mu": 1}}
    now = {"class_path": "mmpo.algos.grpo.GRPOModule",
           "init_args": {"model_path": "a", "sampling": {"num_generations": 3, "temperature": 0.7},
                         "optim": {"lr": 1e-4, "mu": 1}}}
    differences = hparam_differences(saved, now, "model")
    assert differences == [("model.init_args.sampling.num_generations", 2, 3),
                           ("model.init_args.sampling.temperature", 1.0, 0.7)]
    fixed = fixed_args_for("mmpo.algos.grpo.GRPOModule")
    assert resume_conflicts(differences, fixed) == differences[:1]


def test_dllm_export_refuses_another_runs_save_dir(tmp_path):
    """The masked-diffusion modules claim ``save_dir`` the same way (shared ExportOwnershipMixin)."""
    from mmpo.dllm.modeling import TinyMaskPredictorConfig, build_tiny_mask_predictor, save_mask_predictor
    from mmpo.dllm.rl import DiffuGRPO
    from mmpo.dllm.task import ArithmeticTaskConfig, corpus
    from mmpo.dllm.tokenizer import train_char_tokenizer

    tokenizer = train_char_tokenizer(corpus(ArithmeticTaskConfig(), size=50))
    model = build_tiny_mask_predictor(tokenizer, TinyMaskPredictorConfig(hidden_size=16, num_layers=1, num_heads=2,
                                                                         intermediate_size=32, max_positions=64))
    save_mask_predictor(model, tokenizer, tmp_path / "start")
    first = DiffuGRPO(model_path=str(tmp_path / "start"), warmup_config=None, save_dir=str(tmp_path / "out"))
    first.export()
    owner = (tmp_path / "out" / MARKER_NAME).read_text()
    first.export()  # its own directory: fine
    second = DiffuGRPO(model_path=str(tmp_path / "start"), warmup_config=None, save_dir=str(tmp_path / "out"))
    with pytest.raises(OutputDirInUseError, match="holds the export of another run"):
        second.export()
    assert (tmp_path / "out" / MARKER_NAME).read_text() == owner
    DiffuGRPO(model_path=str(tmp_path / "start"), warmup_config=None, save_dir=str(tmp_path / "out"),
              overwrite_output=True).export()
    assert (tmp_path / "out" / MARKER_NAME).read_text() != owner


@pytest.mark.slow
def test_a_checkpoint_with_the_old_flat_arguments_resumes_and_keeps_its_group_size(tiny_vlm, tmp_path, capsys):
    """A checkpoint written before the typed configs (flat ``num_generations``, ``lr``, ...): resuming it with
    the same settings lists no difference in them; changing its group size is refused as before."""
    from mmpo.training.checkpoint import atomic_torch_save
    from mmpo.training.legacy_hparams import flat_to_grouped_for

    first = tmp_path / "first"
    _fit_grpo(tiny_vlm, first, 1)
    last = first / "ckpt" / "last.ckpt"
    checkpoint = _load(last)
    grouped = checkpoint["hyper_parameters"]
    rows = flat_to_grouped_for(grouped["_class_path"])
    groups = {group for group, _ in rows.values()}
    hparams = {k: v for k, v in grouped.items() if k not in groups}  # back to the old form
    hparams.update({old: grouped[group][field] for old, (group, field) in rows.items()
                    if field in (grouped.get(group) or {})})
    assert hparams["num_generations"] == 2 and "sampling" not in hparams
    checkpoint["hyper_parameters"] = hparams
    atomic_torch_save(checkpoint, last, keep_previous=False)
    capsys.readouterr()

    with pytest.raises(SystemExit):
        _fit_grpo(tiny_vlm, tmp_path / "changed", 2, "--model.init_args.sampling.num_generations=3", f"--ckpt_path={last}")
    assert "model.init_args.sampling.num_generations (checkpoint=2 now=3)" in capsys.readouterr().err

    second = tmp_path / "second"
    _fit_grpo(tiny_vlm, second, 2, f"--ckpt_path={last}")
    err = capsys.readouterr().err
    # none of the moved settings is reported as changed (fields added since, e.g. optim.betas, are "not set")
    moved = {f"model.init_args.{group}.{field}:" for group, field in rows.values()
             if group in ("sampling", "optim", "loss")}
    assert not [line for line in err.splitlines() if line.strip().split(" ")[0] in moved]
    assert "  model.init_args.optim.betas: checkpoint=(not set) now=[0.9, 0.999]" in err.splitlines()
    assert _load(second / "ckpt" / "last.ckpt")["global_step"] == 2
