"""The image zoom tool, image tool answers in multi-turn rollouts, and the ``zoom`` task.

Hand values for the crop; the tool inside ToolEnvironment (image answer, errors counted); a multi-turn rollout on
a tiny Qwen2.5-VL whose environment answers with images: the answer's vision tokens are holes in the loss mask,
the images ride in ``prompt_inputs`` after the prompt's, and the training forward over the whole conversation gives
the log-probs the sampler drew from; SFT traces of the zoom task encode the crop as vision tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from agent_envs_support import ZoomingEnvironment
from tiny_vlm_support import build_small_vlm

from mmpo.algos.agent import encode_tool_traces
from mmpo.data.synthetic import make_items
from mmpo.tools.env import ToolEnvironment
from mmpo.tools.functions import load_tools
from mmpo.tools.image_zoom import MIN_SIDE, crop_region
from mmpo.tools.sandbox import SandboxLimits, ToolSandbox
from mmpo.vlm.factory import load_vlm
from mmpo.vlm.logprobs import completion_log_probs
from mmpo.vlm.multiturn import MultiTurnEngine, completion_attention_mask, encode_observation
from mmpo.vlm.processing import image_token_id, vision_token_ids
from mmpo.vlm.rollout import HFGenerateEngine


def _gradient(width=448, height=448):
    image = Image.new("RGB", (width, height))
    image.putdata([(x % 256, y % 256, (x + y) % 256) for y in range(height) for x in range(width)])
    return image


def test_crop_region_on_hand_boxes():
    image = _gradient()
    crop = crop_region([image], [112, 224, 224, 336])
    assert crop.size == (112, 112)
    assert crop.getpixel((0, 0)) == (112, 224, (112 + 224) % 256)  # the top-left pixel is the box's
    assert crop.getpixel((111, 111)) == (223, 335 % 256, (223 + 335) % 256)
    # a 10 x 10 box grows around its centre (105, 45) to 28 x 28: [91, 31, 119, 59]
    small = crop_region([image], [100, 40, 110, 50])
    assert MIN_SIDE == 28 and small.size == (28, 28) and small.getpixel((0, 0))[:2] == (91, 31)
    # clipped to the image ([430, 440, 448, 448]), then grown inside it to [420, 420, 448, 448] (pixels are mod 256)
    edge = crop_region([image], [430, 440, 500, 500])
    assert edge.size == (28, 28) and edge.getpixel((0, 0))[:2] == (420 % 256, 420 % 256)
    for bad, message in (([1, 2, 3], "four numbers"), ([5, 5, 5, 9], "empty"), ([500, 500, 600, 600], "outside"),
                         (["a", 1, 2, 3], "four numbers")):
        with pytest.raises(ValueError, match=message):
            crop_region([image], bad)
    with pytest.raises(ValueError, match="no image"):
        crop_region([], [0, 0, 10, 10])


def test_the_zoom_tool_answers_with_the_image_and_counts_errors():
    tools = load_tools(["image_zoom_in_tool", "calculator"])
    zoom = tools[0]
    assert zoom.image_runner is not None and tools[1].image_runner is None
    assert zoom.schema["function"]["parameters"]["properties"]["bbox_2d"]["type"] == "array"
    sandbox = ToolSandbox(SandboxLimits(timeout_s=5.0))
    try:
        env = ToolEnvironment(tools, sandbox)
        row = make_items("zoom", 1, seed=0)[0]
        env.reset(row)
        call = json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 112, 112]}})
        bad = json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [9, 9, 1, 1]}})
        wrong = json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": "top left"}})
        result = env.step(f"<tool_call>{call}</tool_call><tool_call>{bad}</tool_call><tool_call>{wrong}</tool_call>")
        first, second, third = result.observation
        (item,) = first["content"]
        assert item["type"] == "image" and item["image"].size == (112, 112)
        assert item["image"].tobytes() == row["images"][0].crop((0, 0, 112, 112)).tobytes()
        assert second["content"].startswith("Error: bbox_2d [9, 9, 1, 1] is empty")
        assert third["content"].startswith("Error: argument 'bbox_2d'")
        assert env.stats.metrics() == {"tools/image_zoom_in_tool/calls": 3.0, "tools/image_zoom_in_tool/errors": 2.0,
                                       "tools/image_zoom_in_tool/timeouts": 0.0}
    finally:
        sandbox.shutdown()


def test_zoom_task_items():
    rows = make_items("zoom", 6, seed=0)
    held_out = make_items("zoom", 6, seed=0, split="test")
    assert all(a["images"][0].tobytes() != b["images"][0].tobytes() for a in rows for b in held_out)
    for row in rows:
        assert row["images"][0].size == (448, 448)
        assert len(row["answer"]) == row["difficulty"] + 2 and row["answer"].isdigit()
        call, tool, answer = row["tool_trace"]
        bbox = json.loads(call["content"].split("\n")[1])["arguments"]["bbox_2d"]
        assert bbox[2] - bbox[0] == bbox[3] - bbox[1] == 112 and all(v % 112 == 0 for v in bbox)
        crop = tool["content"][0]["image"]
        assert crop.tobytes() == row["images"][0].crop(tuple(bbox)).tobytes()
        # the red box is in the crop (the cell of the trace), nowhere else
        red = [(x, y) for y in range(0, 448, 2) for x in range(0, 448, 2)
               if row["images"][0].getpixel((x, y)) == (220, 20, 20)]
        assert red and all(bbox[0] <= x < bbox[2] and bbox[1] <= y < bbox[3] for x, y in red)
        assert answer["content"] == f"<think>The zoomed box shows {row['answer']}.</think><answer>{row['answer']}</answer>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    model, processor = load_vlm(build_small_vlm(tmp_path_factory.mktemp("vlm")))
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[model.generation_config.eos_token_id] = 4.0  # turns end after a few tokens
        # the sampler never draws vision tokens (suppressed); at ~0 probability the training forward's full softmax
        # and the sampler's suppressed one agree
        biased.bias[vision_token_ids(processor)] = -40.0
    model.lm_head = biased
    return model.eval(), processor


def test_image_answers_are_vision_tokens_in_the_context_and_out_of_the_loss(vlm):
    model, processor = vlm
    engine = MultiTurnEngine(HFGenerateEngine(model, processor), max_turns=3, max_total_tokens=300,
                             max_tokens_per_turn=12)
    torch.manual_seed(0)
    rollout = engine.generate(make_items("zoom", 2, seed=0), [ZoomingEnvironment() for _ in range(4)], num_samples=2)
    image_id = image_token_id(processor)
    attention = completion_attention_mask(rollout)
    turns = rollout.extras["turns"].tolist()
    assert turns == [3, 3, 3, 3]  # the bias ends every turn with the turn-end token, well within 12 tokens
    # crops 112 x 112 -> 8 x 8 patches = 16 vision tokens; 224 x 112 -> resized to 140 x 56 -> 4 x 10 = 10 tokens
    assert rollout.prompt_inputs["tool_image_counts"].tolist() == [2, 2, 2, 2]
    assert rollout.prompt_inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8], [1, 4, 10]] * 4
    for i in range(4):
        ids = rollout.completion_ids[i][attention[i].bool()]
        assert int((ids == image_id).sum()) == 16 + 10
        assert not rollout.completion_mask[i][rollout.completion_ids[i] == image_id].any()  # vision tokens: holes
    expected, _ = encode_observation(processor, [{"role": "tool", "content": [
        {"type": "image", "image": crop_region(make_items("zoom", 1, seed=0)[0]["images"], [0, 0, 112, 112])}]}])
    hole = (rollout.completion_mask[0] == 0) & (attention[0] == 1)
    first_hole = torch.nonzero(hole).flatten()[:len(expected)]
    assert rollout.completion_ids[0, first_hole].tolist() == expected
    with torch.no_grad():
        log_probs, _ = completion_log_probs(model, rollout.prompt_inputs, rollout.completion_ids, attention)
    trained = rollout.completion_mask.bool()
    torch.testing.assert_close(log_probs[trained], rollout.extras["engine_log_probs"][trained], atol=2e-4, rtol=0)
    # a minibatch of rows keeps each row's images (select_rows counts the tool images too)
    part = rollout.select([3, 1])
    assert part.prompt_inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8], [1, 4, 10]] * 2
    with torch.no_grad():
        part_log_probs, _ = completion_log_probs(model, part.prompt_inputs, part.completion_ids,
                                                 completion_attention_mask(part))
    torch.testing.assert_close(part_log_probs[part.completion_mask.bool()],
                               log_probs[[3, 1]][part.completion_mask.bool()], atol=1e-5, rtol=0)
    assert engine.last_transcripts[0][2] == {"role": "tool", "content": "<image 112x112>"}


def test_zoom_traces_encode_the_crop_as_vision_tokens_out_of_the_loss(vlm):
    _, processor = vlm
    rows = make_items("zoom", 2, seed=0)
    ids, loss_mask, attention, images = encode_tool_traces(processor, [row["tool_trace"] for row in rows])
    image_id = image_token_id(processor)
    for i in range(2):
        assert len(images[i]) == 1 and images[i][0][1].tolist() == [1, 8, 8]
        assert int((ids[i] == image_id).sum()) == 16
        assert not loss_mask[i][ids[i] == image_id].any()
        trained = processor.batch_decode([ids[i][loss_mask[i].bool()].tolist()], skip_special_tokens=True)[0]
        assert trained.endswith(f"<answer>{rows[i]['answer']}</answer>")
        assert '"bbox_2d"' in trained


def test_a_text_lm_refuses_image_answers(tmp_path: Path):
    from tiny_vlm_support import build_small_text_lm

    _, processor = load_vlm(build_small_text_lm(tmp_path / "text"))
    with pytest.raises(ValueError, match="text-only LM"):
        encode_observation(processor, [{"role": "tool", "content": [{"type": "image", "image": _gradient(56, 56)}]}])



def _exploding(images, bbox_2d):
    raise OSError("the image file vanished")


def test_a_raising_image_tool_is_an_error_message():
    from mmpo.tools.functions import Tool
    from mmpo.tools.image_zoom import image_tool

    @image_tool(_exploding)
    def broken_zoom(bbox_2d: list[int]) -> str:
        """Zoom that fails.

        Args:
            bbox_2d: the region.
        """

    from mmpo.tools.functions import tool_schema

    tool = Tool("broken_zoom", "tests:broken_zoom", tool_schema(broken_zoom), broken_zoom)
    env = ToolEnvironment([tool], sandbox=None)
    env.reset(make_items("zoom", 1, seed=0)[0])
    call = json.dumps({"name": "broken_zoom", "arguments": {"bbox_2d": [0, 0, 5, 5]}})
    (message,) = env.step(f"<tool_call>{call}</tool_call>").observation
    assert message["content"] == "Error: the image file vanished"
    assert env.stats.metrics()["tools/broken_zoom/errors"] == 1.0


def _digit_cell(value: str, dx: int, dy: int) -> Image.Image:
    """A 448 x 448 white image with zoom_digit's digit drawn in the cell at (112, 112), moved by (dx, dy)."""
    from PIL import ImageDraw

    from mmpo.data.synthetic.agent_tasks import draw_zoom_digit

    image = Image.new("RGB", (448, 448), (255, 255, 255))
    draw_zoom_digit(ImageDraw.Draw(image), value, 112, 112, 56, dx, dy)
    return image


