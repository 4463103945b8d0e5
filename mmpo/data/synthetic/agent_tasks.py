"""Tasks where a tool must help: ``calc``, arithmetic a tiny model cannot do in its head; ``zoom``, a detail
too small to read at a VLM's input resolution; ``twohop``, two lookups whose answers are padded with distractors
(MATPO's testbed, docs/matpo.md); ``codebook``, the code of a key that only the tool knows; ``codebook_pair``, the
codes of two keys (two calls or more: the number of calls is the model's choice).

``calc``: ``Compute 4821 * 37 - 1290.`` (difficulty 1: a 3-digit times a 2-digit number plus a 3-digit one;
2: 4-digit x 2-digit +/- 4-digit; 3: 4-digit x 3-digit +/- 5-digit). The answer is an integer (the
``accuracy`` reward checks it). Each row carries ``tool_trace``, the conversation that solves it with the
calculator (an assistant ``<tool_call>``, the tool's answer, an assistant answer in the think/answer format):
what the SFT warm-up teaches (``mmpo.algos.agent.AgentSFTModule``). Train / val / test are disjoint by the
registry's content hash.

``zoom``: a large image (8x the task image size: 448 x 448 pixels by default) split into a 4 x 4 grid of cells;
one cell holds a red box with a 3- to 5-digit number (difficulty 1..3) in a 14-pixel font, the other cells a few
grey shapes. The tiny VLM sees the whole image at 112 x 112 (its pixel budget), where the digits are 3.5 pixels
tall: unreadable, while the red box still shows which cell it is in. ``image_zoom_in_tool`` on that cell returns
its 112 x 112 pixels at full resolution, where the digits are readable. ``tool_trace``: zoom into the box's cell,
read the number, answer.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Sequence

from mmpo.data.synthetic.drawing import COLORS, font
from mmpo.data.synthetic.registry import register_task

# difficulty -> (first operand digits, multiplier digits, last operand digits)
_CALC_LEVELS: dict[int, tuple[int, int, int]] = {1: (3, 2, 3), 2: (4, 2, 4), 3: (4, 3, 5)}


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def calculator_trace(expression: str, value: str) -> list[dict[str, str]]:
    """The tool-use conversation after the prompt: call the calculator, read its result, answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": f"<think>The calculator gives {expression} = {value}.</think>"
                                         f"<answer>{value}</answer>"},
    ]


