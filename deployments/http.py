"""The graph's HTTP face: POST /rollout and GET /healthz on the RolloutGraph ingress.

Bodies are read bounded (refused once past max_body_bytes, never held whole), parsed and bounded
by contract/http.py before anything proportional to them is built, turned into the same
RolloutRequests the handle API takes and answered as JSON: results with their rewards and (when
asked) base64 previews, or a typed error object with the status its type maps to -- never a bare
500. No tensor leaves by HTTP: the request's outputs are released once the answer is built.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Sequence

from pydantic import ValidationError
from ray.exceptions import RayTaskError
from starlette.requests import Request
from starlette.responses import JSONResponse

from contract import (GraphResult, InvalidRequestError, MalformedBodyError, MediaInput,
                      MediaRole, Modality, RolloutError, RolloutRequest, SamplingSpec)
from contract.errors import (MethodNotAllowedError, MisdirectedRequestError, NotFoundError,
                             UnsupportedMediaTypeError)
from contract.http import (HTTPRolloutRequest, error_field, first_error, parse_rollout_body,
                           read_bounded_body)
from deployments.source_images import decode_source_image, decode_source_images

logger = logging.getLogger("ray.serve")


class HTTPFront:
    """HTTP on the ingress (needs its `config`, `family`, `rollout` and `release`)."""

    async def __call__(self, http: Request) -> JSONResponse:
        """Every answer is JSON: results, or an error object with the status its type maps to;
        an unexpected failure is logged and answered 500 with an error object, never bare.
        `Server-Timing: ingress;dur=<ms>` tells how long the ingress took."""
        start = time.perf_counter()
        try:
            response = await self._http(http)
        except Exception:  # noqa: BLE001 -- the one place an unexpected error becomes a 500
            logger.exception("RolloutGraph failed answering %s %s", http.method, http.url.path)
            response = _error(500, "InternalError", None, "the ingress failed; see its log")
        response.headers["Server-Timing"] = f"ingress;dur={(time.perf_counter() - start) * 1e3:.3f}"
        return response

    async def _http(self, http: Request) -> JSONResponse:
        try:
            route = _route(http, self.config.http.allowed_hosts)
            if route == "healthz":
                return JSONResponse({"status": "ok", "adapter": self.config.adapter})
            _check_json_body(http)
            body = await self._read_body(http)
            # parsing, tokenizing and rendering grow with the body: off the event loop that
            # every other request of this replica waits on
            payload = await asyncio.to_thread(parse_rollout_body, body, self.config.limits)
            del body
            requests = await asyncio.to_thread(self._from_http, payload)
            results = await self.rollout(requests, preview=payload.include_media)
            try:
                return await asyncio.to_thread(_results_response, payload.prompts, results)
            finally:                 # no tensor leaves by HTTP, answered or not
                await self.release([r.request_id for r in results])
        except ValidationError as exc:
            first = first_error(exc)
            return _error(422, "ValidationError", error_field(first["loc"]), first["msg"])
        except RolloutError as exc:
            error = stage_error(exc)
            return JSONResponse(error.to_dict(), status_code=error.http_status)

    async def _read_body(self, http: Request) -> bytearray:
        """The body within max_body_bytes (contract.http.read_bounded_body); a Content-Length
        that is not a byte count is refused first."""
        bound = self.config.limits.max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None and not declared.strip().isdecimal():
            raise MalformedBodyError("Content-Length is not a byte count", field="content-length",
                                     actual=declared[:40])
        return await read_bounded_body(None if declared is None else int(declared),
                                       http.stream(), bound)

    def _from_http(self, payload: HTTPRolloutRequest) -> list[RolloutRequest]:
        """Sizes are already bounded (parse_rollout_body); the task is checked before the
        prompts are tokenized, the rest by `rollout` before any stage."""
        defaults = dict(self.family.spec.sampling_defaults)
        task = payload.task or next(iter(self.family.spec.tasks))
        if task not in self.family.spec.tasks:
            raise InvalidRequestError(f"adapter {self.family.name} does not serve this task",
                                      field="task", expected=[t.value for t in self.family.spec.tasks],
                                      actual=task.value)
        media = self._http_media(payload, task)
        bundles = self.family.conditioner.tokenize(payload.prompts, payload.negative_prompts)
        n = payload.samples_per_prompt
        out = []
        for i, bundle in enumerate(bundles):
            sampling = SamplingSpec(
                sampler=payload.sampler, num_steps=payload.num_steps,
                noise_level=payload.noise_level, sde_window=payload.sde_window,
                guidance_scale=payload.guidance_scale,
                seeds=tuple(payload.seed + i * n + j for j in range(n)),
                height=payload.height or defaults.get("height", 32),
                width=payload.width or defaults.get("width", 32),
                num_frames=payload.num_frames or defaults.get("num_frames", 1))
            out.append(RolloutRequest(prompt=bundle, sampling=sampling, task=task,
                                      media=media[i] if media else None,
                                      requested_artifacts=payload.artifacts,
                                      policy_version=payload.policy_version,
                                      metadata=dict(payload.metadata[i]) if payload.metadata
                                      else {}, branch=payload.branch))
        return out


    def _http_media(self, payload: HTTPRolloutRequest, task) -> list[tuple[MediaInput, ...]]:
        """The condition media HTTP carries, decoded and bounded by deployments/source_images.py:
        an edit's source image per prompt (`images`), or per prompt the keyframes / ordered
        references of a task that takes them (`media`, by role). A task without its media, a
        role it does not take, or media for a task without any: typed, naming the field."""
        roles = self.family.spec.tasks[task]
        if roles and roles != (MediaRole.IMAGE,):
            return self._http_role_media(payload, task, roles)
        if payload.media is not None:
            raise InvalidRequestError(f"task {task.value} takes no condition media by role",
                                      field="media", expected=None, actual=len(payload.media))
        if roles == (MediaRole.IMAGE,):
            if payload.images is None:
                raise InvalidRequestError(f"task {task.value} takes one source image per prompt",
                                          field="images", expected=len(payload.prompts),
                                          actual=None)
            # one image, or an ordered list a multi-image edit takes (its optional roles)
            sources = (MediaRole.IMAGE, *self.family.spec.optional_media.get(task, ()))
            return [decode_source_images(entry, f"images[{i}]", self.config.limits, sources)
                    for i, entry in enumerate(payload.images)]
        if roles:
            raise InvalidRequestError(f"task {task.value} needs condition media, which an HTTP "
                                      "request cannot carry (use the handle API)", field="media",
                                      expected=sorted(r.value for r in roles), actual=[])
        if payload.images is not None:
            raise InvalidRequestError(f"task {task.value} takes no image", field="images",
                                      expected=None, actual=len(payload.images))
        return []

    def _http_role_media(self, payload: HTTPRolloutRequest, task,
                         roles) -> list[tuple[MediaInput, ...]]:
        """`media[i]`: exactly the task's roles for every prompt; a list role (ref2va's
        `reference`) becomes one MediaInput per image, in the body's order."""
        want = sorted(r.value for r in roles)
        if payload.media is None or payload.images is not None:
            raise InvalidRequestError(f"task {task.value} takes its condition images by role in "
                                      "`media`, one object per prompt", field="media"
                                      if payload.media is None else "images",
                                      expected=want, actual=None if payload.media is None
                                      else len(payload.images))
        out = []
        for i, item in enumerate(payload.media):
            given = item.given()
            if sorted(given) != want:
                raise InvalidRequestError(f"task {task.value} takes exactly the media roles "
                                          f"{want}", field=f"media[{i}]", expected=want,
                                          actual=sorted(given))
            inputs = []
            for role in roles:
                value = given[role.value]
                texts = [(f"media[{i}].{role.value}", value)] if isinstance(value, str) else \
                    [(f"media[{i}].{role.value}[{j}]", t) for j, t in enumerate(value)]
                inputs += [MediaInput(Modality.IMAGE, role,
                                      decode_source_image(text, field, self.config.limits))
                           for field, text in texts]
            out.append(tuple(inputs))
        return out