@pytest.mark.parametrize("task", ["zoom_digit", "zoom_digit_at"])
def test_zoom_digit_items(task):
    rows = make_items(task, 8, seed=0)
    held_out = make_items(task, 8, seed=0, split="test")
    assert all(a["images"][0].tobytes() != b["images"][0].tobytes() for a in rows for b in held_out)
    for row in rows:
        bbox = json.loads(row["tool_trace"][0]["content"].split("\n")[1])["arguments"]["bbox_2d"]
        where = f" The red box is in the cell [{', '.join(map(str, bbox))}]." if task == "zoom_digit_at" else ""
        assert row["problem"] == f"The image is 448x448 pixels.{where} What digit is written in the red box?"
        assert row["images"][0].size == (448, 448) and row["answer"] in "0123456789" and len(row["answer"]) == 1
        call, tool, answer = row["tool_trace"]
        bbox = json.loads(call["content"].split("\n")[1])["arguments"]["bbox_2d"]
        assert bbox[2] - bbox[0] == bbox[3] - bbox[1] == 112 and all(v % 112 == 0 for v in bbox)
        crop = tool["content"][0]["image"]
        assert crop.tobytes() == row["images"][0].crop(tuple(bbox)).tobytes()
        # the glyph (black pixels) lies in the crop's patch [42, 56) x [42, 56), inside the red box
        black = [(x, y) for y in range(112) for x in range(112) if sum(crop.getpixel((x, y))) < 200]
        assert black and all(42 <= x < 56 and 42 <= y < 56 for x, y in black)
        red = [(x, y) for y in range(0, 448, 2) for x in range(0, 448, 2)
               if row["images"][0].getpixel((x, y)) == (220, 20, 20)]
        assert red and all(bbox[0] <= x < bbox[2] and bbox[1] <= y < bbox[3] for x, y in red)
        value = row["answer"]
        assert answer["content"] == f"<think>The zoomed box shows {value}.</think><answer>{value}</answer>"


