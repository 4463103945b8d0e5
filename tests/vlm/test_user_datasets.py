"""User datasets: key overrides per format, lazy image decoding, choices, query precedence,
multi-image and text-only rows through one GRPO step, and errors that name row and key."""

from __future__ import annotations

import io
import json

import PIL.Image
import pytest
from PIL import Image

from mmpo.data import BadRowError
from mmpo.data.datamodule import PromptDataModule
from mmpo.data.loaders import ColumnKeys, load_rows, open_rows
from mmpo.training.config import LossConfig, OptimConfig, RewardConfig, SamplingConfig

COLOURS = ["red", "green", "blue", "white"]


def _png(colour: str, size: int = 56) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _custom_records(n: int = 4) -> list[dict]:
    """EasyR1-style columns that no default key finds: ``task_text``, ``gold``, ``pics``."""
    return [{"uid": f"u{k}", "task_text": f"What colour is picture {k}?", "gold": COLOURS[k % 4],
             "pics": [{"bytes": _png(COLOURS[k % 4]), "path": None}]} for k in range(n)]


def _write(records: list[dict], fmt: str, tmp_path):
    """The records as a local dataset in ``fmt``: jsonl (images as PNG files), parquet, save_to_disk
    or one arrow file of a saved dataset."""
    import datasets

    if fmt == "jsonl":
        path = tmp_path / "data.jsonl"
        with path.open("w") as handle:
            for k, record in enumerate(records):
                record = dict(record)
                names = []
                for j, image in enumerate(record.pop("pics")):
                    (tmp_path / f"{k}_{j}.png").write_bytes(image["bytes"])
                    names.append(f"{k}_{j}.png")
                handle.write(json.dumps({**record, "pics": names}) + "\n")
        return path
    features = datasets.Features({"uid": datasets.Value("string"), "task_text": datasets.Value("string"),
                                  "gold": datasets.Value("string"), "pics": datasets.List(datasets.Image())})
    data = datasets.Dataset.from_list(records, features=features)
    if fmt == "parquet":
        path = tmp_path / "data.parquet"
        data.to_parquet(str(path))
        return path
    path = tmp_path / "saved"
    data.save_to_disk(str(path))
    return next(path.glob("*.arrow")) if fmt == "arrow" else path


CUSTOM_KEYS = ColumnKeys(prompt_key="task_text", answer_key="gold", image_key="pics", system_prompt="Be brief.")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk", "arrow"])
def test_key_overrides_for_each_format(tmp_path, fmt):
    path = _write(_custom_records(4), fmt, tmp_path)
    rows, stats = load_rows(path, keys=CUSTOM_KEYS)
    assert stats["loaded"] == 4 and stats["skipped"] == 0
    assert [r["id"] for r in rows] == ["u0", "u1", "u2", "u3"]
    assert rows[2]["problem"] == "What colour is picture 2?" and rows[2]["answer"] == "blue"
    assert rows[2]["system_prompt"] == "Be brief."
    assert len(rows[2]["images"]) == 1 and rows[2]["images"][0].getpixel((5, 5)) == (0, 0, 255)
    assert rows[2]["needs_image"] is True


def test_without_overrides_the_error_names_row_key_and_columns(tmp_path):
    path = _write(_custom_records(2), "jsonl", tmp_path)
    with pytest.raises(BadRowError,
                       match=r"row 0 \(id='u0'\).*prompt_key.*columns \['gold', 'pics', 'task_text', 'uid'\]"):
        load_rows(path)


@pytest.mark.parametrize("fmt", ["jsonl", "save_to_disk"])
def test_a_row_missing_the_prompt_or_answer_key_is_named(tmp_path, fmt):
    records = _custom_records(3)
    path = _write(records, fmt, tmp_path)
    with pytest.raises(BadRowError, match=r"row 0 \(id='u0'\): no column 'question' \(prompt_key\); the dataset "
                                          r"has columns \['gold', 'pics', 'task_text', 'uid'\]"):
        load_rows(path, keys=ColumnKeys(prompt_key="question", answer_key="gold", image_key="pics"))
    with pytest.raises(BadRowError, match=r"row 0 \(id='u0'\): no column 'label' \(answer_key\)"):
        load_rows(path, keys=ColumnKeys(prompt_key="task_text", answer_key="label", image_key="pics"))