def stage_error(exc: BaseException) -> BaseException:
    """A stage's own exception inside Ray's RayTaskError wrapper (so its type names it)."""
    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else exc


ROUTES = {"/rollout": "POST", "/healthz": "GET"}


_HOST = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?")


def request_host(http: Request) -> str | None:
    """The Host header's name, lower case, without port or brackets; None when it is absent or
    not one host[:port]."""
    match = _HOST.fullmatch(http.headers.get("host", "").lower())
    if match is None:
        return None
    return match["ip6"] or match["name"].rstrip(".")


def _route(http: Request, allowed_hosts: Sequence[str]) -> str:
    """'rollout' or 'healthz', for a request to an allowed Host at exactly that path (relative
    to the app's route prefix) with its method; otherwise a typed 421 / 404 / 405."""
    host = request_host(http)
    if host not in allowed_hosts:
        raise MisdirectedRequestError("this service does not answer that Host",
                                      field="host", expected=list(allowed_hosts),
                                      actual=(http.headers.get("host") or "")[:100])
    path, root = http.scope.get("path", ""), http.scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    if path not in ROUTES:
        raise NotFoundError(f"{path[:100]!r} is not served", field="path",
                            expected=sorted(ROUTES), actual=path[:100])
    if http.method != ROUTES[path]:
        raise MethodNotAllowedError(f"{path} takes {ROUTES[path]}", field="method",
                                    expected=ROUTES[path], actual=http.method[:16])
    return path[1:]