def test_zoom_digit_is_unreadable_at_the_model_resolution_and_readable_in_the_crop():
    """Every digit at every jitter (10 x 25 renderings). At the tiny VLM's view (qwen-vl-utils' resize of the
    448 x 448 image to 112 x 112, what the processor gets) a nearest-neighbour reader that knows every other rendering
    reads few of them (a 1-pixel move changes the view as much as another digit does); in the crop (the cell at full
    resolution) the glyph cut to its ink is exactly the digit's, whatever the jitter."""
    import numpy as np
    from qwen_vl_utils import fetch_image

    from mmpo.vlm.factory import TINY_MAX_PIXELS, TINY_MIN_PIXELS

    shifts = [(dx, dy) for dx in range(-2, 3) for dy in range(-2, 3)]
    renders = [(digit, _digit_cell(str(digit), dx, dy)) for digit in range(10) for dx, dy in shifts]
    views = []
    for _, image in renders:
        view = fetch_image({"image": image, "min_pixels": TINY_MIN_PIXELS, "max_pixels": TINY_MAX_PIXELS})
        assert view.size == (112, 112)
        views.append(np.asarray(view, dtype=np.float64)[28:56, 28:56].reshape(-1))  # the cell: one merged token
    views = np.stack(views)
    ink = (views.reshape(-1, 28, 28, 3).mean(-1) < 250).any(0)  # pixels any rendering darkens
    assert ink.any(1).sum() == 5 and ink.any(0).sum() == 4  # all within 5 x 4 pixels (7 x 9 glyph, +-2 jitter)
    distances = ((views[:, None] - views[None]) ** 2).sum(-1)
    np.fill_diagonal(distances, np.inf)
    labels = np.array([digit for digit, _ in renders])
    low_res_reading = float((labels[distances.argmin(1)] == labels).mean())
    assert 0.2 < low_res_reading < 0.35, low_res_reading  # 0.276 (69 of 250) here; chance is 0.1

    def glyph(image: Image.Image) -> bytes:
        cell = np.asarray(image.crop((112, 112, 224, 224)).convert("L"))
        ys, xs = np.nonzero(cell < 255)
        return cell[ys.min():ys.max() + 1, xs.min():xs.max() + 1].tobytes()

    templates = {glyph(_digit_cell(str(digit), 0, 0)): digit for digit in range(10)}
    assert len(templates) == 10
    assert [templates.get(glyph(image)) for _, image in renders] == labels.tolist()


