"""Config mistakes end in exactly one final line naming the key and the bad value, exit code 2.

Before: jsonargparse printed the cause mid-output (under 60 lines of usage, or inside a
traceback) and ended with "Expected a <class 'NoneType'>" and a dump of the whole Namespace.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmpo.cli import main
from mmpo.data.datamodule import PromptDataModule
from mmpo.training.cli_errors import describe_parse_error

REPO = Path(__file__).resolve().parents[2]
GRPO = ["fit", "-c", str(REPO / "configs/vlm/grpo_tiny.yaml"), "--trainer.logger=false"]
IGPO = ["fit", "-c", str(REPO / "configs/dllm/igpo_tiny.yaml"), "--trainer.logger=false",
        "--model.init_args.warmup_config=null"]


@pytest.mark.parametrize(("argv", "last_line"), [
    (GRPO + ["--model.init_args.optim.lr", "abc"], "mmpo fit: error: model.init_args.optim.lr: 'abc' is not a float"),
    (GRPO + ["--model.init_args.loss.clip_low=x"], "mmpo fit: error: model.init_args.loss.clip_low: 'x' is not a float (or null)"),
    (GRPO + ["--data.init_args.batch_size=two"], "mmpo fit: error: data.init_args.batch_size: 'two' is not an int"),
    (GRPO + ["--trainer.max_steps=1.5"], "mmpo fit: error: trainer.max_steps: '1.5' is not an int"),
    (GRPO + ["--model.init_args.model_path=null"],
     "mmpo fit: error: model.init_args.model_path: required but missing or null"),
    (GRPO + ["--model.init_args.num_gens=4"], "mmpo fit: error: model.init_args.num_gens: unknown option"),
    # a config group's own check (mmpo.training.config.SamplingConfig), then the module's
    (GRPO + ["--model.init_args.sampling.num_generations=-1"],
     "mmpo fit: error: model (mmpo.algos.grpo.GRPOModule): num_generations must be >= 1, got -1"),
    (GRPO + ["--model.init_args.sampling.num_generations=1"],
     "mmpo fit: error: model (mmpo.algos.grpo.GRPOModule): num_generations must be >= 2 "
     "(advantage estimator 'grpo' needs a group of 2), got 1"),
    (GRPO + ["--model.init_args.sampling.num_gens=4"],
     "mmpo fit: error: model: cannot use class_path 'mmpo.algos.grpo.GRPOModule': unrecognized arguments: "
     "--sampling.num_gens=4"),
    (GRPO + ["--model.init_args.model_path="],
     "mmpo fit: error: model (mmpo.algos.grpo.GRPOModule): model path is empty (''): give a saved HF model directory"),
    (IGPO + ["--model.init_args.group_size=-1"],
     "mmpo fit: error: model (mmpo.dllm.rl.DiffuGRPO): group_size must be >= 2 for group-relative advantages, got -1"),
])
def test_bad_config_ends_in_one_line_with_the_key_and_value(argv, last_line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == last_line
    assert "Namespace(" not in err and "NoneType" not in err and "Traceback" not in err


def test_data_module_constructor_error_names_the_data_class(tmp_path, capsys):
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.vlm.factory import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "tiny", corpus=[SYSTEM_PROMPT] * 5, vocab_size=300, hidden_size=32,
                           intermediate_size=64)
    with pytest.raises(SystemExit) as exit_info:
        main(GRPO + [f"--model.init_args.model_path={model}", "--data.init_args.batch_size=-1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mmpo fit: error: data (mmpo.data.datamodule.PromptDataModule): batch_size must be >= 1, got -1")


def test_union_and_class_path_errors_are_read_from_jsonargparse_reports():
    nested = """Parser key "trainer.callbacks":
  Does not validate against any of the Union subtypes
  Subtypes: [list[lightning.pytorch.callbacks.callback.Callback], <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning.pytorch.callbacks.ModelCheckpoint':
        Parser key "every_n_train_steps":
          Does not validate against any of the Union subtypes
          Subtypes: [<class 'int'>, <class 'NoneType'>]
          Errors:
            - Expected a <class 'int'>
            - Expected a <class 'NoneType'>
          Given value type: <class 'str'>
          Given value: x
    - Problem with given class_path 'lightning.Callback':
        Option 'every_n_train_steps' is not accepted
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='every_n_train_steps', val='x')"""
    assert describe_parse_error(nested) == "trainer.callbacks.init_args.every_n_train_steps: 'x' is not an int (or null)"
    bad_class = """Parser key "model":

  - Expected a path but mmpo.algos.nope.X either not accessible or invalid
  - Does not validate against any of the Union subtypes
  Errors:
    - Problem with given class_path 'mmpo.algos.nope.X':
        module 'mmpo.algos' has no attribute 'nope'
    - Expected a <class 'NoneType'>"""
    assert describe_parse_error(bad_class) == (
        "model: cannot use class_path 'mmpo.algos.nope.X': module 'mmpo.algos' has no attribute 'nope'")
    assert describe_parse_error("unrecognized arguments: --bogus") == "unrecognized arguments: --bogus"


def test_data_path_without_rows_warns_that_only_synthetic_data_is_used(tmp_path, caplog):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    data = PromptDataModule(tasks=["arithmetic"], train_size=4, val_size=0, data_path=str(empty))
    with caplog.at_level(logging.WARNING, logger="mmpo.data.datamodule"):
        data.build()
    assert len(data.train_rows) == 4  # the synthetic rows only
    assert [r.getMessage() for r in caplog.records] == [
        f"{empty} (train): no rows loaded (0 in the file, 0 skipped); using the synthetic tasks ['arithmetic'] only"]


def test_empty_data_path_string_is_an_error_not_the_current_folder():
    with pytest.raises(ValueError, match=r"data_path is empty \(''\); give a dataset path or null for none"):
        PromptDataModule(tasks=["arithmetic"], data_path="")
