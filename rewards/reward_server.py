"""Serve any project scorer over the remote-scorer protocol (rewards/remote_protocol.py).

    python -m rewards.reward_server --kind ocr --port 8100              # 127.0.0.1 by default
    python -m rewards.reward_server --spec scorer.yaml --port 8100      # a ScorerSpec as YAML

POST /score scores one request; GET /healthz answers {"status": "ok", "scorer": name}. Bodies
are application/json (never pickle), strict JSON, bounded in bytes before they are read whole,
in pixels per image and in pixels and audio samples per body (from each item's header, before
it decodes); parsing and decoding run off the event loop. A body's `groups` reach the scorer as
ScoreRequest.groups, so a groupwise scorer (PickScore_Rank) ranks within each group it was sent. A client's mistake is a 4xx with the
error object of contract/errors.py; any other failure, an unknown path included, the same
shape with its status -- never a plain-text answer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from contract import InvalidRequestError, MalformedBodyError, RolloutError
from contract.errors import UnsupportedMediaTypeError
from contract.http import read_bounded_body
from rewards.base import Scorer, ScoreRequest
from rewards.http_client import strict_json
from rewards.remote_protocol import ScoreBody, decode_body, output_json

logger = logging.getLogger(__name__)


def build_app(scorer: Scorer, max_body_bytes: int = 64 << 20, max_pixels: int = 2048 * 2048,
              max_body_pixels: int = 32 << 20, max_body_samples: int = 16 << 20) -> Starlette:
    """`max_body_bytes` bounds the body (by its Content-Length, then while it streams in);
    `max_pixels` one image; `max_body_pixels` / `max_body_samples` what one body decodes to."""
    lock = asyncio.Lock()          # one scoring call at a time per process (models are not
                                   # re-entrant); concurrency comes from more server processes

    def parse(body: bytes) -> ScoreRequest:
        try:
            payload = strict_json(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise MalformedBodyError(f"body is not strict UTF-8 JSON: {e}"[:300],
                                     field="body") from None
        parsed = ScoreBody.model_validate(payload)
        missing = sorted(set(scorer.required_artifacts) - set(parsed.media))
        if missing:                         # the client's omission, not the scorer's fault
            raise InvalidRequestError(f"scorer {scorer.name!r} reads media the body lacks",
                                      field=f"media.{missing[0]}",
                                      expected=list(scorer.required_artifacts),
                                      actual=sorted(parsed.media))
        arts, _ = decode_body(parsed, max_pixels, max_body_pixels, max_body_samples)
        return ScoreRequest(artifacts=arts, prompts=tuple(parsed.prompts),
                            metadata=tuple(parsed.metadata), groups=tuple(parsed.groups))

    async def score(request: Request) -> JSONResponse:
        try:
            _check_json_type(request)
            body = await _read_bounded(request, max_body_bytes)
            req = await asyncio.to_thread(parse, body)      # decoding is off the event loop
            del body
        except ValidationError as e:
            first = e.errors(include_url=False, include_context=False, include_input=False)[0]
            return _error(422, "ValidationError", ".".join(map(str, first["loc"])) or "body",
                          first["msg"])
        except RolloutError as e:
            return JSONResponse(e.to_dict(), status_code=e.http_status)
        try:
            async with lock:
                out = await asyncio.to_thread(scorer.score, req)
        except RolloutError as e:
            return JSONResponse(e.to_dict(), status_code=e.http_status)
        except Exception as e:  # noqa: BLE001 -- the error object, never a bare 500
            return _error(500, type(e).__name__, "scorer", str(e)[:500])
        return JSONResponse(output_json(out))

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "scorer": scorer.name, "primary": scorer.primary})

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, "HTTPError", "path", str(exc.detail)[:200])

    async def failed(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("reward server failed answering %s", request.url.path)
        return _error(500, type(exc).__name__, "scorer", str(exc)[:500])

    return Starlette(routes=[Route("/score", score, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])],
                     exception_handlers={HTTPException: http_error, Exception: failed})


def _check_json_type(request: Request) -> None:
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaTypeError("the body must be JSON", field="content-type",
                                        expected="application/json", actual=declared[:100])


async def _read_bounded(request: Request, bound: int) -> bytes:
    """The body within `bound` (contract.http.read_bounded_body); a Content-Length that is not
    a byte count is left to the stream's own bound."""
    declared = request.headers.get("content-length", "")
    return bytes(await read_bounded_body(
        int(declared) if declared.strip().isdecimal() else None, request.stream(), bound))


def _error(status: int, kind: str, field: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "field": field, "message": message}},
                        status_code=status)


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    import yaml

    from rewards.registry import ScorerSpec, build_scorer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", help="scorer kind (rewards.registry.ScorerKind)")
    parser.add_argument("--params", default="{}", help="JSON object of the scorer's params")
    parser.add_argument("--spec", help="YAML file holding a ScorerSpec")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-body-pixels", type=int, default=32 << 20,
                        help="decoded pixels of all images / frames of one request")
    parser.add_argument("--max-body-samples", type=int, default=16 << 20,
                        help="decoded audio samples (frames x channels) of one request")
    args = parser.parse_args(argv)
    if args.spec:
        with open(args.spec) as f:
            spec: Any = ScorerSpec.model_validate(yaml.safe_load(f))
    else:
        spec = ScorerSpec(kind=args.kind, params=json.loads(args.params))
    app = build_app(build_scorer(spec), max_body_bytes=args.max_body_bytes,
                    max_body_pixels=args.max_body_pixels, max_body_samples=args.max_body_samples)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