def test_zoom_digit_read_rows_are_the_crops_of_zoom_digit_at_items():
    """zoom_digit_read: the image is exactly the crop zoom_digit_at's call returns (same generator draws, so row k
    of one task is row k of the other when both come from the same seed's rng), the trace is the final message
    alone; zoom_digit_box_read the same for zoom_digit_box's 28 x 28 crop."""
    import random

    from mmpo.data.synthetic.agent_tasks import (zoom_digit_at, zoom_digit_box_read, zoom_digit_box_task,
                                                 zoom_digit_read)

    for read, source, side in ((zoom_digit_read, zoom_digit_at, 112), (zoom_digit_box_read, zoom_digit_box_task, 28)):
        for seed in range(4):
            row, item = read(random.Random(seed), 1, 56), source(random.Random(seed), 1, 56)
            crop = item["tool_trace"][1]["content"][0]["image"]
            assert row["images"][0].size == (side, side) and row["images"][0].tobytes() == crop.tobytes()
            assert row["answer"] == item["answer"] and row["answer"] in "0123456789"
            bbox = json.loads(item["tool_trace"][0]["content"].split("\n")[1])["arguments"]["bbox_2d"]
            assert row["problem"] == (f"The image is a zoomed {side}x{side} view of the box "
                                      f"[{', '.join(map(str, bbox))}]. What digit is written in the red box?")
            assert row["tool_trace"] == [item["tool_trace"][2]]
            assert row["tool_trace"][0]["content"] == (f"<think>The zoomed box shows {row['answer']}.</think>"
                                                       f"<answer>{row['answer']}</answer>")
    held_out = make_items("zoom_digit_read", 8, seed=0, split="test")
    train = make_items("zoom_digit_read", 8, seed=0)
    assert all(a["images"][0].tobytes() != b["images"][0].tobytes() for a in train for b in held_out)
    # zoom_digit_box_read has 10 crops; the box in the question spreads every digit over the splits
    for split in ("train", "test"):
        assert {row["answer"] for row in make_items("zoom_digit_box_read", 100, seed=0, split=split)} == set("0123456789")


