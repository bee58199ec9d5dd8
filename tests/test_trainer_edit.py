"""Training on the edit task (a source image + an instruction -> an image) from edit prompt files:
the records' source images (trainer/datasets.py check_task_media), and the start-up checks on
prompt + source (trainer/checks.py: the scheduler time-convention check and the LoRA map
check's local side with the source shown to the conditioner and its latents appended), in
process on the tiny FLUX.1 Kontext (default tier) and Qwen-Image-Edit (integration tier: its
~1 MP source makes it slow on a CPU) checkpoints against the embedded rollout engine. The same path through the deployed graph and Ray DeploymentHandles
(DiffusionNFT and FlowGRPO steps, clip_directional rewards, the checks failing on purpose) is
tests/test_trainer_edit_graph.py (integration tier)."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from contract import (ConfigError, DatasetError, InvalidRequestError, MediaRole, RequestLimits,
                      SamplerKind, StartupCheckError, Task, TimeConvention, normalize_media)
from trainer.datasets import check_task_media, load_prompt_file

torch.set_num_threads(1)
EDIT_PROMPTS = "configs/prompts/edit"
TINY_RECIPE = "configs/train_qwen_image_edit_tiny.yaml"
KONTEXT_PROMPTS = "configs/prompts/edit_kontext"       # the same edits at 64 x 64, no negative
KONTEXT_RECIPE = "configs/train_flux_kontext_tiny.yaml"
SIZE = {"height": 32, "width": 48}
# family, tiny checkpoint, options, source side, negative prompt, guidance scale
CASES = {"qwen_image_edit": ("qwen_image", "qwen_image_edit", {"max_sequence_length": 48},
                             1024, " ", 4.0),
         "flux_kontext": ("flux", "flux_kontext", {"max_sequence_length": 48}, 64, None, 3.5)}


def edit_root(case: str, tiny_checkpoint, tmp_path_factory):
    """The case's tiny checkpoint folder (qwen_image_edit, flux_kontext: each saved by its
    edit pipeline class, model_index.json names it)."""
    root = tiny_checkpoint(CASES[case][1])
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] in ("QwenImageEditPipeline", "FluxKontextPipeline")
    return root


def test_edit_prompt_files_carry_their_source_and_a_missing_one_is_named(tmp_path):
    """The shipped edit prompts (configs/prompts/edit) carry a 1024 x 1024 source per record,
    the recoloured caption as prompt and the source's caption; a record without its source, or
    with media the edit does not take, is a DatasetError naming file:line and the key, and an
    edit run without prompt files is a ConfigError naming `data`."""
    from testing.edit_prompts import write_edit_prompts
    from trainer.config import load_trainer_config
    from trainer.run_state import PromptFeed
    records = load_prompt_file(f"{EDIT_PROMPTS}/train.jsonl")
    check_task_media(records, (MediaRole.IMAGE,), "edit")
    for record in records:
        [source] = record.media_inputs()
        assert source.role is MediaRole.IMAGE and source.data.shape == (3, 1024, 1024)
        source_caption, prompt = record.metadata["source_caption"], record.text
        assert source_caption != prompt and source_caption.split()[2:] == prompt.split()[2:]
    # the shipped files are what the writer writes
    train, _ = write_edit_prompts(tmp_path / "again", size=1024)
    assert train.read_text() == open(f"{EDIT_PROMPTS}/train.jsonl").read()
    for name in ("train_0.png", "test_1.png"):
        assert (tmp_path / "again" / "sources" / name).read_bytes() == \
            open(f"{EDIT_PROMPTS}/sources/{name}", "rb").read()

    lines = [json.loads(x) for x in open(f"{EDIT_PROMPTS}/train.jsonl").read().splitlines()]
    shutil.copytree(f"{EDIT_PROMPTS}/sources", tmp_path / "sources")
    bad = tmp_path / "bad.jsonl"
    no_source = {k: v for k, v in lines[1].items() if k != "image"}
    bad.write_text("\n".join(json.dumps(x) for x in (lines[0], no_source)) + "\n")
    with pytest.raises(DatasetError) as err:
        check_task_media(load_prompt_file(bad), (MediaRole.IMAGE,), "edit")
    assert err.value.field == f"{bad}:2 image" and "image" in err.value.message
    bad.write_text(json.dumps(lines[0] | {"first_frame": lines[0]["image"]}) + "\n")
    with pytest.raises(DatasetError) as err:
        check_task_media(load_prompt_file(bad), (MediaRole.IMAGE,), "edit")
    assert err.value.field == f"{bad}:1 first_frame"
    # a multi-image edit: the source, then a prefix of the further ones (image_2, image_3)
    extra = (MediaRole.IMAGE_2, MediaRole.IMAGE_3)
    two = lines[0] | {"image_2": lines[1]["image"]}
    bad.write_text(json.dumps(two) + "\n")
    check_task_media(load_prompt_file(bad), (MediaRole.IMAGE,), "edit", extra)
    with pytest.raises(DatasetError) as err:          # a single-image edit takes no second
        check_task_media(load_prompt_file(bad), (MediaRole.IMAGE,), "edit")
    assert err.value.field == f"{bad}:1 image_2"
    bad.write_text(json.dumps(lines[0] | {"image_3": lines[1]["image"]}) + "\n")
    with pytest.raises(DatasetError) as err:          # image_3 needs image_2 before it
        check_task_media(load_prompt_file(bad), (MediaRole.IMAGE,), "edit", extra)
    assert err.value.field == f"{bad}:1 image_2"
    [record] = load_prompt_file(bad)
    assert [m.role for m in record.media_inputs()] == [MediaRole.IMAGE, MediaRole.IMAGE_3]

    cfg = load_trainer_config(TINY_RECIPE)
    assert cfg.task is Task.EDIT and cfg.data is not None
    tokenize = lambda texts, negatives=None: [None for _ in texts]     # noqa: E731
    feed = PromptFeed(cfg, tokenize)
    feed.check_task_media(Task.EDIT, (MediaRole.IMAGE,))                 # the shipped files pass
    with pytest.raises(ConfigError) as err:
        PromptFeed(cfg.model_copy(update={"data": None}), tokenize).check_task_media(
            Task.EDIT, (MediaRole.IMAGE,))
    assert err.value.field == "data"


def test_the_kontext_tiny_recipe_is_the_qwen_edit_recipe_on_its_checkpoint(tiny_checkpoint,
                                                                           tmp_path):
    """configs/train_flux_kontext_tiny.yaml: configs/train_qwen_image_edit_tiny.yaml's recipe
    on the flux family (differing only in the graph, the prompt files, the guidance scale and
    bookkeeping), its prompt files (configs/prompts/edit_kontext) what the writer writes at 64 x
    64 without a negative prompt, each record's source at that size; the config check passes on
    the tiny flux_kontext checkpoint and names weights_path without one."""
    from testing.edit_prompts import write_edit_prompts
    from trainer.__main__ import check
    from trainer.config import load_trainer_config
    kontext, qwen = load_trainer_config(KONTEXT_RECIPE), load_trainer_config(TINY_RECIPE)
    assert kontext.task is Task.EDIT and kontext.graph_config().rollout.adapter == "flux"
    name, _, options, side, negative, guidance = CASES["flux_kontext"]   # the case tested here
    assert kontext.graph_config().rollout.adapter_options == options
    assert kontext.sampler.guidance_scale == guidance
    assert kontext.sampler.height == SIZE["height"] and kontext.sampler.width == SIZE["width"]
    differs = {k for k in kontext.model_dump()
               if kontext.model_dump()[k] != qwen.model_dump()[k]}
    assert differs == {"graph", "data", "sampler", "wandb", "run_dir"}, differs
    assert kontext.sampler.model_copy(update={"guidance_scale": 4.0}) == qwen.sampler

    train, test = write_edit_prompts(tmp_path, size=side, negative=negative)
    for path in (train, test):
        shipped = f"{KONTEXT_PROMPTS}/{path.name}"
        assert path.read_text() == open(shipped).read()
        records = load_prompt_file(shipped)
        check_task_media(records, (MediaRole.IMAGE,), "edit")
        for record in records:
            [source] = record.media_inputs()
            assert source.data.shape == (3, side, side) and record.negative is None
    for png in (tmp_path / "sources").iterdir():
        assert png.read_bytes() == open(f"{KONTEXT_PROMPTS}/sources/{png.name}", "rb").read()

    root = tiny_checkpoint("flux_kontext")
    assert check(load_trainer_config(KONTEXT_RECIPE,
                                     {"graph.rollout.weights_path": str(root)})) == "ok"
    with pytest.raises(ConfigError) as err:
        check(kontext)
    assert err.value.field == "weights_path"


# Qwen-Image-Edit's source is ~1024 x 1024 (4096 appended tokens per row): minutes on 2 CPU
# cores, so its case is in the integration tier; Kontext (a 64 x 64 source) runs by default.
@pytest.fixture(scope="module", params=[
    pytest.param("qwen_image_edit", marks=pytest.mark.integration), "flux_kontext"])
def edit_case(request, tiny_checkpoint, tmp_path_factory):
    """(case, family, learner with text and VAE encoders, embedded engine, prompt bundles,
    requests' media, canonical media) of two held-out edit prompts at the case's source size."""
    from adapters.registry import get_family
    from rollout.engine import EmbeddedEngine
    from testing.edit_prompts import write_edit_prompts
    from trainer.config import OptimizerConfig
    from trainer.learner import Learner
    from trainer.lora import LoRATrainConfig
    case = request.param
    name, _, options, side, negative, guidance = CASES[case]
    fam = get_family(name, edit_root(case, tiny_checkpoint, tmp_path_factory), options)
    _, test = write_edit_prompts(tmp_path_factory.mktemp("edits"), size=side, train=1, test=2,
                                 negative=negative)
    records = load_prompt_file(test)
    bundles = fam.conditioner.tokenize([r.text for r in records],
                                       [r.negative for r in records] if negative else None)
    inputs = [r.media_inputs() for r in records]
    media = [{role: item.data for role, item in normalize_media(m, Task.EDIT, "t").items()}
             for m in inputs]
    learner = Learner(fam, fam.load_transformers(), fam.load_encoders(),
                      LoRATrainConfig(rank=2, alpha=4), OptimizerConfig(),
                      media_modules=fam.load_media_encoders())
    engine = EmbeddedEngine(fam, fam.load_transformers(), fam.load_media_encoders())
    yield case, fam, learner, engine, bundles, inputs, media, guidance
    asyncio.run(engine.shutdown())


def _sampling(fam, bundles, inputs, guidance, steps, sampler=SamplerKind.ODE, group=1):
    from trainer.config import SamplerSettings
    from trainer.prompts import make_requests
    settings = SamplerSettings(sampler=sampler, num_steps=steps, noise_level=0.0,
                               guidance_scale=guidance, **SIZE)
    return make_requests(fam, bundles, settings, group, seed=5, version="base", media=inputs,
                         task=Task.EDIT)


def test_time_convention_check_runs_on_prompt_and_source(edit_case, monkeypatch):
    """The scheduler check (each project step equals the checkpoint's scheduler stepping the
    raw output) on the edit's conditions: the prompt encoded with its source, the source's
    latents a forward input. A flipped declaration fails it (StartupCheckError naming
    adapter.time_convention)."""
    from trainer import checks
    case, fam, learner, _, bundles, inputs, media, guidance = edit_case
    sampling = _sampling(fam, bundles, inputs, guidance, 2)[0].sampling
    if case == "qwen_image_edit":       # its conditioner shows the source: never text-only
        with pytest.raises(InvalidRequestError) as err:
            checks.prompt_conditions(learner, bundles)
        assert err.value.field == "media"
    forward = checks.forward_media(learner, sampling, media, [1, 1])
    assert forward["source_latents"].shape[0] == 2              # one source per row
    assert not torch.equal(forward["source_latents"][0], forward["source_latents"][1])
    report = checks.check_time_convention_scheduler(learner, bundles, sampling, media=media)
    assert report["scheduler_step_max_diff"] <= 1e-5, report
    monkeypatch.setattr(fam.denoiser, "time_convention", TimeConvention.DATA_PROGRESS)
    with pytest.raises(StartupCheckError) as err:
        checks.check_time_convention_scheduler(learner, bundles, sampling, media=media)
    assert err.value.field == "adapter.time_convention"


def test_lora_map_check_local_side_equals_the_engine_on_prompt_and_source(edit_case):
    """The LoRA map check in process: the engine's ODE edits under a random probe LoRA equal
    the learner's local rollout with the probe merged into the training-form weights (same
    prompts, sources, seeds, guidance), and differ from the base model's; the local rollout
    with the two prompts' sources swapped does not match (the source is in the compared path:
    StartupCheckError naming lora_map)."""
    from diffusion.step import doubles_rows
    from rollout.engine_api import EngineRequest
    from trainer import checks
    from trainer.rollout_batch import build_batch
    case, fam, learner, engine, bundles, inputs, media, guidance = edit_case
    steps = 2
    tensors, scale = checks.probe_lora(learner, seed=1)
    engine.load_lora(f"{case}-probe", tensors, scale)
    states = {}
    for version in (f"{case}-probe", "base"):
        requests = _sampling(fam, bundles, inputs, guidance, steps, group=2)
        canonical = [fam.validate_request(r, RequestLimits()) for r in requests]
        guided = doubles_rows(fam.spec.guidance, guidance)

        async def generate():
            return [await engine.generate(EngineRequest(
                r, learner.encode([b], [m]), learner.uncond([b], [m]) if guided else None,
                ("image_latent",), m, version)) for r, b, m in zip(requests, bundles, canonical)]
        results = asyncio.run(generate())
        outputs = [_output(r, res) for r, res in zip(requests, results)]
        states[version] = build_batch(learner, bundles, outputs, [r.sampling for r in requests],
                                      canonical).x0
    seeds = [s for r in requests for s in r.sampling.seeds]
    merged = checks.merged_copy(learner, tensors, scale)
    local = checks.sample_local_ode(learner, merged, bundles, seeds, steps, requests[0].sampling,
                                    media=media)
    report = checks.check_lora_map(states[f"{case}-probe"], states["base"], local, 1e-4)
    assert report["lora_probe_max_diff"] <= 1e-4 < report["lora_probe_effect"], report
    swapped = checks.sample_local_ode(learner, merged, bundles, seeds, steps,
                                      requests[0].sampling, media=media[::-1])
    with pytest.raises(StartupCheckError) as err:
        checks.check_lora_map(states[f"{case}-probe"], states["base"], swapped, 1e-4)
    assert err.value.field == "lora_map"


def _output(request, result):
    """A RolloutOutput of an engine result with a placeholder reward (build_batch needs one)."""
    from contract import RewardReport, RolloutOutput
    rows = len(request.sampling.seeds)
    return RolloutOutput(request.request_id, dict(result.latents), result.trajectory,
                         result.policy_version, request.sampling.seeds,
                         rewards=RewardReport({}, (0.0,) * rows, {}))