@register_task("calc")
def calc(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """``a * b + c`` or ``a * b - c`` with multi-digit operands; answer: the integer value."""
    first, multiplier, last = _CALC_LEVELS[difficulty]
    a, b, c = _number(rng, first), _number(rng, multiplier), _number(rng, last)
    sign = rng.choice("+-")
    value = a * b + c if sign == "+" else a * b - c
    expression = f"{a} * {b} {sign} {c}"
    return {
        "images": [], "problem": f"Compute {expression}.", "answer": str(value),
        "steps": [f"{a} * {b} = {a * b}.", f"{a * b} {sign} {c} = {value}.", f"So the answer is {value}."],
        "key_steps": [[f"{a} * {b} = {a * b}"], [f"{a * b} {sign} {c} = {value}"]],
        "needs_image": False, "image_description": "There is no image.", "rationale": "I use the calculator.",
        "tool_trace": calculator_trace(expression, str(value)),
    }


ZOOM_GRID = 4
"""Cells per side of a ``zoom`` image."""
ZOOM_SCALE = 8
"""A ``zoom`` image's side is this many times the task image size (56 -> 448 pixels)."""
ZOOM_FONT = 14
"""Pixel size of the number's font (readable at full resolution, 3.5 pixels at 112 x 112)."""


def zoom_trace(bbox: list[int], crop: Any, value: str) -> list[dict[str, Any]]:
    """The tool-use conversation after the prompt: zoom into ``bbox``, see ``crop``, answer ``value``."""
    call = json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": bbox}})
    return [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": [{"type": "image", "image": crop}]},
        {"role": "assistant", "content": f"<think>The zoomed box shows {value}.</think><answer>{value}</answer>"},
    ]


def _zoom_canvas(rng: random.Random, image_size: int,
                 box: tuple[int, int, int, int] | None = None) -> tuple[Any, Any, int, int, int]:
    """A ``zoom`` image with grey shapes in about half of the cells and a red box in one cell (its content drawn by
    the caller after this returns). ``box``: the red box's outline ``(left, top, right, bottom)`` relative to the
    cell's corner (default: ``zoom``'s, an eighth of the cell in from the sides, a quarter from top and bottom).
    Returns ``(image, draw, side, x0, y0)``: the cell's top-left corner in pixels."""
    from PIL import Image, ImageDraw

    side = ZOOM_SCALE * image_size
    cell = side // ZOOM_GRID
    image = Image.new("RGB", (side, side), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    target = rng.randrange(ZOOM_GRID * ZOOM_GRID)
    col, row = target % ZOOM_GRID, target // ZOOM_GRID
    for other in range(ZOOM_GRID * ZOOM_GRID):  # a grey shape in some of the other cells
        if other == target or rng.random() < 0.5:
            continue
        x, y = (other % ZOOM_GRID) * cell + cell // 2, (other // ZOOM_GRID) * cell + cell // 2
        radius = rng.randint(cell // 8, cell // 4)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x - radius, y - radius, x + radius, y + radius), fill=(160, 160, 160))
    x0, y0 = col * cell, row * cell
    margin = cell // 8
    left, top, right, bottom = box or (margin, 2 * margin, cell - margin, cell - 2 * margin)
    draw.rectangle((x0 + left, y0 + top, x0 + right, y0 + bottom), outline=COLORS["red"], width=max(2, cell // 28))
    return image, draw, side, x0, y0


def _zoom_row(image: Any, side: int, bbox: list[int], value: str, noun: str, where: str = "",
              what: str = "is written in", suffix: str = "") -> dict[str, Any]:
    """The row of a zoom item whose red box ``bbox`` holds ``value`` (a ``noun``: number, digit or texture);
    ``where``: text placed before the question (``zoom_digit_at`` names the box's cell there); ``what``: the verb of
    the question (``What {noun} {what} the red box?``); ``suffix``: text after it (``zoom_texture``'s choices)."""
    from mmpo.tools.image_zoom import crop_region

    return {
        "images": [image], "answer": value,
        "problem": f"The image is {side}x{side} pixels.{where} What {noun} {what} the red box?{suffix}",
        "steps": [f"The red box is in the cell {bbox}.", f"Zoomed in, the box shows {value}.",
                  f"So the answer is {value}."],
        "key_steps": [[f"{value}"]], "needs_image": True,
        "image_description": f"A {side}x{side} image with a small red box holding a {noun}.",
        "rationale": f"I zoom into the red box to read the {noun}.",
        "tool_trace": zoom_trace(bbox, crop_region([image], bbox), value),
    }


@register_task("zoom")
def zoom(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """A number in a red box in one cell of a large image; answer: the number (its digits)."""
    image, draw, side, x0, y0 = _zoom_canvas(rng, image_size)
    cell = side // ZOOM_GRID
    digits = difficulty + 2
    value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    text_font = font(ZOOM_FONT * image_size // 56)
    left, top, right, bottom = draw.textbbox((0, 0), value, font=text_font)
    draw.text((x0 + (cell - (right - left)) // 2 - left, y0 + (cell - (bottom - top)) // 2 - top), value,
              fill=(0, 0, 0), font=text_font)
    return _zoom_row(image, side, [x0, y0, x0 + cell, y0 + cell], value, "number")


ZOOM_DIGIT_FONT = 12
"""Font size of ``zoom_digit``'s digit at the default image size (the glyph 7 x 9 pixels)."""
ZOOM_DIGIT_JITTER = 2
"""``zoom_digit``: the digit's centre moves up to this many pixels (each axis, uniform) around its place."""


def draw_zoom_digit(draw: Any, value: str, x0: int, y0: int, image_size: int, dx: int, dy: int) -> None:
    """Draw ``zoom_digit``'s digit into the cell whose top-left corner is ``(x0, y0)``: centred at 7/16 of the cell
    on each axis (the middle of the crop's fourth 14-pixel patch, inside the red box: with the jitter the whole
    glyph stays in one Qwen-VL patch of the crop), moved by ``(dx, dy)`` pixels."""
    cell = ZOOM_SCALE * image_size // ZOOM_GRID
    text_font = font(ZOOM_DIGIT_FONT * image_size // 56)
    left, top, right, bottom = draw.textbbox((0, 0), value, font=text_font)
    cx, cy = x0 + 7 * cell // 16 + dx, y0 + 7 * cell // 16 + dy
    draw.text((cx - (right - left) // 2 - left, cy - (bottom - top) // 2 - top), value, fill=(0, 0, 0), font=text_font)


def _zoom_digit_item(rng: random.Random, image_size: int, *, located: bool, tight: bool = False) -> dict[str, Any]:
    """A ``zoom_digit`` item. ``located``: the question names the box the call should zoom into; ``tight``: that box
    is :func:`zoom_digit_box`'s (a quarter-cell square around the digit) instead of the red box's cell."""
    image, draw, side, x0, y0 = _zoom_canvas(rng, image_size)
    cell = side // ZOOM_GRID
    value = str(rng.randrange(10))
    dx, dy = rng.randint(-ZOOM_DIGIT_JITTER, ZOOM_DIGIT_JITTER), rng.randint(-ZOOM_DIGIT_JITTER, ZOOM_DIGIT_JITTER)
    draw_zoom_digit(draw, value, x0, y0, image_size, dx, dy)
    if tight:
        bbox = zoom_digit_box(x0, y0, image_size, dx, dy)
        where = f" The digit is in the box [{bbox[0]}, {bbox[1]}, {bbox[2]}, {bbox[3]}]."
    else:
        bbox = [x0, y0, x0 + cell, y0 + cell]
        where = f" The red box is in the cell [{bbox[0]}, {bbox[1]}, {bbox[2]}, {bbox[3]}]." if located else ""
    return _zoom_row(image, side, bbox, value, "digit", where=where)


def zoom_digit_box(x0: int, y0: int, image_size: int, dx: int = 0, dy: int = 0) -> list[int]:
    """The square of a quarter cell's side (28 pixels at the default size: Qwen-VL's patch x merge, the zoom tool's
    smallest crop) centred where :func:`draw_zoom_digit` centres the digit of the cell at ``(x0, y0)`` moved by
    ``(dx, dy)``: the box follows the digit's jitter, so the crop shows the glyph at one place (10 possible crops),
    while the whole image keeps the sub-pixel jitter that makes the 112 x 112 view unreadable
    (tests/agents/test_zoom.py)."""
    cell = ZOOM_SCALE * image_size // ZOOM_GRID
    cx, cy, half = x0 + 7 * cell // 16 + dx, y0 + 7 * cell // 16 + dy, cell // 8
    return [cx - half, cy - half, cx + half, cy + half]


@register_task("zoom_digit")
def zoom_digit(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """``zoom``'s image and red box, holding one digit (0-9); answer: the digit. Difficulty does not change it.

    The digit (:data:`ZOOM_DIGIT_FONT`, a 7 x 9 pixel glyph) sits at 7/16 of the cell on each axis, moved by up to
    :data:`ZOOM_DIGIT_JITTER` pixels (:func:`draw_zoom_digit`). At the tiny VLM's 112 x 112 view of the 448 x 448
    image it is a blot within 5 x 4 pixels (all jitters) whose look depends on its sub-pixel place as much as on
    the digit (a nearest-neighbour reader with every other jittered rendering as a template reads 0.28 of them,
    chance is 0.1); the crop (the box's cell at full resolution) shows the glyph itself, up to a shift."""
    return _zoom_digit_item(rng, image_size, located=False)


@register_task("zoom_digit_at")
def zoom_digit_at(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """``zoom_digit`` whose question also names the red box's cell in the call's own form (``The red box is in the
    cell [224, 112, 336, 224].``): the call copies the box from the question instead of finding the box in the
    112 x 112 view (which the tiny VLM does not learn, docs/agents.md), and the digit is still read from the crop."""
    return _zoom_digit_item(rng, image_size, located=True)


@register_task("zoom_digit_box")
def zoom_digit_box_task(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """``zoom_digit`` whose question names a tight box around the digit (``The digit is in the box [147, 259, 175,
    287].``: :func:`zoom_digit_box`, 28 x 28 pixels centred on the drawn glyph), which the call copies: the crop is
    the glyph's neighbourhood, the same image for every item with that digit (the tiny VLM's one-block vision tower
    does not learn to read the jittered glyph of ``zoom_digit_read``'s crops, bench/RESULTS.md), small enough for the
    processor to enlarge it. The box's coordinates tell the jitter, not the digit. With a pixel budget whose minimum is its maximum
    (``build_tiny_vlm(min_pixels=max_pixels=112 * 112)``, as Qwen2.5-VL's large ``min_pixels`` enlarges every small
    crop) the 28 x 28 crop is seen at 112 x 112: the 7 x 9 glyph becomes 28 x 36 pixels over several 14-pixel
    patches, while the whole 448 x 448 image is still seen at 112 x 112 (the glyph about 2 x 2 pixels)."""
    return _zoom_digit_item(rng, image_size, located=True, tight=True)


def _reading_row(item: dict[str, Any], noun: str = "digit", what: str = "is written in",
                 suffix: str = "") -> dict[str, Any]:
    """A row whose image is ``item``'s zoom crop and whose answer is its digit (see :func:`zoom_digit_read`). The
    question names the zoomed box, so rows differ in content even where crops repeat (``zoom_digit_box_read`` has
    10 crops): the registry's content-hash split then puts every digit in every split, not each digit's one crop
    in one split."""
    crop, value = item["tool_trace"][1]["content"][0]["image"], item["answer"]
    width, height = crop.size
    bbox = json.loads(item["tool_trace"][0]["content"].split("\n")[1])["arguments"]["bbox_2d"]
    return {
        "images": [crop], "answer": value,
        "problem": f"The image is a zoomed {width}x{height} view of the box [{', '.join(map(str, bbox))}]. "
                   f"What {noun} {what} the red box?{suffix}",
        "steps": [f"The zoomed view shows {value}.", f"So the answer is {value}."], "key_steps": [[value]],
        "needs_image": True, "image_description": f"A {width}x{height} zoomed view holding a {noun}.",
        "rationale": f"I read the {noun} in the zoomed view.",
        "tool_trace": [{"role": "assistant",
                        "content": f"<think>The zoomed box shows {value}.</think><answer>{value}</answer>"}],
    }


@register_task("zoom_digit_read")
def zoom_digit_read(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """The reading part of ``zoom_digit_at`` alone: the image IS the crop its zoom call returns (the red box's
    112 x 112 cell at full resolution), the answer its digit. No tool: ``tool_trace`` is the one final message a zoom
    trace ends with (``<think>The zoomed box shows N.</think><answer>N</answer>``), so SFT on these rows trains the
    very tokens where a zoom trace reads the crop. A reading probe (can the VLM read the digit from the crop at
    all?) and auxiliary rows of the zoom SFT warm-up (docs/agents.md, ``bench/bench_agents.py --sft-aux-task``)."""
    return _reading_row(_zoom_digit_item(rng, image_size, located=True))


@register_task("zoom_digit_box_read")
def zoom_digit_box_read(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """:func:`zoom_digit_read` for ``zoom_digit_box``: the image is its 28 x 28 crop around the digit."""
    return _reading_row(_zoom_digit_item(rng, image_size, located=True, tight=True))


ZOOM_TEXTURES: dict[str, Any] = {
    "horizontal": lambda x, y: y % 2,
    "vertical": lambda x, y: x % 2,
    "checkerboard": lambda x, y: (x + y) % 2,
    "bands": lambda x, y: (y // 2) % 2,
}
"""``zoom_texture``'s textures: name -> which pixels are white (1) or black (0) at absolute image coordinates
``(x, y)`` (numpy arrays): 1-pixel horizontal lines, 1-pixel vertical lines, a 1-pixel checkerboard, 2-pixel
horizontal bands. Every period divides 4 (the 448 -> 112 downscale) and half the pixels are white."""
ZOOM_TEXTURE_GREY = 127
"""The grey every texture averages to: pixels are ``127 +- amplitude`` (0 and 254 at full contrast), so the
average is an integer and the downscale's rounding has no ties."""


def texture_patch(name: str, left: int, top: int, right: int, bottom: int, ramp: int) -> Any:
    """The ``zoom_texture`` pixels of the region ``[left, right) x [top, bottom)`` (absolute image coordinates): a
    uint8 array ``(bottom - top, right - left)`` of ``ZOOM_TEXTURE_GREY +- amplitude``, the sign from
    :data:`ZOOM_TEXTURES`, the amplitude 127 inside and rising from about 0 at the region's edge over ``ramp``
    pixels (a raised cosine; the smaller of the two axes' ramps). The ramp keeps the downscaled image the same for
    every texture near the region's edges too: a hard edge would cut a texture's stripes differently under the
    resampling kernel (a difference of up to 28 grey levels at the edge pixels; tests/agents/test_zoom.py)."""
    import numpy as np

    def ramp_1d(size: int) -> Any:
        index = np.arange(size)
        distance = np.minimum(index, size - 1 - index)
        return 0.5 - 0.5 * np.cos(np.pi * np.clip((distance + 0.5) / ramp, 0.0, 1.0))

    ys, xs = np.mgrid[top:bottom, left:right]
    sign = 2 * ZOOM_TEXTURES[name](xs, ys) - 1
    amplitude = np.round(127 * np.minimum(ramp_1d(bottom - top)[:, None], ramp_1d(right - left)[None, :]))
    return (ZOOM_TEXTURE_GREY + amplitude * sign).astype(np.uint8)


def zoom_texture_item(rng: random.Random, image_size: int, texture: str | None = None) -> dict[str, Any]:
    """A ``zoom_texture`` item (see :func:`zoom_texture`); ``texture``: draw this one instead of the drawn one, the
    layout unchanged (the same ``rng`` state gives the same layout with each texture: the tests compare them)."""
    import numpy as np
    from PIL import Image

    unit = ZOOM_SCALE * image_size // ZOOM_GRID // 28  # 4 pixels at the default size: the downscale factor
    cell = 28 * unit
    inset = [2 * unit + unit * rng.randrange(4) for _ in range(4)]  # left, top, right, bottom: 8-20 pixels in
    region = (inset[0], inset[1], cell - inset[2], cell - inset[3])
    outline = (region[0] - 3 * unit // 2, region[1] - 3 * unit // 2, region[2] + 3 * unit // 2 - 1,
               region[3] + 3 * unit // 2 - 1)
    image, _, side, x0, y0 = _zoom_canvas(rng, image_size, box=outline)
    value = rng.choice(sorted(ZOOM_TEXTURES))
    value = value if texture is None else texture
    pixels = np.array(image)
    left, top, right, bottom = x0 + region[0], y0 + region[1], x0 + region[2], y0 + region[3]
    pixels[top:bottom, left:right] = texture_patch(value, left, top, right, bottom, ramp=4 * unit)[..., None]
    image = Image.fromarray(pixels)
    bbox = [x0, y0, x0 + cell, y0 + cell]
    return _zoom_row(image, side, bbox, value, "texture", what="fills",
                     where=f" The red box is in the cell [{bbox[0]}, {bbox[1]}, {bbox[2]}, {bbox[3]}].",
                     suffix=_texture_choices())


def _texture_choices() -> str:
    return f" Answer with one of: {', '.join(ZOOM_TEXTURES)}."


@register_task("zoom_texture")
def zoom_texture(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """``zoom``'s image, grid and red box (the question names the box's cell, as ``zoom_digit_at``'s does), the box
    filled with one of four black-and-white textures (:data:`ZOOM_TEXTURES`); answer: its name (chance 0.25).
    Difficulty does not change it.

    The textures differ in 1- and 2-pixel structure only and average to the same grey: the tiny VLM sees the
    448 x 448 image at 112 x 112 (a 4x bicubic downscale with antialiasing, in both the torchvision and the PIL
    backends of the Qwen2-VL image processor), where every texture becomes the same grey; the texture's contrast
    ramps up from its region's edge (:func:`texture_patch`) so the edges do not tell it either (the processed
    images of the four textures of one layout differ by at most one grey level, tests/agents/test_zoom.py). The
    texture's phase is fixed by absolute image coordinates and the cells start at multiples of 4, so the crop
    (the box's 112 x 112 cell, seen 1:1) shows the same stripes in every item. The region's sides are 8-20
    pixels in from the cell's (in steps of 4 at the default size, drawn independently), the red box 6 pixels around it."""
    return zoom_texture_item(rng, image_size)


@register_task("zoom_texture_read")
def zoom_texture_read(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """The reading part of ``zoom_texture`` alone (as :func:`zoom_digit_read` for digits): the image IS the crop the
    zoom call returns, the answer its texture, the trace the final message of a zoom trace. A reading probe."""
    return _reading_row(zoom_texture_item(rng, image_size), noun="texture", what="fills",
                        suffix=_texture_choices())


_FIRST_NAMES = ("Ada", "Bram", "Cleo", "Dario", "Edda", "Femi", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena")
_LAST_NAMES = ("Abbott", "Brook", "Castell", "Drummond", "Ellery", "Frost", "Garrow", "Holt", "Ingram", "Jessop")


def lookup_trace(person: str) -> list[dict[str, str]]:
    """The single-agent conversation that solves a ``twohop`` row with the lookup tool (two calls, then the
    answer); the tool answers are the real ones, distractors included."""
    from mmpo.tools.lookup import city_of, lookup, population_of

    city = city_of(person)
    calls = [json.dumps({"name": "lookup", "arguments": {"key": key}}) for key in (f"person:{person}", f"city:{city}")]
    return [
        {"role": "assistant", "content": f"<tool_call>\n{calls[0]}\n</tool_call>"},
        {"role": "tool", "content": lookup(f"person:{person}")},
        {"role": "assistant", "content": f"<tool_call>\n{calls[1]}\n</tool_call>"},
        {"role": "tool", "content": lookup(f"city:{city}")},
        {"role": "assistant", "content": f"<think>{person} lives in {city}, which has {population_of(city)} "
                                         f"inhabitants.</think><answer>{population_of(city)}</answer>"},
    ]


@register_task("twohop")
def twohop(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """How many people live in the city where <person> lives? Two lookups (person -> city -> population), each
    answer padded with distractor records (mmpo.tools.lookup); answer: the population."""
    from mmpo.tools.lookup import city_of, population_of

    person = f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"
    city = city_of(person)
    value = str(population_of(city))
    return {
        "images": [], "problem": f"How many people live in the city where {person} lives?", "answer": value,
        "steps": [f"{person} lives in {city}.", f"{city} has {value} inhabitants.", f"So the answer is {value}."],
        "key_steps": [[city], [value]], "needs_image": False, "image_description": "There is no image.",
        "rationale": "I look the person up, then the city.", "tool_trace": lookup_trace(person),
    }


def codebook_key(rng: random.Random) -> str:
    """A key: a lower-case letter, a digit, a lower-case letter (``b7k``: 6 760 keys)."""
    from mmpo.tools.codebook import DIGITS

    letters = "abcdefghijklmnopqrstuvwxyz"
    return rng.choice(letters) + rng.choice(DIGITS) + rng.choice(letters)


def codebook_trace(key: str, value: str) -> list[dict[str, str]]:
    """The tool-use conversation after the prompt: look the key up, answer the tool's code."""
    call = json.dumps({"name": "codebook", "arguments": {"key": key}})
    return [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": f"<think>I read the code.</think><answer>{value}</answer>"},
    ]


@register_task("codebook")
def codebook(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """The code of a random key (``mmpo.tools.codebook``: a hash, so only the tool knows it). Every difficulty
    gives the same kind of item (keys and codes of fixed length: the test is whether the model uses the tool).
    The row is a function of the key, so the registry's content-hash splits hold disjoint keys: a held-out key's
    code cannot be memorised in training."""
    from mmpo.tools.codebook import code_of

    key = codebook_key(rng)
    value = code_of(key)
    return {
        "images": [], "problem": f'What is the code of "{key}"?', "answer": value,
        "steps": [f'The codebook gives the code of "{key}".', f"It is {value}.", f"So the answer is {value}."],
        "key_steps": [[value]], "needs_image": False, "image_description": "There is no image.",
        "rationale": "I look the key up in the codebook.", "tool_trace": codebook_trace(key, value),
    }


CODEBOOK_PAIR_REPEAT = 0.5
"""Share of ``codebook_pair`` traces that look one of the two keys up twice (a redundant call)."""


def codebook_key_split(key: str) -> str:
    """The split that owns ``key`` in ``codebook_pair``: its bucket sha256("codebook-split:" + key)[:8] mod 100,
    read against the registry's ``SPLIT_BUCKETS`` (train 0-79, val 80-89, test 90-99)."""
    from mmpo.data.synthetic.registry import SPLIT_BUCKETS

    bucket = int.from_bytes(hashlib.sha256(("codebook-split:" + key).encode()).digest()[:8], "big") % 100
    return next(split for split, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


def codebook_pair_trace(keys: Sequence[str], repeat: int | None = None) -> list[dict[str, str]]:
    """The tool-use conversation after a ``codebook_pair`` prompt: one codebook call per turn, in the order of
    ``keys``, the call of ``keys[repeat]`` made twice in a row when ``repeat`` is set (a redundant lookup), then the
    codes joined as the answer."""
    from mmpo.tools.codebook import code_of

    order = list(keys)
    if repeat is not None:
        order.insert(repeat + 1, keys[repeat])
    messages: list[dict[str, str]] = []
    for key in order:
        call = json.dumps({"name": "codebook", "arguments": {"key": key}})
        messages += [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                     {"role": "tool", "content": code_of(key)}]
    answer = "".join(code_of(key) for key in keys)
    return [*messages, {"role": "assistant", "content": f"<think>I read the codes.</think><answer>{answer}</answer>"}]


_PAIR_ATTEMPTS = 100_000


@register_task("codebook_pair")
def codebook_pair(rng: random.Random, difficulty: int, image_size: int) -> dict[str, Any]:
    """The codes of two different keys, joined (``D8S5`` for "b7k" and "q0z"): at least two codebook calls (one per
    key, or one turn with both), as many more as the model chooses. ``tool_trace`` makes one call per turn and,
    with probability :data:`CODEBOOK_PAIR_REPEAT`, repeats one of them (which one: a fair coin), so the SFT start
    sometimes spends a redundant call that RL may drop. Held-out keys are never seen in training: both keys of a row
    belong to one split (:func:`codebook_key_split`) and the row is only made when the registry's content hash puts
    it in that split too, so train / val / test hold disjoint keys, not only disjoint pairs. Every difficulty gives
    the same kind of item."""
    from mmpo.data.synthetic.registry import SPLIT_BUCKETS, content_bucket
    from mmpo.tools.codebook import code_of

    first = codebook_key(rng)
    split = codebook_key_split(first)
    for _ in range(_PAIR_ATTEMPTS):
        second = codebook_key(rng)
        if second == first or codebook_key_split(second) != split:
            continue
        keys = (first, second)
        problem, answer = f'Join the codes of "{first}" and "{second}".', code_of(first) + code_of(second)
        if content_bucket({"problem": problem, "answer": answer, "images": []}) in SPLIT_BUCKETS[split]:
            break
    else:
        raise RuntimeError(f"codebook_pair: no second key for {first!r} in {_PAIR_ATTEMPTS} draws")
    repeat = rng.randrange(2) if rng.random() < CODEBOOK_PAIR_REPEAT else None
    return {
        "images": [], "problem": problem, "answer": answer,
        "steps": [f'The codebook gives the code of "{first}": {code_of(first)}.',
                  f'The codebook gives the code of "{second}": {code_of(second)}.', f"So the answer is {answer}."],
        "key_steps": [[answer]], "needs_image": False, "image_description": "There is no image.",
        "rationale": "I look both keys up in the codebook.", "tool_trace": codebook_pair_trace(keys, repeat),
    }