def test_json_rows_without_the_image_key_are_text_only_but_a_file_without_it_is_refused(tmp_path):
    path = _write(_custom_records(2), "jsonl", tmp_path)
    with path.open("a") as handle:
        handle.write(json.dumps({"uid": "t", "task_text": "What is 2+2?", "gold": "4"}) + "\n")
    rows, _ = open_rows(path, keys=CUSTOM_KEYS)
    assert [len(r["images"]) for r in rows] == [1, 1, 0] and rows[2]["needs_image"] is False
    with pytest.raises(BadRowError, match=r"no row has the column 'picture' \(image_key\); row 0 has columns "
                                          r"\['gold', 'pics', 'task_text', 'uid'\]"):
        open_rows(path, keys=ColumnKeys(prompt_key="task_text", answer_key="gold", image_key="picture"))


def test_only_the_bad_row_is_named_when_a_later_row_lacks_the_key(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "q": "1+1?", "gold": "2"},
        {"id": "b", "text": "2+2?", "gold": "4"},
    ]))
    with pytest.raises(BadRowError, match=r"mixed.jsonl: row 1 \(id='b'\): no column 'q' \(prompt_key\); "
                                          r"the dataset has columns \['gold', 'id', 'text'\]"):
        load_rows(path, keys=ColumnKeys(prompt_key="q", answer_key="gold"))
    rows, stats = load_rows(path, keys=ColumnKeys(prompt_key="q", answer_key="gold"), skip_bad_rows=True)
    assert [r["id"] for r in rows] == ["a"] and stats["skipped"] == 1 and rows[0]["images"] == []