def test_zoom_digit_box_names_a_28_pixel_square_around_the_digit():
    """zoom_digit_box's question names [cx - 14, cy - 14, cx + 14, cy + 14] around the drawn digit's centre (49, 49)
    in its cell plus the jitter (so [35, 35, 63, 63] in the cell at the origin without jitter), the call copies it,
    the crop is that region, every black pixel of the glyph lies inside the box, and the crop is the same image for
    every item with the same digit (at most 10 distinct crops)."""
    from mmpo.data.synthetic.agent_tasks import zoom_digit_box

    assert zoom_digit_box(0, 0, 56) == [35, 35, 63, 63]
    assert zoom_digit_box(112, 224, 56, -2, 1) == [145, 260, 173, 288]
    crops: dict[str, set[bytes]] = {}
    jitters = set()
    for row in make_items("zoom_digit_box", 24, seed=0):
        call, tool, answer = row["tool_trace"]
        bbox = json.loads(call["content"].split("\n")[1])["arguments"]["bbox_2d"]
        x0, y0 = (bbox[0] - 33) // 112 * 112, (bbox[1] - 33) // 112 * 112
        dx, dy = bbox[0] - x0 - 35, bbox[1] - y0 - 35
        assert -2 <= dx <= 2 and -2 <= dy <= 2 and bbox == zoom_digit_box(x0, y0, 56, dx, dy)
        jitters.add((dx, dy))
        crops.setdefault(row["answer"], set()).add(tool["content"][0]["image"].tobytes())
        assert row["problem"] == (f"The image is 448x448 pixels. The digit is in the box [{', '.join(map(str, bbox))}]."
                                  " What digit is written in the red box?")
        crop = tool["content"][0]["image"]
        assert crop.size == (28, 28) and crop.tobytes() == row["images"][0].crop(tuple(bbox)).tobytes()
        black = [(x, y) for y in range(y0, y0 + 112) for x in range(x0, x0 + 112)
                 if sum(row["images"][0].getpixel((x, y))) < 200]
        assert black and all(bbox[0] < x < bbox[2] - 1 and bbox[1] < y < bbox[3] - 1 for x, y in black)
        assert answer["content"] == f"<think>The zoomed box shows {row['answer']}.</think><answer>{row['answer']}</answer>"
    assert len(jitters) > 5 and len(crops) > 5 and all(len(images) == 1 for images in crops.values())


