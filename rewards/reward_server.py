"""Serve any project scorer over the remote-scorer protocol (rewards/remote_protocol.py).

    python -m rewards.reward_server --kind ocr --port 8100              # 127.0.0.1 by default
    python -m rewards.reward_server --spec scorer.yaml --port 8100      # a ScorerSpec as YAML

POST /score scores one request; GET /healthz answers {"status": "ok", "scorer": name}. Bodies
are JSON (never pickle), bounded in bytes and decoded pixels; a client's mistake is a 4xx with
the error object of contract/errors.py, a scorer failure a 500 with the same shape.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from contract import RolloutError
from rewards.base import Scorer, ScoreRequest
from rewards.remote_protocol import ScoreBody, decode_body, output_json


def build_app(scorer: Scorer, max_body_bytes: int = 64 << 20,
              max_pixels: int = 2048 * 2048) -> Starlette:
    lock = asyncio.Lock()          # one scoring call at a time per process (models are not
                                   # re-entrant); concurrency comes from more server processes

    async def score(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > max_body_bytes:
            return _error(413, "LimitExceededError", "body", f"more than {max_body_bytes} bytes")
        try:
            parsed = ScoreBody.model_validate_json(body)
            arts, _ = decode_body(parsed, max_pixels)
            req = ScoreRequest(artifacts=arts, prompts=tuple(parsed.prompts),
                               metadata=tuple(parsed.metadata))
        except ValidationError as e:
            first = e.errors()[0]
            return _error(422, "ValidationError", ".".join(map(str, first["loc"])), first["msg"])
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

    return Starlette(routes=[Route("/score", score, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])])


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
    args = parser.parse_args(argv)
    if args.spec:
        with open(args.spec) as f:
            spec: Any = ScorerSpec.model_validate(yaml.safe_load(f))
    else:
        spec = ScorerSpec(kind=args.kind, params=json.loads(args.params))
    uvicorn.run(build_app(build_scorer(spec)), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
