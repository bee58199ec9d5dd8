"""The edit task over HTTP, in process (deployments/http.py on the tiny FLUX checkpoint, whose
family serves t2i and edit): one base64 source image per prompt in `images`, decoded with every
bound checked before its pixels are, never resized or converted; each refusal a typed 4xx naming
`images` / `images[i]` and the value, before any rollout."""
from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from starlette.requests import Request

from contract import MediaRole, StageUnavailableError, Task
from deployments.http import HTTPFront

CAPTION = "make the circle red"


class GateOnly(HTTPFront):
    """The HTTP face without stages: a request passing every HTTP check reaches `rollout`,
    which records it and answers 503."""

    def __init__(self, config, family):
        self.config, self.family = config, family
        self.reached: list = []

    async def rollout(self, requests, preview=False):
        self.reached.append(requests)
        raise StageUnavailableError("no stages in this test", field="stage")

    async def release(self, request_ids) -> int:
        return 0


@pytest.fixture(scope="module")
def front(tiny_checkpoint):
    from adapters.registry import get_family
    from deployments.config import load_graph_config
    root = str(tiny_checkpoint("flux"))
    config = load_graph_config({"rollout": {"adapter": "flux", "weights_path": root,
                                            "adapter_options": {"max_sequence_length": 48}},
                                "limits": {"max_prompts": 4, "max_height": 256,
                                           "max_width": 256}})
    return GateOnly(config, get_family("flux", root, {"max_sequence_length": 48}))


def encoded(pixels: np.ndarray, mode: str | None = None, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(out, format=fmt)
    return base64.b64encode(out.getvalue()).decode()


def picture(h: int = 48, w: int = 80, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(0)
    shape = (h, w, channels) if channels > 1 else (h, w)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def post(front: GateOnly, body: dict) -> tuple[int, dict, bool]:
    data = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/rollout", "root_path": "",
             "headers": [(b"content-length", str(len(data)).encode()),
                         (b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}
    before = len(front.reached)
    response = asyncio.run(front(Request(scope, receive)))
    return response.status_code, json.loads(response.body), len(front.reached) > before


def edit(**extra) -> dict:
    return {"prompts": [CAPTION], "task": "edit", "num_steps": 2, "height": 64, "width": 96,
            **extra}


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_an_edit_carries_its_source_image_to_the_rollout_unchanged(front, fmt):
    pixels = picture()
    status, answer, reached = post(front, edit(images=[encoded(pixels, fmt=fmt)]))
    assert reached and status == 503, answer
    [request] = front.reached[-1]
    assert request.task is Task.EDIT
    [item] = request.media
    assert item.role is MediaRole.IMAGE and item.data.dtype == torch.uint8
    if fmt == "PNG":                                      # lossless: the very pixels
        assert torch.equal(item.data, torch.from_numpy(pixels).permute(2, 0, 1))
    assert tuple(item.data.shape) == (3, 48, 80)          # its own size: nothing resized


@pytest.mark.parametrize("body,field,actual", [
    (edit(), "images", None),                                           # an edit without it
    (edit(images=["!!not base64!!"]), "images[0]", "!!not base64!!"),
    (edit(images=[encoded(picture(channels=4), "RGBA")]), "images[0]", "RGBA"),
    (edit(images=[encoded(picture(channels=1), "L")]), "images[0]", "L"),
    (edit(images=[encoded(picture(), fmt="GIF")]), "images[0]", None),   # not a format taken
    (edit(images=[encoded(picture(32, 272))]), "images[0]", "272 x 32"),  # over max_width
    (edit(images=[encoded(picture()), encoded(picture())]), "images", 2),
    (edit(images=[[encoded(picture()), encoded(picture())]]), "images[0]", 2),  # FLUX takes 1
    (edit(images=[[encoded(picture())] * 4]), "images[0]", 4),      # beyond any edit's roles
    ({"prompts": [CAPTION], "images": [encoded(picture())]}, "images", 1),  # t2i takes none
])
def test_bad_source_images_are_typed_4xx_naming_the_field_before_any_rollout(front, body,
                                                                            field, actual):
    status, answer, reached = post(front, body)
    assert not reached and 400 <= status < 500, answer
    assert answer["error"]["field"] == field, answer
    if actual is not None:
        assert str(actual) in answer["error"]["message"] or \
            str(actual) in json.dumps(answer), answer
