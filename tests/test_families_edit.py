"""The edit task (a source image + an instruction -> an image) on FLUX.1 Kontext: the tiny
flux_kontext checkpoint (tiny FLUX's components saved by FluxKontextPipeline) against FluxKontextPipeline
(tests/family_conformance.py, task edit; the edit checks of tests/edit_conformance.py), plus the
edit's own bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from contract import LimitExceededError, MediaFormatError, RequestLimits, SamplingSpec
from tests.edit_conformance import EditConformance, edit_request, pil, striped_image
from tests.family_conformance import PROMPTS

torch.set_num_threads(1)
SOURCE_SIZE = (48, 80)             # the source image's H, W: another size than the output's


class TestFluxKontext(EditConformance):
    family, checkpoint = "flux", "flux_kontext"
    options = {"max_sequence_length": 48}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128},)
    bad_size = {"height": 64, "width": 88}
    guidance_scale = 2.5
    steps = 3
    sigma_steps = (1, 3)
    samples_per_prompt = 4

    # the components are tiny FLUX's, checked by tests/test_families_image.py::TestFlux: the
    # checks that do not depend on the task are not repeated here
    test_sigmas_equal_the_pipeline_scheduler = None
    test_token_ids_are_the_tokenizers_and_reach_the_encoders = None
    test_bad_sizes_paths_and_dtypes_are_typed_errors = None
    test_every_pipeline_class_over_the_components_loads = None
    test_every_declared_lora_target_exists = None
    test_lora_file_round_trip_through_diffusers_loader = None

    @pytest.fixture(scope="class")
    def root(self, tiny_checkpoint):
        """The tiny flux_kontext checkpoint: FluxKontextPipeline wrote it (model_index names it)."""
        folder = tiny_checkpoint(self.checkpoint)
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == "FluxKontextPipeline"
        return folder

    def source_image(self, inverted=False):
        return striped_image(SOURCE_SIZE, stripe=8, rise=2.0, inverted=inverted)

    def pipeline(self, root):
        from diffusers import FluxKontextPipeline
        return FluxKontextPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        return pipe(image=pil(self.source_image(self.inverted)),
                    prompt=[PROMPTS[0]] * x0.shape[0], latents=x0,
                    num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                    output_type=output_type, max_sequence_length=48, _auto_resize=False,
                    max_area=self.size["height"] * self.size["width"], **self.size)

    def pipeline_sigmas(self, fam, scheduler, sampling):
        n = sampling.num_steps
        seq = fam.codec.state_shape(sampling)[0]
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / n, n)), mu=fam.schedule.mu(seq))
        return scheduler.sigmas.float()

    def test_edit_bad_input_is_typed_and_names_the_field(self, fam):
        bundle = fam.conditioner.tokenize([PROMPTS[0]])[0]
        sampling = SamplingSpec(seeds=(0,), num_steps=2, **self.size)
        self.check_edit_needs_an_rgb_source(fam, bundle, (64, 96))
        odd = torch.zeros(3, 40, 88, dtype=torch.uint8)       # not multiples of 16
        request = edit_request(bundle, sampling, odd)
        with pytest.raises(MediaFormatError) as err:          # refused before any work
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "media.image" and "(3, 40, 88)" in err.value.actual
        assert err.value.request_id == request.request_id
        big = torch.zeros(3, 64, 2048, dtype=torch.uint8)
        with pytest.raises(LimitExceededError) as err:
            fam.validate_request(edit_request(bundle, sampling, big), RequestLimits())
        assert err.value.field == "media.image" and err.value.actual == (3, 64, 2048)