@pytest.fixture
def count_image_opens(monkeypatch):
    """``PIL.Image.open`` counted (the loaders' one way to decode an image)."""
    calls = []
    real_open = PIL.Image.open

    def counting_open(*args, **kwargs):
        calls.append(args[0])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(PIL.Image, "open", counting_open)
    return calls


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk"])
def test_images_are_decoded_per_batch_not_at_load(tmp_path, fmt, count_image_opens):
    path = _write(_custom_records(8), fmt, tmp_path)
    data = PromptDataModule(tasks=[], data_path=str(path), batch_size=2, prompt_key="task_text",
                            answer_key="gold", image_key="pics")
    data.setup("fit")
    assert len(data.train_rows) == 8
    assert count_image_opens == []  # 8 rows loaded, not one image opened
    batch = next(iter(data.train_dataloader()))
    assert len(count_image_opens) == 2  # one image per row of the first batch
    colours = {r["id"]: r["images"][0].getpixel((1, 1)) for r in batch}
    expected = {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
    assert colours == {f"u{k}": expected[COLOURS[k % 4]] for k in (int(i[1:]) for i in colours)}


def test_lazy_rows_decode_in_dataloader_workers(tmp_path):
    path = _write(_custom_records(4), "save_to_disk", tmp_path)
    data = PromptDataModule(tasks=[], data_path=str(path), batch_size=4, num_workers=1, prompt_key="task_text",
                            answer_key="gold", image_key="pics")
    batch = next(iter(data.train_dataloader()))
    assert sorted((r["id"], r["images"][0].getpixel((0, 0))) for r in batch) == [
        ("u0", (255, 0, 0)), ("u1", (0, 128, 0)), ("u2", (0, 0, 255)), ("u3", (255, 255, 255))]


def test_a_corrupt_image_is_named_when_its_row_is_read_or_skipped_up_front(tmp_path):
    records = _custom_records(3)
    records[1]["pics"] = [{"bytes": b"not a png", "path": None}]
    path = _write(records, "save_to_disk", tmp_path)
    rows, stats = open_rows(path, keys=CUSTOM_KEYS)
    assert stats["loaded"] == 3
    assert rows[0]["images"][0].size == (56, 56)
    with pytest.raises(BadRowError, match=r"saved: row 1 \(id='u1'\): cannot read image"):
        rows[1]
    rows, stats = open_rows(path, keys=CUSTOM_KEYS, skip_bad_rows=True)
    assert [r["id"] for r in rows] == ["u0", "u2"] and stats["skipped"] == 1


def test_missing_image_files_fail_at_load_without_decoding(tmp_path, count_image_opens):
    path = _write(_custom_records(3), "jsonl", tmp_path)
    (tmp_path / "2_0.png").unlink()
    with pytest.raises(BadRowError, match=r"row 2 \(id='u2'\): image file not found: .*2_0.png"):
        open_rows(path, keys=CUSTOM_KEYS)
    assert count_image_opens == []


def _choice_rows(tmp_path, records, **keys):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return load_rows(path, keys=ColumnKeys(**keys))[0]


def test_choices_are_lettered_in_the_prompt_and_the_gold_is_a_letter(tmp_path):
    rows = _choice_rows(tmp_path, [
        {"id": "text", "question": "How many sides has a triangle?", "choices": ["2", "3", "4"], "answer": "3"},
        {"id": "letter", "question": "Which is largest?", "choices": ["1/2", "2/3", "1/4"], "answer": "(B)"},
        {"id": "free", "question": "What is 2+2?", "choices": None, "answer": "4"},
        {"id": "inline", "question": "What is 1+1?", "choices": ["1", "2"], "answer": "2"},
    ])
    assert rows[0]["problem"] == "How many sides has a triangle?\nChoices:\n(A) 2\n(B) 3\n(C) 4"
    assert (rows[0]["answer"], rows[0]["answer_text"], rows[0]["choices"]) == ("B", "3", ["2", "3", "4"])
    assert (rows[1]["answer"], rows[1]["answer_text"]) == ("B", "2/3")
    assert rows[2]["problem"] == "What is 2+2?" and rows[2]["answer"] == "4" and "choices" not in rows[2]
    # the options' texts occur in the question, but not as a lettered list: the list is still added
    assert rows[3]["problem"] == "What is 1+1?\nChoices:\n(A) 1\n(B) 2" and rows[3]["answer"] == "B"


def test_choices_key_override_and_an_answer_that_is_no_option(tmp_path):
    rows = _choice_rows(tmp_path, [{"id": "o", "q": "Pick the colour of the sky.", "opts": '["blue", "green"]',
                                    "label": "blue"}], prompt_key="q", answer_key="label", choices_key="opts")
    assert rows[0]["problem"].endswith("Choices:\n(A) blue\n(B) green") and rows[0]["answer"] == "A"
    with pytest.raises(BadRowError, match=r"row 0 \(id='x'\): answer 'purple' is neither one of the choices "
                                          r"\['blue', 'green'\] nor a letter A-B"):
        _choice_rows(tmp_path, [{"id": "x", "question": "Sky?", "choices": ["blue", "green"], "answer": "purple"}])


MATHVISTA_QUERY = ("Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, "
                   "at the end.\nQuestion: Which color is the image?\nChoices:\n(A) red\n(B) blue\n(C) green")


def _mathvista_file(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "testmini.jsonl"
    path.write_text(json.dumps({
        "pid": "7", "question": "Which color is the image?", "image": "images/7.png",
        "choices": ["red", "blue", "green"], "answer": "blue", "question_type": "multi_choice",
        "query": MATHVISTA_QUERY, "decoded_image": {"bytes": None, "path": "images/7.png"},
    }) + "\n")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "7.png").write_bytes(_png("blue"))
    return path


def test_query_is_the_default_prompt_and_its_choices_are_not_repeated(tmp_path):
    rows, _ = load_rows(_mathvista_file(tmp_path))
    assert rows[0]["problem"] == MATHVISTA_QUERY  # the options appear once, as the publisher wrote them
    assert (rows[0]["id"], rows[0]["answer"], rows[0]["answer_text"]) == ("7", "B", "blue")
    assert rows[0]["images"][0].getpixel((0, 0)) == (0, 0, 255)
    rows, _ = load_rows(_mathvista_file(tmp_path / "q"), keys=ColumnKeys(prompt_key="question"))
    assert rows[0]["problem"] == "Which color is the image?\nChoices:\n(A) red\n(B) blue\n(C) green"


def test_the_eval_file_loader_keeps_query_and_choices(tmp_path):
    from mmpo.eval.registry import load_benchmark_rows, resolve_benchmark

    rows = load_benchmark_rows(resolve_benchmark(f"file:{_mathvista_file(tmp_path)}"))
    assert rows[0]["problem"] == MATHVISTA_QUERY and rows[0]["answer"] == "B"


def test_row_system_prompt_is_the_system_turn():
    from mmpo.vlm.processing import build_messages

    row = {"id": "s", "images": [], "problem": "2+2?", "system_prompt": "Be brief."}
    assert build_messages(row, system_prompt="model default")[0] == {"role": "system", "content": "Be brief."}
    assert build_messages({**row, "system_prompt": ""}, system_prompt="model default")[0]["role"] == "user"


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from mmpo.data import SYSTEM_PROMPT
    from mmpo.vlm.factory import build_tiny_vlm

    corpus = [SYSTEM_PROMPT, "Which picture is red? What is 2+2? <think>4</think><answer>4</answer> 0123456789"] * 20
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny"), corpus=corpus, vocab_size=350, hidden_size=64,
                              intermediate_size=128))


