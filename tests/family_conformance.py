"""The conformance checks every diffusers-checkpoint family passes, against diffusers itself.

A family's test module subclasses `FamilyConformance`, names the family, its tiny checkpoint
and pipeline, and how a pipeline call is spelled; the mixin then checks, on the real embedded
engine (the production path):
  - the sigma table equals the pipeline scheduler's at several sizes,
  - ODE latents equal the pipeline's `output_type="latent"` from the same initial latents
    (fp32, <= 1e-4), guided as the family guides, the decoded media within 1 level and a joint
    audio-video family's decoded audio within 1e-4,
  - token ids are the tokenizers' own and reach the encoders unchanged,
  - each stage loads only its components (parameter bytes per stage),
  - bad input (sizes the VAE / patch cannot produce, a path that is not a checkpoint, a missing
    subfolder, another pipeline's checkpoint, a dtype the device cannot run) raises typed
    errors naming the field,
  - the declared guidance rule is the pipeline's: at a scale below 1, at 1 and above, the
    pipeline's own `do_classifier_free_guidance` is the rule's decision, the latents are the
    pipeline's and the trajectory records the scale the rows ran at,
  - the declared pipeline classes (the family's entry in adapters/families.py) hold every
    diffusers pipeline class that takes this checkpoint's components, and the components saved
    by each load through `adapter: auto` and the explicit adapter, serving the same tasks.

`FamilyChecks` (its base; embedded families without a diffusers pipeline use it alone) adds, for
every registered family:
  - every declared LoRA target (FamilySpec.lora_targets) matches > 0 linear modules of its
    transformer, and the learner's LoRA covers exactly the modules they match,
  - the project's LoRA file (adapters/lora_files.py) loaded by diffusers' own loader (the
    transformer's `load_lora_adapter`) gives the project's adapted forward (a family diffusers
    cannot hold in one LoRA file is refused, naming the field),
  - engine-vs-learner SDE log-prob parity: the log-probs the embedded engine records for an SDE
    rollout under a LoRA equal the trainer's recomputation (trainer/checks.py logprob_mismatch)
    for the same trajectory and policy, |ratio - 1| <= 1e-5, and other weights fail it.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from torch import nn

from adapters.checkpoint import load_component
from adapters.families import ENTRIES
from adapters.inference_form import modules_with_suffix
from adapters.lora_files import load_diffusers_lora, save_diffusers_lora
from adapters.registry import get_family
from contract import (Condition, ConfigError, InvalidRequestError, RequestLimits, RewardReport,
                      RolloutOutput, RolloutRequest, SamplerKind, SamplingSpec, StartupCheckError,
                      Task)
from diffusion.noise import initial_noise
from diffusion.step import applied_guidance_scale, doubles_rows, predict_velocity
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest
from trainer.lora import PolicyRole

PROMPTS = ("a red circle on a wooden table", "two blue squares under a green sky")
NEGATIVE = "blurry, low quality"
GUIDANCE_PROBES = (0.5, 1.0, "family")   # below 1, 1, and the family's own scale (> 1)


@functools.lru_cache(maxsize=1)
def diffusers_pipeline_classes() -> dict[str, tuple[set, set, dict]]:
    """Every pipeline class diffusers exports: name -> (its __init__ parameters, the required
    ones (no default, not an optional component), their annotations)."""
    import diffusers
    out = {}
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            cls = getattr(diffusers, name)
        except Exception:            # noqa: BLE001 - a class whose optional backend is missing
            continue
        if not (inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline)) or \
                cls is diffusers.DiffusionPipeline:
            continue
        params = dict(inspect.signature(cls.__init__).parameters)
        params.pop("self", None)
        try:
            hints = typing.get_type_hints(cls.__init__)
        except Exception:            # noqa: BLE001 - an annotation naming a missing backend
            hints = {k: p.annotation for k, p in params.items()}
        optional = set(getattr(cls, "_optional_components", ()))
        required = {k for k, p in params.items()
                    if p.default is inspect.Parameter.empty and k not in optional}
        out[name] = (set(params), required, hints)
    return out


def _takes(annotation, component) -> bool:
    """Whether an __init__ annotation admits this component (an Auto* tokenizer / processor
    class admits any; no annotation admits anything)."""
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):
        return any(c.__name__ in annotation for c in type(component).__mro__)
    args = typing.get_args(annotation)
    if args:
        return any(_takes(a, component) for a in args if a is not type(None))
    if inspect.isclass(annotation) and \
            annotation.__module__.startswith("transformers.models.auto"):
        return True
    return inspect.isclass(annotation) and isinstance(component, annotation)


def pipeline_classes_over(components: dict, config: dict) -> list[str]:
    """The diffusers pipeline classes that take exactly these components and config entries:
    every component one of its parameters, of a class the parameter admits, and every
    required parameter given."""
    present = {k: v for k, v in components.items() if v is not None}
    return sorted(name for name, (params, required, hints) in
                  diffusers_pipeline_classes().items()
                  if set(present) | set(config) <= params
                  and required <= set(present) | set(config)
                  and all(_takes(hints.get(k, inspect.Parameter.empty), v)
                          for k, v in present.items()))


def param_bytes(modules) -> int:
    seen = {}
    for module in modules:
        for p in module.parameters():
            seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def check_time_convention_flip(family: str, root, options: dict, size: dict,
                               monkeypatch) -> None:
    """Random tiny weights: the time-convention check compares steps with the checkpoint's own
    scheduler, so it passes for the family's declared convention and fails, naming
    adapter.time_convention, once the declaration is flipped."""
    from contract import StartupCheckError, TimeConvention
    from trainer import checks
    from trainer.config import OptimizerConfig
    from trainer.learner import Learner
    from trainer.lora import LoRATrainConfig
    fam = get_family(family, root, options)
    learner = Learner(fam, fam.load_transformers(), fam.load_encoders(),
                      LoRATrainConfig(rank=2, alpha=2), OptimizerConfig())
    prompts = fam.conditioner.tokenize(list(PROMPTS))
    sampling = SamplingSpec(num_steps=3, seeds=(0,), **size)
    report = checks.check_time_convention_scheduler(learner, prompts, sampling)
    assert report["scheduler_step_max_diff"] <= 1e-5
    monkeypatch.setattr(fam.denoiser, "time_convention", TimeConvention.DATA_PROGRESS)
    with pytest.raises(StartupCheckError) as err:
        checks.check_time_convention_scheduler(learner, prompts, sampling)
    assert err.value.field == "adapter.time_convention"


LORA_RANK = 2
LOGPROB_PARITY_TOL = 1e-5          # |exp(learner - engine) - 1|: fp32 noise


class FamilyChecks:
    """The checks every registered family passes, with or without a diffusers pipeline."""

    family: str                       # registry name
    options: dict[str, Any] = {}
    size: dict[str, int] = {}         # height / width (/ num_frames) of the sized call
    guidance_scale: float = 1.0
    negative: bool = False            # the family takes a negative prompt
    steps: int = 4

    task: Task | None = None          # the task checked; None = the family's first

    def request_media(self) -> tuple | None:
        """Condition media (contract.MediaInput) of the parity request; the family's first task
        (or `task`) is requested with them (None: a text-only task)."""
        return None

    def task_of(self, fam) -> Task:
        return self.task or next(iter(fam.spec.tasks))

    def encode(self, fam, encoders, bundles) -> Condition:
        """The bundles' conditions as the encoder stage makes them: with the request's media of
        the roles the conditioner reads itself (Conditioner.media_roles), else from the ids."""
        roles = fam.conditioner.media_roles
        item = {m.role: m.data for m in (self.request_media() or ()) if m.role in roles}
        if item:
            return fam.conditioner.encode_with_media(encoders, bundles, [item] * len(bundles))
        return fam.conditioner.encode(encoders, bundles)

    # ---- fixtures -----------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def root(self) -> Path | None:
        return None                   # an embedded family's shipped weights

    @pytest.fixture(scope="class")
    def fam(self, root):
        return get_family(self.family, root, self.options)

    @pytest.fixture(scope="class")
    def learner(self, fam):
        from trainer.config import OptimizerConfig
        from trainer.learner import Learner
        from trainer.lora import LoRATrainConfig
        torch.set_num_threads(1)
        return Learner(fam, fam.load_transformers(), fam.load_encoders(),
                       LoRATrainConfig(rank=LORA_RANK, alpha=LORA_RANK), OptimizerConfig(),
                       media_modules=fam.load_media_encoders())

    @pytest.fixture(scope="class")
    def probe(self, learner) -> tuple[dict[str, torch.Tensor], float]:
        """A LoRA with random A and B on every target (it changes outputs), as exported."""
        from trainer import checks
        return checks.probe_lora(learner, seed=7, std_b=0.1)

    def sized(self, fam) -> dict[str, int]:
        if self.size:
            return dict(self.size)
        return {k: fam.spec.sampling_defaults[k] for k in ("height", "width", "num_frames")}

    def probe_request(self, fam, sampling: SamplingSpec) -> RolloutRequest:
        negatives = [NEGATIVE] if self.negative else None
        bundle = fam.conditioner.tokenize([PROMPTS[0]], negatives)[0]
        return RolloutRequest(prompt=bundle, sampling=sampling, task=self.task_of(fam),
                              media=self.request_media())

    # ---- checks -------------------------------------------------------------------------------
    def test_every_declared_lora_target_exists(self, fam, learner):
        """Each declared target suffix matches > 0 linear modules of its transformer, and the
        learner's LoRA covers exactly the modules the targets match."""
        several = len(fam.spec.transformers) > 1
        matched = set()
        for component in fam.spec.transformers:
            model = fam.load(component)
            targets = fam.spec.lora_targets[component]
            assert targets, component
            for suffix in targets:
                found = list(modules_with_suffix(model, suffix))
                assert found, f"{component}: LoRA target {suffix!r} matches no module"
                assert all(isinstance(m, nn.Linear) for _, m in found), (component, suffix)
                matched |= {f"{component}.{name}" if several else name for name, _ in found}
        exported, _ = learner.export()
        assert {k.rsplit(".lora_", 1)[0] for k in exported} == matched

    def test_lora_file_round_trip_through_diffusers_loader(self, fam, learner, probe, tmp_path):
        """The project's LoRA file, read by the transformer's own diffusers loader
        (`load_lora_adapter`, rank and alpha from the file's metadata), gives the learner's
        adapted forward; the project reads its own file back unchanged."""
        tensors, scale = probe
        entry = ENTRIES[self.family]
        if len(fam.spec.transformers) != 1 or not entry.pipeline_classes:
            with pytest.raises(ConfigError) as err:     # no one-file diffusers form: refused
                save_diffusers_lora(fam, tensors, scale, LORA_RANK, tmp_path)
            assert err.value.field == "adapter"
            return
        path = save_diffusers_lora(fam, tensors, scale, LORA_RANK, tmp_path)
        again, again_scale = load_diffusers_lora(fam, path)
        assert again_scale == pytest.approx(scale) and again.keys() == tensors.keys()
        assert all(torch.equal(again[k], tensors[k]) for k in tensors)
        component = fam.spec.transformers[0]
        theirs_model = fam.load(component)
        theirs_model.load_lora_adapter(str(tmp_path), weight_name=path.name,
                                       prefix="transformer", adapter_name="probe")
        sampling = SamplingSpec(num_steps=self.steps, seeds=(0, 1), **self.sized(fam))
        media = fam.validate_request(self.probe_request(fam, sampling), RequestLimits())
        x = initial_noise(sampling.seeds, fam.codec.state_shape(sampling))
        rows = x.shape[0]
        sigma = torch.full((rows,), 0.6)
        # with the request's media: a conditioner that reads them (Qwen-Image-Edit's) needs them
        cond = learner.encode([self.probe_request(fam, sampling).prompt],
                              [media]).repeat_rows([rows])
        inputs = learner.forward_inputs([sampling], [media], [rows])
        guidance = learner.guidance(rows, 1.0, None)
        with torch.no_grad():
            theirs = predict_velocity(fam.denoiser, {component: theirs_model.eval()}, x, sigma,
                                      cond, guidance, inputs or None)
            base = predict_velocity(fam.denoiser, {component: fam.load(component).eval()}, x,
                                    sigma, cond, guidance, inputs or None)
            with learner.as_old(tensors):
                ours = learner.velocity(x, sigma, cond, PolicyRole.OLD, 1.0, None,
                                        inputs or None)
        diff, effect = float((ours - theirs).abs().max()), float((theirs - base).abs().max())
        print(f"{self.family} LoRA through diffusers: max |ours - diffusers| = {diff:.3g}, "
              f"effect {effect:.3g}")
        assert effect > 1e-3 and diff <= 1e-4 * max(1.0, float(theirs.abs().max()))

    @pytest.fixture(scope="class")
    def engine(self, fam):
        engine = EmbeddedEngine(fam, fam.load_transformers(), fam.load_media_encoders())
        yield engine
        asyncio.run(engine.shutdown())

    def test_engine_and_learner_sde_log_probs_agree(self, fam, learner, probe):
        """An SDE rollout on the embedded engine under the probe LoRA records log-probs the
        trainer's recomputation (same trajectory, same policy, trainer/checks.py) equals
        within fp32 noise; other weights fail the same check."""
        from trainer import checks
        from trainer.rollout_batch import build_batch
        tensors, scale = probe
        sampling = SamplingSpec(sampler=SamplerKind.SDE, noise_level=0.7, num_steps=self.steps,
                                seeds=(0, 1), guidance_scale=self.guidance_scale,
                                **self.sized(fam))
        request = self.probe_request(fam, sampling)
        media = fam.validate_request(request, RequestLimits())
        conditioner = fam.conditioner
        cond = self.encode(fam, learner.encoders, [request.prompt])
        negative = self.encode(fam, learner.encoders,
                               [conditioner.unconditional(request.prompt)]) \
            if doubles_rows(fam.spec.guidance, sampling.guidance_scale) else None
        engine = EmbeddedEngine(fam, fam.load_transformers(), fam.load_media_encoders())
        try:
            engine.load_lora("probe", tensors, scale)
            latents = fam.io_spec.latent_needed(fam.io_spec.defaults)
            result = engine.submit(EngineRequest(request, cond, negative, latents, media,
                                                 "probe")).result(timeout=300)
        finally:
            asyncio.run(engine.shutdown())
        out = RolloutOutput(request.request_id, dict(result.latents), result.trajectory,
                            result.policy_version, sampling.seeds,
                            rewards=RewardReport({}, (0.0,) * len(sampling.seeds), {}))
        batch = build_batch(learner, [request.prompt], [out], [sampling], [media])
        assert batch.versions == ("probe",) * len(sampling.seeds)
        report = checks.logprob_mismatch(learner, batch.trajectory, batch.cond,
                                         {"probe": tensors}.__getitem__, batch.versions,
                                         LOGPROB_PARITY_TOL, batch.uncond, batch.inputs)
        print(f"{self.family} SDE log-prob parity: {report}")
        assert report["logprob_ratio_err_max"] <= LOGPROB_PARITY_TOL
        wrong = {k: v * 1.5 for k, v in tensors.items()}
        with pytest.raises(StartupCheckError) as err:
            checks.logprob_mismatch(learner, batch.trajectory, batch.cond, lambda v: wrong,
                                    batch.versions, LOGPROB_PARITY_TOL, batch.uncond,
                                    batch.inputs)
        assert err.value.field == "log_prob"


