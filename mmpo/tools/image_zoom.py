"""Image crop / zoom for VLMs ("thinking with images"): the region of the input image at full resolution.

A VLM sees its input image at the processor's pixel budget (the tiny Qwen2.5-VL: at most 112 x 112 pixels), so a
small detail of a large image is lost in the downscale. ``image_zoom_in_tool(bbox_2d)`` crops the region
``[x1, y1, x2, y2]`` (pixels of the original image) and returns it as a new image in the conversation, which the
processor then resizes within the same pixel budget: a 112 x 112 crop of a 448 x 448 image is seen at 4x the
resolution of the whole image. The name and argument follow verl's ``verl/tools/image_zoom_in_tool.py`` (after
DeepEyes, arXiv 2505.14362): ``bbox_2d`` in absolute pixel coordinates, clipped to the image, and a region
smaller than :data:`MIN_SIDE` (28 pixels, Qwen-VL's patch x merge size; verl's ``MIN_DIMENSION``) on a side
is grown around its centre to that size.

An image tool is not a sandboxed function: it needs the episode's images and returns an image, so it runs in the
trainer's process on PIL images (a crop of a bounded box; no user code). A function is an image tool when it
carries ``__mmpo_image_tool__``, the callable ``run(images, **arguments) -> PIL.Image`` that does the work
(:func:`image_tool`); the function itself supplies the JSON schema the model sees (type hints and docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

MIN_SIDE = 28
"""Smallest side of a crop, pixels (verl ``image_zoom_in_tool.py``: ``MIN_DIMENSION = 28``)."""


def image_tool(run: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Mark a typed, documented function as an image tool whose work ``run(images, **arguments)`` does."""

    def mark(function: Callable) -> Callable:
        function.__mmpo_image_tool__ = run
        return function

    return mark


def crop_region(images: Sequence[Any], bbox_2d: Any) -> Any:
    """The region ``bbox_2d = [x1, y1, x2, y2]`` of the first image, at full resolution (a PIL image).

    The box is clipped to the image; a side shorter than :data:`MIN_SIDE` is grown around its centre (kept inside
    the image). Raises ValueError (a short message for the model) for a malformed box, one outside the image, or
    an episode without images. Example: on a 448 x 448 image, [100, 40, 110, 50] -> the 28 x 28 region
    [91, 31, 119, 59]."""
    if not images:
        raise ValueError("there is no image to zoom into")
    if (not isinstance(bbox_2d, (list, tuple)) or len(bbox_2d) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox_2d)):
        raise ValueError("bbox_2d must be four numbers [x1, y1, x2, y2]")
    image = images[0]
    width, height = image.size
    x1, y1, x2, y2 = (float(v) for v in bbox_2d)
    if not (x2 > x1 and y2 > y1):
        raise ValueError(f"bbox_2d {list(bbox_2d)} is empty: need x2 > x1 and y2 > y1")
    x1, y1, x2, y2 = max(0.0, x1), max(0.0, y1), min(float(width), x2), min(float(height), y2)
    if not (x2 > x1 and y2 > y1):
        raise ValueError(f"bbox_2d {list(bbox_2d)} is outside the {width}x{height} image")
    box = []
    for low, high, size in ((x1, x2, width), (y1, y2, height)):
        side = min(max(high - low, MIN_SIDE), size)
        centre = (low + high) / 2
        start = min(max(centre - side / 2, 0.0), size - side)
        box += [round(start), round(start + side)]
    left, right, top, bottom = box
    return image.crop((left, top, right, bottom))


@image_tool(lambda images, bbox_2d: crop_region(images, bbox_2d))
def image_zoom_in_tool(bbox_2d: list[int]) -> str:
    """Zoom in on a region of the image: returns that region at full resolution as a new image.

    Args:
        bbox_2d: the region to zoom into, [x1, y1, x2, y2] in pixels of the original image (x to the right, y down).
    """
    raise RuntimeError("image_zoom_in_tool runs in the multi-turn environment on the episode's images")


def image_tool_runner(function: Callable) -> Callable[..., Any] | None:
    """The work of an image tool (``run(images, **arguments)``), or None for an ordinary (sandboxed) tool."""
    return getattr(function, "__mmpo_image_tool__", None)
