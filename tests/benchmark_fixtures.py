"""Fixture files in benchmark publishers' exact schemas, shared by the eval tests (tests/ is on sys.path)."""

import io

import datasets
from PIL import Image

S = datasets.Value("string")


def png(color=(200, 30, 30), size=(28, 28)) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def write_parquet(columns: dict, features: dict, path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).to_parquet(str(path))


MATHVISTA_FEATURES = {
    "pid": S, "question": S, "image": S, "decoded_image": datasets.Image(), "choices": datasets.List(S),
    "unit": S, "precision": datasets.Value("float64"), "answer": S, "question_type": S, "answer_type": S,
    "metadata": {"category": S, "context": S, "grade": S, "img_height": datasets.Value("int64"),
                 "img_width": datasets.Value("int64"), "language": S, "skills": datasets.List(S), "source": S,
                 "split": S, "task": S},
    "query": S,
}


def mathvista_dir(tmp_path):
    meta = {"category": "math-targeted-vqa", "context": "geometry diagram", "grade": "high school",
            "img_height": 28, "img_width": 28, "language": "english", "skills": ["geometry reasoning"],
            "source": "Geometry3K", "split": "testmini", "task": "geometry problem solving"}
    columns = {
        "pid": ["1", "2", "3", "4"],
        "question": ["How many sides?", "What is the ratio?", "How long is AB?", "Which years?"],
        "image": [f"images/{i}.jpg" for i in range(1, 5)],
        "decoded_image": [png(), png((0, 90, 0)), png((0, 0, 200)), png()],
        "choices": [["3", "4", "5"], None, None, None],
        "unit": [None, None, "cm", None],
        "precision": [None, 2.0, None, None],
        "answer": ["4", "1.45", "12", "[2007, 2008]"],
        "question_type": ["multi_choice", "free_form", "free_form", "free_form"],
        "answer_type": ["text", "float", "integer", "list"],
        "metadata": [meta, {**meta, "task": "figure question answering"}, meta, {**meta, "task": "textbook question answering"}],
        "query": [
            "Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.\n"
            "Question: How many sides?\nChoices:\n(A) 3\n(B) 4\n(C) 5",
            "Hint: Please answer the question requiring a floating-point number with two decimal places and "
            "provide the final value, e.g., 1.23, 1.34, 1.45, at the end.\nQuestion: What is the ratio?",
            "Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, "
            "3, at the end.\nQuestion: How long is AB? (Unit: cm)",
            "Hint: Please answer the question requiring a Python list as an answer and provide the final list, "
            "e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.\nQuestion: Which years?",
        ],
    }
    write_parquet(columns, MATHVISTA_FEATURES,
                  tmp_path / "MathVista" / "data" / "testmini-00000-of-00001-725687bf7a18d64b.parquet")
    return tmp_path


MATHVERSE_FEATURES = {
    "sample_index": S, "problem_index": S, "problem_version": S, "question": S, "image": datasets.Image(),
    "answer": S, "question_type": S,
    "metadata": {"split": S, "source": S, "subject": S, "subfield": S},
    "query_wo": S, "query_cot": S, "question_for_eval": S,
}


def mathverse_dir(tmp_path):
    meta = {"split": "testmini", "source": "GeoQA", "subject": "Plane Geometry", "subfield": "Angle"}
    question = "As shown in the figure, angle 1 = 30°, find angle 2.\nChoices:\nA:30°\nB:60°\nC:90°\nD:120°"
    columns = {
        "sample_index": ["1", "5", "6"], "problem_index": ["1", "1", "2"],
        "problem_version": ["Text Dominant", "Vision Only", "Text Lite"],
        "question": [question, "", "Find the length of AC."],
        "image": [png(), png(), png()], "answer": ["B", "B", "5"],
        "question_type": ["multi-choice", "multi-choice", "free-form"], "metadata": [meta] * 3,
        "query_wo": ["Please directly answer the question and provide the correct option letter.\nQuestion: "
                     + question, "According to the question shown in the image, directly answer.",
                     "Please directly answer the question.\nQuestion: Find the length of AC."],
        "query_cot": ["Please first conduct reasoning, and then answer the question and provide the correct option "
                      "letter, e.g., A, B, C, D, at the end.\nQuestion: " + question,
                      "According to the question shown in the image, please first conduct reasoning, and then answer.",
                      "Please first conduct reasoning, and then answer the question.\nQuestion: Find the length of AC."],
        "question_for_eval": [question, "", "Find the length of AC."],
    }
    write_parquet(columns, MATHVERSE_FEATURES, tmp_path / "MathVerse" / "testmini.parquet")
    return tmp_path