class FamilyConformance(FamilyChecks):
    checkpoint: str                   # tiny checkpoint family (testing/tiny_checkpoints.py)
    other_sizes: tuple[dict[str, int], ...] = ()
    bad_size: dict[str, int] = {}     # a size the VAE / patch cannot produce
    sigma_steps: tuple[int, ...] = (1, 4, 10)   # step counts the sigma tables are compared at

    # ---- per family -------------------------------------------------------------------------
    def pipeline(self, root: Path):
        raise NotImplementedError

    def pipeline_call(self, pipe, x0: torch.Tensor, output_type: str) -> Any:
        raise NotImplementedError

    def decoded_from_pipeline(self, result) -> torch.Tensor:
        """uint8 decoded media from the pipeline's `output_type="np"` result."""
        images = torch.from_numpy((result.images * 255).round().astype("uint8"))
        return images.permute(0, 3, 1, 2)

    def audio_all(self, fam, latents, sampling) -> torch.Tensor | None:
        """Decoded float audio of a joint audio-video family (None: the family has none)."""
        return None

    def audio_from_pipeline(self, result) -> torch.Tensor | None:
        return None

    # ---- fixtures -----------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def root(self, tiny_checkpoint) -> Path:
        return tiny_checkpoint(self.checkpoint)

    @pytest.fixture(scope="class")
    def fam(self, root):
        return get_family("auto", root, self.options)

    @pytest.fixture(scope="class")
    def encoders(self, fam):
        return fam.load_encoders()

    def sampling(self, seeds=(0, 1), **size) -> SamplingSpec:
        return SamplingSpec(sampler=SamplerKind.ODE, noise_level=0.0, num_steps=self.steps,
                            seeds=tuple(seeds), guidance_scale=self.guidance_scale,
                            **(size or self.size))

    def engine_latents(self, fam, engine, encoders, prompt: str, sampling: SamplingSpec):
        conditioner = fam.conditioner
        negatives = [NEGATIVE] if self.negative else None
        bundle = conditioner.tokenize([prompt], negatives)[0]
        request = RolloutRequest(prompt=bundle, sampling=sampling,
                                 task=self.task_of(fam), media=self.request_media())
        media = fam.validate_request(request, RequestLimits())
        cond = self.encode(fam, encoders, [bundle])
        negative = None
        if doubles_rows(fam.spec.guidance, sampling.guidance_scale):
            negative = self.encode(fam, encoders, [conditioner.unconditional(bundle)])
        latents = fam.io_spec.latent_needed(fam.io_spec.defaults)
        result = engine.submit(EngineRequest(request, cond, negative, latents, media,
                                             "base")).result(timeout=300)
        return {name: a.data for name, a in result.latents.items()}

    # ---- checks -------------------------------------------------------------------------------
    def test_sigmas_equal_the_pipeline_scheduler(self, fam, root):
        pipe_scheduler = load_component(root, "scheduler")
        for size in (self.size, *self.other_sizes):
            for steps in self.sigma_steps:
                sampling = SamplingSpec(num_steps=steps, seeds=(0,), **size)
                ours = fam.sigmas(sampling)
                theirs = self.pipeline_sigmas(fam, pipe_scheduler, sampling)
                assert torch.equal(ours, theirs), (size, steps, ours, theirs)

    def pipeline_sigmas(self, fam, scheduler, sampling) -> torch.Tensor:
        scheduler.set_timesteps(sampling.num_steps)
        return scheduler.sigmas.float()

    def test_ode_latents_and_media_equal_the_pipeline(self, fam, root, engine, encoders):
        pipe = self.pipeline(root)
        sampling = self.sampling()
        ours = self.engine_latents(fam, engine, encoders, PROMPTS[0], sampling)
        x0 = initial_noise(sampling.seeds, fam.codec.state_shape(sampling))
        theirs = self.pipeline_call(pipe, x0.clone(), "latent")
        for name, value in self.latents_of(theirs).items():
            diff = float((ours[name] - value).abs().max())
            print(f"{self.checkpoint} {name}: max |ours - pipeline| = {diff:.3g}")
            assert diff <= 1e-4 and float(value.abs().mean()) > 0.1, (name, diff)
        decoded = self.decode_all(fam, ours, sampling)
        media_result = self.pipeline_call(pipe, x0.clone(), "np")
        reference = self.decoded_from_pipeline(media_result)
        assert decoded.dtype == torch.uint8 and decoded.shape == reference.shape
        levels = int((decoded.int() - reference.int()).abs().max())
        print(f"{self.checkpoint} decoded: max |ours - pipeline| = {levels} levels")
        assert levels <= 1
        audio = self.audio_all(fam, ours, sampling)
        if audio is not None:
            reference = self.audio_from_pipeline(media_result)
            assert audio.is_floating_point() and audio.shape == reference.shape
            diff = float((audio - reference).abs().max())
            print(f"{self.checkpoint} decoded audio: max |ours - pipeline| = {diff:.3g}")
            assert diff <= 1e-4 and float(reference.abs().mean()) > 1e-3

    def latents_of(self, result) -> dict[str, torch.Tensor]:
        return {"image_latent": result.images}

    def decode_all(self, fam, latents, sampling) -> torch.Tensor:
        return fam.codec.decode("image_latent", fam.load_decoder("image_latent"),
                                latents["image_latent"], sampling)

    def test_token_ids_are_the_tokenizers_and_reach_the_encoders(self, fam, encoders):
        conditioner = fam.conditioner
        bundle = conditioner.tokenize([PROMPTS[1]])[0]
        ids = bundle.ids_by_encoder(fam.spec.encoder_names)
        seen = {}

        def record(name):
            def hook(module, args, kwargs):
                seen.setdefault(name, (args[0] if args else kwargs["input_ids"]).clone())
            return hook
        hooks = [module.register_forward_pre_hook(record(name), with_kwargs=True)
                 for name, module in encoders.items()]
        try:
            cond = conditioner.encode(encoders, [bundle])
        finally:
            for h in hooks:
                h.remove()
        left = getattr(conditioner, "padding_side", "right") == "left"
        for spec in fam.spec.encoders:
            tok = conditioner.tokenizer(spec)
            assert list(ids[spec.name]) == tok(PROMPTS[1])["input_ids"]
            row, n = seen[spec.name][0].tolist(), len(ids[spec.name])
            if left:                                   # pads first, then the ids
                row = row[::-1][:n][::-1] + row[:len(row) - n]
            assert row[:n] == list(ids[spec.name])
            assert set(row[n:]) <= {tok.pad_token_id}
            assert len(row) == spec.max_length
        assert all(t.shape[0] == 1 for t in cond.tensors.values())

    def test_each_stage_loads_only_its_components(self, fam, root):
        """Parameter bytes each stage's server really holds: the encoder stage its text
        encoders only, each decoder its VAE (vocoder) only, the rollout stage one copy of the
        transformer(s) (+ the media encoder of a conditioned family) and no text encoder."""
        from deployments.decoder import DecoderServer
        from deployments.encoder import TextEncoderServer
        from rollout.config import RolloutConfig
        from rollout.strategy import build_strategy
        sizes = {c: param_bytes([fam.load(c)]) for c in
                 {*fam.spec.transformers, *(e.component for e in fam.spec.encoders),
                  *(c for e in fam.spec.encoders for c in e.extra_components),
                  *(c for cs in fam.spec.decoders.values() for c in cs), *fam.spec.media_encoders}}
        encoder = TextEncoderServer(self.family, str(root), 1, "cpu", "float32", self.options)
        assert param_bytes(encoder.encoders.values()) == \
            sum(sizes[c] for e in fam.spec.encoders for c in (e.component, *e.extra_components))
        for latent, components in fam.spec.decoders.items():
            decoder = DecoderServer(self.family, str(root), latent, 4096, options=self.options)
            assert set(decoder.modules) == set(components)
            assert param_bytes(decoder.modules.values()) == sum(sizes[c] for c in components)
        strategy = build_strategy(RolloutConfig(adapter=self.family, weights_path=str(root),
                                                adapter_options=self.options), RequestLimits())
        try:
            engine = strategy.engine
            held = param_bytes([*engine.models.values(), *engine.media_modules.values()])
            assert held == sum(sizes[c] for c in (*fam.spec.transformers,
                                                  *fam.spec.media_encoders))
            assert not {e.component for e in fam.spec.encoders} & set(fam.spec.media_encoders)
        finally:
            asyncio.run(strategy.engine.shutdown())

    def test_bad_sizes_paths_and_dtypes_are_typed_errors(self, fam, root, tmp_path):
        with pytest.raises(InvalidRequestError) as err:
            fam.codec.state_shape(SamplingSpec(seeds=(0,), **self.bad_size))
        assert err.value.field.startswith("sampling.")
        with pytest.raises(ConfigError) as err:
            get_family(self.family, tmp_path / "nothing_here")
        assert err.value.field == "weights_path"
        broken = tmp_path / "broken"
        shutil.copytree(root, broken)
        shutil.rmtree(broken / "vae")
        with pytest.raises(ConfigError) as err:
            get_family(self.family, broken).load_decoder(next(iter(fam.spec.decoders)))
        assert "vae" in str(err.value)
        index = json.loads((root / "model_index.json").read_text())
        other = tmp_path / "other"
        shutil.copytree(root, other)
        (other / "model_index.json").write_text(json.dumps(index | {"_class_name": "NoPipe"}))
        with pytest.raises(ConfigError) as err:
            get_family("auto", other)
        assert err.value.field == "weights_path" and err.value.actual == "NoPipe"
        with pytest.raises(ConfigError) as err:
            fam.load(fam.spec.transformers[0], "float16", "cpu")
        assert err.value.field == "dtype"
        with pytest.raises(ConfigError) as err:
            get_family(self.family, root, {"no_such_option": 1})
        assert err.value.field == "rollout.adapter_options.no_such_option"

    # ---- the guidance rule and the pipeline classes the family declares ----------------------
    @pytest.fixture(scope="class")
    def pipe(self, root):
        return self.pipeline(root)

    @pytest.mark.parametrize("scale", GUIDANCE_PROBES)
    def test_guidance_rule_is_the_pipelines(self, fam, root, engine, encoders, pipe, scale):
        """At a scale below 1, at 1 and above: the pipeline's own CFG decision is the rule's,
        the latents are the pipeline's from the same initial latents, and the trajectory
        records the scale the rows ran at."""
        from rollout.config import RolloutConfig
        from rollout.strategy import DiffusionStrategy
        rule = fam.spec.guidance
        assert rule.source, "a family names where its guidance rule comes from"
        scale = self.guidance_scale if scale == "family" else scale
        assert scale > 1 or scale in (0.5, 1.0)
        case = copy.copy(self)
        case.guidance_scale = scale
        sampling = case.sampling(seeds=(0,))
        negatives = [NEGATIVE] if self.negative else None
        bundle = fam.conditioner.tokenize([PROMPTS[0]], negatives)[0]
        request = RolloutRequest(prompt=bundle, sampling=sampling,
                                 task=self.task_of(fam), media=self.request_media())
        guided = doubles_rows(rule, scale)
        negative = self.encode(fam, encoders, [fam.conditioner.unconditional(bundle)]) \
            if guided else None
        strategy = DiffusionStrategy(RolloutConfig(adapter=self.family, weights_path=str(root),
                                                   adapter_options=self.options),
                                     fam, engine, RequestLimits())
        out = asyncio.run(strategy.generate(request, self.encode(fam, encoders, [bundle]),
                                            negative))
        assert out.trajectory.guidance_scale == applied_guidance_scale(rule, scale)
        x0 = initial_noise(sampling.seeds, fam.codec.state_shape(sampling))
        theirs = case.pipeline_call(pipe, x0.clone(), "latent")
        pipeline_guided = getattr(pipe, "do_classifier_free_guidance", None)
        if pipeline_guided is not None:            # (FLUX embeds the scale: no such decision)
            assert bool(pipeline_guided) is guided, (scale, rule)
        for name, value in self.latents_of(theirs).items():
            diff = float((out.artifacts[name].data - value).abs().max())
            print(f"{self.checkpoint} guidance {scale} {name}: max |ours - pipeline| = "
                  f"{diff:.3g} (CFG {guided})")
            assert diff <= 1e-4 and float(value.abs().mean()) > 0.1, (name, diff)

    def test_every_pipeline_class_over_the_components_loads(self, fam, root, pipe, tmp_path):
        """The components saved by each diffusers pipeline class that takes them (save_pretrained)
        load through `adapter: auto` and the explicit adapter, serving the same tasks with the
        same guidance; every such class is declared."""
        import diffusers
        components = dict(pipe.components)
        config = {k: v for k, v in pipe.config.items()
                  if not k.startswith("_") and k not in components and v not in (None, False)}
        classes = pipeline_classes_over(components, config)
        assert type(pipe).__name__ in classes
        declared = set(ENTRIES[self.family].pipeline_classes)
        assert set(classes) <= declared, sorted(set(classes) - declared)
        first = fam.spec.transformers[0]
        weights = fam.load(first).state_dict()
        for name in classes:
            cls = getattr(diffusers, name)
            params = diffusers_pipeline_classes()[name][0]
            folder = tmp_path / name
            cls(**{k: v for k, v in components.items() if k in params}, **config) \
                .save_pretrained(folder, safe_serialization=True)
            assert json.loads((folder / "model_index.json").read_text())["_class_name"] == name
            for adapter in ("auto", self.family):
                other = get_family(adapter, folder, self.options)
                assert other.name == fam.name and other.pipeline_class == name
                assert dict(other.spec.tasks) == dict(fam.spec.tasks), name
                assert other.spec.guidance == fam.spec.guidance
                assert other.spec.transformers == fam.spec.transformers
            loaded = other.load(first).state_dict()          # the weights load from the folder
            assert loaded.keys() == weights.keys()
            assert all(torch.equal(loaded[k], weights[k]) for k in weights), name
        foreign = next(c for f, e in ENTRIES.items() if f != self.family
                       for c in e.pipeline_classes)
        other = tmp_path / "foreign"
        shutil.copytree(root, other)
        index = json.loads((root / "model_index.json").read_text())
        (other / "model_index.json").write_text(json.dumps(index | {"_class_name": foreign}))
        with pytest.raises(ConfigError) as err:       # another family's class: refused, named
            get_family(self.family, other, self.options)
        assert (err.value.field, err.value.actual) == ("weights_path", foreign)