def test_a_two_image_row_and_a_text_only_row_train_in_one_grpo_step(tmp_path, tiny_vlm, monkeypatch):
    """One batch holds a row with two 56 px images and a text-only row; the prompts carry 2 x 4 and
    0 image tokens (56 px = 4 x 4 patches of 14 px, merged 2 x 2), and one GRPO update runs."""
    import lightning as L
    import torch

    import mmpo.vlm.rollout as rollout_module
    from mmpo.algos.grpo import GRPOModule

    for name, colour in (("a.png", "red"), ("b.png", "blue")):
        (tmp_path / name).write_bytes(_png(colour))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "two", "problem": "Which picture is red?", "images": ["a.png", "b.png"], "answer": "1"},
        {"id": "text", "problem": "What is 2+2?", "answer": "4"},
    ]))
    seen = []

    def spy(processor, rows, **kwargs):
        inputs = encode_prompts(processor, rows, **kwargs)
        tokens = (inputs["input_ids"] == processor.image_token_id).sum(-1).tolist()
        seen.append({row["id"]: n for row, n in zip(rows, tokens)})
        seen.append(inputs["image_grid_thw"].tolist())
        seen.append(processor.tokenizer.decode(inputs["input_ids"][0]))
        return inputs

    encode_prompts = rollout_module.encode_prompts
    monkeypatch.setattr(rollout_module, "encode_prompts", spy)

    class ScriptedRewards(GRPOModule):
        def compute_rewards(self, rollout):  # group 1: (1, 0), group 2: (0, 1) -> non-zero advantages
            return torch.tensor([1.0, 0.0, 0.0, 1.0]), {}

    module = ScriptedRewards(tiny_vlm, sampling=SamplingConfig(num_generations=2, max_new_tokens=3),
                             loss=LossConfig(beta=0.0), optim=OptimConfig(lr=1e-3), rewards=RewardConfig(timeout_s=None))
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    # the data's seed and system prompt differ from the module's: all hparams are logged without a clash
    data = PromptDataModule(tasks=[], data_path=str(path), batch_size=2, seed=1, system_prompt="Be brief.")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=L.pytorch.loggers.CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    assert (data.hparams["data_seed"], data.hparams["data_system_prompt"]) == (1, "Be brief.")
    assert seen[0] == {"two": 8, "text": 0}
    assert seen[1] == [[1, 4, 4], [1, 4, 4]]
    assert seen[2].count("Be brief.") == 1 and "Think step by step" not in seen[2]
    changed = [n for n, p in module.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "the GRPO step did not update any weight"


@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk"])
def test_text_only_and_two_image_rows_in_an_hf_table(tmp_path, fmt):
    records = _custom_records(3)
    records[0]["pics"] = []  # text-only
    records[1]["pics"] = records[1]["pics"] * 2  # two images
    rows, _ = open_rows(_write(records, fmt, tmp_path), keys=CUSTOM_KEYS)
    assert [rows.image_count(k) for k in range(3)] == [0, 2, 1]
    assert [len(r["images"]) for r in rows] == [0, 2, 1]
    assert [r["needs_image"] for r in rows] == [False, True, True]


EASYR1_MATH = ("{{ content | trim }} You FIRST think about the reasoning process as an internal monologue and then "
               "provide the final answer. The final answer MUST BE put in \\boxed{}.")


def test_format_prompt_wraps_each_prompt_after_its_options(tmp_path):
    template = tmp_path / "math.jinja"
    template.write_text(EASYR1_MATH)
    rows = _choice_rows(tmp_path, [{"id": "t", "question": "  Sides of a triangle?  ", "choices": ["3", "4"],
                                    "answer": "3"}], format_prompt=str(template))
    assert rows[0]["problem"] == ("Sides of a triangle?\nChoices:\n(A) 3\n(B) 4 You FIRST think about the reasoning "
                                  "process as an internal monologue and then provide the final answer. The final "
                                  "answer MUST BE put in \\boxed{}.")
    inline = _choice_rows(tmp_path, [{"id": "i", "question": "2+2?", "answer": "4"}],
                          format_prompt="Q: {{ content }}\nA:")
    assert inline[0]["problem"] == "Q: 2+2?\nA:"


def test_a_bad_format_prompt_fails_when_the_data_module_is_built(tmp_path):
    with pytest.raises(ValueError, match=r"format_prompt must use \{\{ content \}\}"):
        PromptDataModule(tasks=["arithmetic"], format_prompt="Answer in \\boxed{}.")
    with pytest.raises(ValueError, match=r"unknown: \['question'\]"):
        PromptDataModule(tasks=["arithmetic"], format_prompt="{{ content }} {{ question }}")
    with pytest.raises(FileNotFoundError, match="template file not found: .*missing.jinja"):
        PromptDataModule(tasks=["arithmetic"], format_prompt=str(tmp_path / "missing.jinja"))


def test_a_hub_parquet_folder_reads_one_split(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    for split in ("testmini", "test"):
        table = pa.table({"question": [f"{split} question?"], "answer": ["1"]})
        pq.write_table(table, tmp_path / "data" / f"{split}-00000-of-00001-5a1b.parquet")
    rows, _ = load_rows(tmp_path, split="testmini")
    assert [r["problem"] for r in rows] == ["testmini question?"]
    data = PromptDataModule(tasks=[], data_path=f"{tmp_path}@test", batch_size=1)  # EasyR1's folder@split
    data.setup("fit")
    assert [r["problem"] for r in data.train_rows] == ["test question?"]
    with pytest.raises(ValueError, match=r"splits \['test', 'testmini'\]; pass split="):
        load_rows(tmp_path)  # no train split: which one is meant must be said


def test_multiple_choice_rows_survive_save_rows_jsonl(tmp_path):
    from mmpo.data.loaders import save_rows_jsonl

    rows = _choice_rows(tmp_path, [{"id": "m", "question": "Sides of a square?", "choices": ["3", "4"],
                                    "answer": "4"}])
    again, _ = load_rows(save_rows_jsonl(rows, tmp_path / "out" / "rows.jsonl"))
    assert again == rows and again[0]["problem"].count("Choices:") == 1


def test_the_data_position_of_lazy_file_rows_resumes(tmp_path):
    path = _write(_custom_records(8), "save_to_disk", tmp_path)

    def data():
        return PromptDataModule(tasks=["arithmetic"], train_size=4, data_path=str(path), batch_size=3,
                                prompt_key="task_text", answer_key="gold", image_key="pics")

    def ids(batches):
        return [[r["id"] for r in batch] for batch in batches]

    reference = ids(data().train_dataloader())
    first = data()
    iterator = iter(first.train_dataloader())
    seen = [next(iterator) for _ in range(2)]
    state = first.state_dict()
    assert state["num_train_rows"] == 12  # 4 synthetic + 8 file rows
    resumed = data()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert ids(seen) + ids(resumed.train_dataloader()) == reference and len(reference) == 4
