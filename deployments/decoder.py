"""Decoder stage: one deployment per latent kind (image/video VAE, audio VAE).

Receives the rollout stage's handles, fetches only its own latent from the object store, decodes
only the decoded artifacts that were requested, and returns new handles (plus previews on request).

Micro-batching (`decoder.max_batch_size`, `decoder.batch_wait_timeout_s`): concurrent requests'
latents of one per-row shape, media size and artifact set decode in one forward (`@serve.batch`),
each request getting its own rows back (copies: a request's artifact never pins its batch
mates'); a joint decode that raises -- NaN / Inf from one request's rows included -- is redone
request by request, so a failing request fails alone (deployments/microbatch.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from ray import serve

from adapters.registry import get_family
from contract import (MediaArtifact, MissingArtifactError, Modality, Representation,
                      SamplingSpec, StageOutput, UndeclaredArtifactError, validate_artifact)
from deployments.memory import guard_replica_memory
from deployments.metrics import StageMetrics
from deployments.microbatch import in_serve_replica, run_isolated
from deployments.objects import HolderShards, HolderSpec, ObjectKeeper
from deployments.previews import av_preview_urls, preview_urls
from rollout.recorder import check_finite


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a module returned: itself, a tuple / list of them, or a diffusers output
    (a mapping such as DecoderOutput)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@contextlib.contextmanager
def finite_module_outputs(modules: Mapping[str, torch.nn.Module], request_id: str):
    """While open, every floating output of each decoder component and of its direct children
    (a VAE's decoder, post-quant conv; a vocoder) is checked finite: NaN / Inf a decoder makes
    from a finite latent is a NonFiniteOutputError for this request, before any uint8
    quantisation could hide it."""
    def hook(field: str):
        def check(module, args, output) -> None:
            for tensor in _tensors(output):
                if tensor.is_floating_point():
                    check_finite(tensor, field, request_id)
        return check
    handles = []
    for name, module in modules.items():
        for child, sub in [("", module), *module.named_children()]:
            field = f"decoded.{name}" + (f".{child}" if child else "")
            handles.append(sub.register_forward_hook(hook(field)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _DecodeCall:
    """One request's latent on its way through the micro-batch (emptied once decoded: Serve's
    batch loop keeps its last batch's arguments alive until the next batch arrives)."""

    latent: MediaArtifact | None
    wanted: tuple
    request_id: str
    sampling: SamplingSpec

    def key(self) -> tuple:
        """What requests decoded together share: the latent's per-row shape and dtype, the media
        size a codec's decode reads from the sampling, and the artifacts made."""
        s = self.sampling
        return (tuple(self.latent.data.shape[1:]), self.latent.data.dtype,
                tuple(a.name for a in self.wanted), s.height, s.width, s.num_frames)


class DecoderServer:
    """Decodes the latent artifact `latent_name` into its requested decoded artifacts."""

    def __init__(self, adapter: str, weights_path: str | None, latent_name: str,
                 max_preview_pixels: int, device: str = "cpu", dtype: str = "float32",
                 options: dict | None = None, objects: HolderSpec | None = None,
                 max_batch_size: int = 8, batch_wait_timeout_s: float = 0.0):
        """objects: the graph's ObjectHolder actor and its bounds (None: this replica holds
        its puts)."""
        self.memory_guard = guard_replica_memory(f"Decoder_{latent_name}")
        self.family = get_family(adapter, weights_path, options)
        self.latent_name = latent_name
        self.outputs = tuple(a for a in self.family.io_spec.artifacts
                             if a.representation == Representation.DECODED
                             and a.source == latent_name)
        if not self.outputs:
            raise UndeclaredArtifactError(f"{adapter} declares no decoded artifact from "
                                          f"{latent_name!r}", field="latent_name",
                                          actual=latent_name)
        # only this latent's decoder components (a VAE; audio VAE + vocoder)
        self.modules = self.family.load_decoder(latent_name, dtype, device)
        self.max_preview_pixels = max_preview_pixels
        self.metrics = StageMetrics(f"decoder:{latent_name}")
        self.objects = ObjectKeeper(holder=None if objects is None else HolderShards(objects))
        self.forwards = self.forward_rows = 0      # decodes run, latent rows in them
        self._in_replica = in_serve_replica()   # serve.batch needs one; in-process: no batching
        if self._in_replica:
            self._decode_batch.set_max_batch_size(max_batch_size)
            self._decode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def decode(self, latents: StageOutput, names: Sequence[str],
                     preview: bool = False, companion: StageOutput | None = None) -> StageOutput:
        """`companion`: the audio decoder's output of the same request; with `preview`, a
        decoded video is previewed as an MP4 with that audio (fetched from the object store)."""
        wanted = [spec for spec in self.outputs if spec.name in names]
        if len(wanted) != len(names):
            raise UndeclaredArtifactError(f"decoder for {self.latent_name!r} cannot produce "
                                          "these artifacts", field="names",
                                          expected=[s.name for s in self.outputs],
                                          actual=list(names), request_id=latents.request_id)
        handle = latents.artifacts.get(self.latent_name)
        if handle is None:
            raise MissingArtifactError("the rollout did not return the latent to decode",
                                       field=f"artifacts.{self.latent_name}",
                                       actual=sorted(latents.artifacts),
                                       request_id=latents.request_id)
        if latents.sampling is None:
            raise MissingArtifactError("the rollout stage's output carries no sampling spec",
                                       field="sampling", request_id=latents.request_id)
        call = _DecodeCall(await handle.ref, tuple(wanted), latents.request_id,
                           latents.sampling)
        try:
            if self._in_replica:
                result = await self._decode_batch(call)
            else:
                [result] = await self._decode_calls([call])
        finally:
            call.latent = None
        if isinstance(result, BaseException):
            raise result
        produced, decode_s = result
        handles = {a.name: self.objects.put_artifact(a, latents.request_id) for a in produced}
        await self.objects.settled(latents.request_id)
        previews = {}
        if preview:
            audio = await self._companion_audio(companion)
            previews = await asyncio.to_thread(self._previews, produced, audio)
        return StageOutput(request_id=latents.request_id, artifacts=handles,
                           policy_version=latents.policy_version, seeds=latents.seeds,
                           stop_reason=latents.stop_reason, previews=previews,
                           sampling=latents.sampling,
                           metrics={f"decode_{self.latent_name}_s": decode_s})

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)   # set from the config
    async def _decode_batch(self, calls: list[_DecodeCall]
                            ) -> list[tuple[list[MediaArtifact], float] | Exception]:
        return await self._decode_calls(calls)

    async def _decode_calls(self, calls: Sequence[_DecodeCall]
                            ) -> list[tuple[list[MediaArtifact], float] | Exception]:
        """Concurrent requests' latents of one key in one decode (in a thread); per request,
        its artifacts and the seconds of the decode that made them. A decode that raises is
        redone request by request, each failing request getting its own error."""
        async def run(group: list[_DecodeCall]) -> list[tuple[list[MediaArtifact], float]]:
            first = group[0]
            rows = [c.latent.batch_size for c in group]
            if len(group) == 1:
                latent, sampling = first.latent, first.sampling
            else:
                latent = MediaArtifact(first.latent.spec,
                                       torch.cat([c.latent.data for c in group]),
                                       first.latent.metadata)
                sampling = first.sampling.model_copy(
                    update={"seeds": tuple(s for c in group for s in c.sampling.seeds)})
            self.forwards += 1
            self.forward_rows += sum(rows)
            with self.metrics.track(sum(rows)):
                t0 = time.perf_counter()
                produced = await asyncio.to_thread(self._decode, latent, list(first.wanted),
                                                   first.request_id, sampling)
                seconds = time.perf_counter() - t0
            if len(group) == 1:
                return [(produced, seconds)]
            out, start = [], 0
            for n in rows:
                out.append(([MediaArtifact(a.spec, a.data[start:start + n].clone(), a.metadata)
                             for a in produced], seconds))
                start += n
            return out
        return await run_isolated(list(calls), _DecodeCall.key, run)

    async def batch_stats(self) -> dict[str, int]:
        """Decodes run (a joint one that raised and its redos included) and their latent rows."""
        return {"forwards": self.forwards, "forward_rows": self.forward_rows}

    def _previews(self, produced: Sequence[MediaArtifact],
                  audio: MediaArtifact | None) -> dict[str, tuple[str, ...]]:
        return {a.name: av_preview_urls(a, audio, self.max_preview_pixels)
                if audio is not None and a.spec.modality == Modality.VIDEO else
                preview_urls(a, self.max_preview_pixels) for a in produced}

    @staticmethod
    async def _companion_audio(companion: StageOutput | None) -> MediaArtifact | None:
        if companion is None:
            return None
        handle = next((h for h in companion.artifacts.values()
                       if h.spec.modality == Modality.AUDIO
                       and h.spec.representation == Representation.DECODED), None)
        if handle is None:
            raise MissingArtifactError("the companion output carries no decoded audio",
                                       field="companion.artifacts",
                                       actual=sorted(companion.artifacts),
                                       request_id=companion.request_id)
        return await handle.ref

    def _decode(self, latent: MediaArtifact, wanted, request_id: str,
                sampling) -> list[MediaArtifact]:
        out = []
        if sampling is None:
            raise MissingArtifactError("the rollout stage's output carries no sampling spec",
                                       field="sampling", request_id=request_id)
        with torch.inference_mode(), finite_module_outputs(self.modules, request_id):
            data = self.family.codec.decode(self.latent_name, self.modules, latent.data,
                                            sampling)      # once, whatever artifacts share it
            for spec in wanted:
                metadata = {k: v for k, v in (("fps", spec.fps),
                                              ("sample_rate", spec.sample_rate)) if v}
                artifact = MediaArtifact(spec, data.contiguous(), metadata)
                if data.is_floating_point():             # decoded audio: the server's fault
                    check_finite(data, f"artifacts.{spec.name}", request_id)
                validate_artifact(artifact, request_id)
                out.append(artifact)
        return out