def test_zoom_digit_box_crop_is_enlarged_over_several_patches_with_min_pixels_at_the_maximum():
    """The processor's view of the crops: with the tiny VLM's default budget (min 56 x 56) zoom_digit_at's 112 x 112
    crop stays 112 x 112 and its glyph's ink lies in one 14-pixel patch; with min_pixels = max_pixels = 112 x 112,
    zoom_digit_box's 28 x 28 crop is enlarged to 112 x 112 (4x) and the ink covers several patches and at least two
    of the 2 x 2 merged vision tokens, while the whole 448 x 448 image is still seen at 112 x 112."""
    import numpy as np
    from qwen_vl_utils import fetch_image

    from mmpo.vlm.factory import TINY_MAX_PIXELS, TINY_MIN_PIXELS

    def inked_patches(view: Image.Image, size: int) -> set[tuple[int, int]]:
        ink = (np.asarray(view) < 100).all(-1)  # black: the glyph, not the red box
        ys, xs = np.nonzero(ink)
        return {(int(y) // size, int(x) // size) for y, x in zip(ys, xs)}

    for row in make_items("zoom_digit_at", 4, seed=0):
        crop = row["tool_trace"][1]["content"][0]["image"]
        view = fetch_image({"image": crop, "min_pixels": TINY_MIN_PIXELS, "max_pixels": TINY_MAX_PIXELS})
        assert view.size == (112, 112) and inked_patches(view, 14) == {(3, 3)}
    for row in make_items("zoom_digit_box", 4, seed=0):
        crop = row["tool_trace"][1]["content"][0]["image"]
        view = fetch_image({"image": crop, "min_pixels": TINY_MAX_PIXELS, "max_pixels": TINY_MAX_PIXELS})
        assert view.size == (112, 112)
        assert len(inked_patches(view, 14)) >= 4 and len(inked_patches(view, 28)) >= 2
        whole = fetch_image({"image": row["images"][0], "min_pixels": TINY_MAX_PIXELS, "max_pixels": TINY_MAX_PIXELS})
        assert whole.size == (112, 112)


def test_texture_patch_hand_values():
    """A 6 x 6 checkerboard region with a 2-pixel ramp: per axis the distance to the edge is 0, 1, 2, 2, 1, 0, the
    raised cosine of (d + 0.5) / 2 is 0.146, 0.854, 1, 1, 0.854, 0.146 (the smaller of the two axes' applies), so the
    amplitudes are round(127 x that) = 19, 108, 127; pixels are 127 +- amplitude, + where x + y is odd (white)."""
    import numpy as np

    from mmpo.data.synthetic.agent_tasks import ZOOM_TEXTURES, texture_patch

    patch = texture_patch("checkerboard", 10, 20, 16, 26, ramp=2)
    amplitude = np.array([[19] * 6, [19, 108, 108, 108, 108, 19], [19, 108, 127, 127, 108, 19],
                          [19, 108, 127, 127, 108, 19], [19, 108, 108, 108, 108, 19], [19] * 6])
    ys, xs = np.mgrid[20:26, 10:16]
    sign = np.where((xs + ys) % 2 == 1, 1, -1)
    assert patch.dtype == np.uint8 and patch.tolist() == (127 + amplitude * sign).tolist()
    assert patch[2, 2] == 0 and patch[2, 3] == 254 and patch[0, 0] == 108 and patch[1, 1] == 19
    # the phase is absolute: the same texture cut one pixel further right starts with the other colour
    # (ramp 1: full contrast from one pixel in; the edge pixels at 0.5 - 0.5 cos(pi / 2), just under 0.5: 63)
    assert texture_patch("vertical", 0, 0, 8, 8, ramp=1)[3, 1:5].tolist() == [254, 0, 254, 0]
    assert texture_patch("vertical", 1, 0, 9, 8, ramp=1)[3, 1:5].tolist() == [0, 254, 0, 254]
    assert texture_patch("bands", 0, 0, 8, 8, ramp=1)[:, 4].tolist() == [64, 0, 254, 254, 0, 0, 254, 190]
    assert sorted(ZOOM_TEXTURES) == ["bands", "checkerboard", "horizontal", "vertical"]


def test_zoom_texture_items_and_crops():
    """zoom_texture: the question names the red box's cell and the four choices, the call zooms into that cell,
    the crop is the cell at full resolution (112 x 112, seen 1:1 by the tiny VLM: the processor keeps it), and in
    the crop the texture's full-contrast centre is exactly its stripes (0 / 254 by ZOOM_TEXTURES at absolute
    coordinates); crops of different textures differ there in at least half of the pixels. zoom_texture_read's
    image is that crop."""
    import random

    import numpy as np

    from mmpo.data.synthetic.agent_tasks import ZOOM_TEXTURES, zoom_texture_item, zoom_texture_read
    from mmpo.vlm.factory import TINY_MAX_PIXELS, TINY_MIN_PIXELS
    from qwen_vl_utils import fetch_image

    rows = make_items("zoom_texture", 40, seed=0)
    assert {row["answer"] for row in rows} == set(ZOOM_TEXTURES)
    held_out = make_items("zoom_texture", 8, seed=0, split="test")
    assert all(a["images"][0].tobytes() != b["images"][0].tobytes() for a in rows for b in held_out)
    for row in rows[:8]:
        call, tool, answer = row["tool_trace"]
        bbox = json.loads(call["content"].split("\n")[1])["arguments"]["bbox_2d"]
        assert bbox[2] - bbox[0] == bbox[3] - bbox[1] == 112 and all(v % 112 == 0 for v in bbox)
        assert row["problem"] == (f"The image is 448x448 pixels. The red box is in the cell [{', '.join(map(str, bbox))}]."
                                  " What texture fills the red box? Answer with one of: horizontal, vertical, "
                                  "checkerboard, bands.")
        crop = tool["content"][0]["image"]
        assert crop.size == (112, 112) and crop.tobytes() == row["images"][0].crop(tuple(bbox)).tobytes()
        view = fetch_image({"image": crop, "min_pixels": TINY_MIN_PIXELS, "max_pixels": TINY_MAX_PIXELS})
        assert view.size == (112, 112) and view.tobytes() == crop.tobytes()  # seen 1:1
        centre = np.asarray(crop)[40:72, 40:72, 0]  # inside every region (insets <= 20) and its ramp (16)
        ys, xs = np.mgrid[bbox[1] + 40:bbox[1] + 72, bbox[0] + 40:bbox[0] + 72]
        assert centre.tolist() == (254 * ZOOM_TEXTURES[row["answer"]](xs, ys)).tolist()
        red = [(x, y) for y in range(0, 448, 2) for x in range(0, 448, 2)
               if row["images"][0].getpixel((x, y)) == (220, 20, 20)]
        assert red and all(bbox[0] <= x < bbox[2] and bbox[1] <= y < bbox[3] for x, y in red)
        assert answer["content"] == f"<think>The zoomed box shows {row['answer']}.</think><answer>{row['answer']}</answer>"
        read = zoom_texture_read(random.Random(7), 1, 56)
        item = zoom_texture_item(random.Random(7), 56)
        assert read["images"][0].tobytes() == item["tool_trace"][1]["content"][0]["image"].tobytes()
        assert read["answer"] == item["answer"] and read["tool_trace"] == [item["tool_trace"][2]]
    centres = {name: np.asarray(zoom_texture_item(random.Random(3), 56, texture=name)["tool_trace"][1]["content"][0]
                                ["image"])[40:72, 40:72] for name in ZOOM_TEXTURES}
    for a in ZOOM_TEXTURES:
        for b in ZOOM_TEXTURES:
            if a < b:
                assert (centres[a] != centres[b]).any(-1).mean() >= 0.5, (a, b)


def test_zoom_texture_is_unreadable_at_the_model_resolution():
    """The whole 448 x 448 image as the tiny VLM gets it: qwen-vl-utils' resize to the pixel budget (what
    mmpo.vlm.processing does before the processor: PIL bicubic, antialiased), then the Qwen2-VL image processor the
    tiny VLM loads (torchvision backend, no further resize at 112 x 112); and the processor alone on the 448 x 448
    image, in both its torchvision and its PIL backend (bicubic, antialiased). The same layout drawn with each of
    the four textures gives views that differ by at most one grey level, in under 2% of the values (the ramp's
    rounding), never inside the texture's region; a nearest-neighbour reader that knows 120 other items' views
    and textures reads 60 held-out ones at chance (0.25)."""
    import random

    import numpy as np
    from qwen_vl_utils import fetch_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    from mmpo.data.synthetic.agent_tasks import ZOOM_TEXTURES, zoom_texture_item
    from mmpo.vlm.factory import TINY_MAX_PIXELS, TINY_MIN_PIXELS

    torchvision = Qwen2VLImageProcessor(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS)
    pil = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS)
    std = np.array(torchvision.image_std)

    def trainer_view(image: Image.Image) -> np.ndarray:
        view = fetch_image({"image": image, "min_pixels": TINY_MIN_PIXELS, "max_pixels": TINY_MAX_PIXELS})
        assert view.size == (112, 112)
        return np.asarray(torchvision(images=[view], return_tensors="pt")["pixel_values"])

    def grey_levels(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # |a - b| in grey levels, per value
        channel = np.arange(a.shape[1]) // (a.shape[1] // 3)  # 3 x 2 x 14 x 14 values per patch row
        return np.abs(a - b) * std[channel] * 255

    for seed in range(6):
        images = {name: zoom_texture_item(random.Random(seed), 56, texture=name)["images"][0] for name in ZOOM_TEXTURES}
        for view in (trainer_view, lambda image: np.asarray(torchvision(images=[image], return_tensors="pt")["pixel_values"]),
                     lambda image: np.asarray(pil(images=[image], return_tensors="pt")["pixel_values"])):
            views = {name: view(image) for name, image in images.items()}
            assert views["vertical"].shape == (64, 1176)
            for name in ZOOM_TEXTURES:
                difference = grey_levels(views[name], views["horizontal"])
                assert difference.max() < 1.01 and (difference > 0.01).mean() < 0.02, (seed, name)
    train = make_items("zoom_texture", 120, seed=0)
    test = make_items("zoom_texture", 60, seed=0, split="test")
    train_views = np.stack([trainer_view(row["images"][0]).reshape(-1) for row in train])
    labels = np.array([row["answer"] for row in train])
    right = [labels[((train_views - trainer_view(row["images"][0]).reshape(-1)) ** 2).sum(1).argmin()] == row["answer"]
             for row in test]
    assert 0.1 <= np.mean(right) <= 0.42, np.mean(right)