def _check_json_body(http: Request) -> None:
    """Only `application/json` (charset utf-8 if named): a form or text/plain POST, which any
    web page can make a browser send without a CORS preflight, is refused before it is read."""
    declared = http.headers.get("content-type", "")
    media_type, _, params = declared.partition(";")
    charset = [p.strip().lower() for p in params.split(";") if p.strip()]
    if media_type.strip().lower() != "application/json" or \
            any(p not in ("charset=utf-8", 'charset="utf-8"') for p in charset):
        raise UnsupportedMediaTypeError("the body must be JSON", field="content-type",
                                        expected="application/json", actual=declared[:100])


def _results_response(prompts: Sequence[str], results: Sequence[GraphResult]) -> JSONResponse:
    return JSONResponse({"results": [_result_json(p, r) for p, r in zip(prompts, results)]})


def _error(status: int, kind: str, field: str | None, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "field": field, "message": message}},
                        status_code=status)


def _result_json(prompt: str, result: GraphResult) -> dict[str, Any]:
    samples = []
    for i, seed in enumerate(result.seeds):
        sample: dict[str, Any] = {
            "seed": seed, "policy_version": result.policy_version,
            "artifacts": [h.summary() | {"shape": list(h.shape[1:])}
                          for h in result.artifacts.values()]}
        if result.rewards is not None:
            sample["reward"] = result.rewards.total[i]
            sample["scores"] = {name: {k: v[i] for k, v in out.scores.items()} |
                                {"status": out.status[i].value, "reason": out.reasons[i]} |
                                ({"metadata": dict(out.metadata)} if out.metadata else {})
                                for name, out in result.rewards.by_scorer.items()}
        if result.previews:
            sample["media"] = {name: urls[i] for name, urls in result.previews.items()}
        if result.tree is not None:      # the sample is leaf `node` of the tree below
            sample["node"] = result.tree.leaves[i]
        samples.append(sample)
    return {"prompt": prompt, "request_id": result.request_id,
            "stop_reason": result.stop_reason.value, "samples": samples,
            **({"tree": result.tree.as_json()} if result.tree is not None else {})}
