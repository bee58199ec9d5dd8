"""MixGRPO-Flash against MixGRPO's code on the same random inputs (fp32, rtol 1e-5): the
schedule rebuilt after the SDE window (`diffusion.flash_schedule`) and the sampling loop --
ODE before the window, FlowGRPO's SDE inside it, DPM-Solver++(2M) (midpoint) on the compressed
schedule after it, the solver's history fed with every earlier step's data prediction -- as the
rollout's SampleRecorder runs it (`SamplingSpec.flash_compress`).

Excerpts cut to the lines used from Tencent-Hunyuan/MixGRPO
e5cdd6a427778d8c8b2e7a48ce16972141adbe7c: fastvideo/utils/sampling_utils.py (run_sample_step's
`dpm_apply_strategy == "post"` branch with flow_grpo_sampling, flow_grpo_step, DPMState,
dpm_step, convert_model_output, dpm_solver_first_order_update and
multistep_dpm_solver_second_order_update for dpmsolver++ / midpoint, _sigma_to_alpha_sigma_t,
sd3_time_shift); the Flash script scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh sets
dpmsolver++, order 2, midpoint, post, compress ratio 0.4. Changed: flow_grpo_step takes its
Gaussian draw as an argument instead of randn_tensor (the same draw is given to both sides).
"""
from __future__ import annotations

import math

import pytest
import torch

from contract import InvalidRequestError, SamplerKind, SamplingSpec
from diffusion import flash_post_points, flash_schedule
from diffusion.noise import row_noise
from diffusion.samplers import SolverHistory, sampler_step
from diffusion.windows import check_flash, flash_sigmas
from rollout.recorder import SampleRecorder


# ---- excerpts of the reference code -------------------------------------------------------
def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def _sigma_to_alpha_sigma_t(sigma):
    alpha_t = 1 - sigma
    sigma_t = sigma
    return alpha_t, sigma_t


def ref_post_schedule(sigma_schedule, determistic, dpm_post_compress_ratio, shift):
    last_false_index = next((i for i, value in enumerate(reversed(determistic)) if not value),
                            None)
    last_false_index = len(determistic) - 1 - last_false_index
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index)
                             * dpm_post_compress_ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0))[last_false_index + 1].item()
    post_sigma_schedule = torch.linspace(post_time_step, 0, num_post_steps)
    post_sigma_schedule = sd3_time_shift(shift, post_sigma_schedule)
    sigma_schedule = torch.cat([sigma_schedule[:last_false_index + 1], post_sigma_schedule],
                               dim=0)
    return sigma_schedule, last_false_index


def ref_flow_grpo_step(model_output, latents, eta, sigmas, index, variance_noise, determistic):
    sigma = sigmas[index]
    sigma_prev = sigmas[index + 1]
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    pred_original_sample = latents - sigma * model_output
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = latents * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    if determistic:
        prev_sample = latents + dt * model_output
    return prev_sample, pred_original_sample


class DPMState:
    def __init__(self, order):
        self.order = order
        self.model_outputs = [None] * order
        self.lower_order_nums = 0

    def update(self, model_output):
        for i in range(self.order - 1):
            self.model_outputs[i] = self.model_outputs[i + 1]
        self.model_outputs[-1] = model_output

    def update_lower_order(self):
        if self.lower_order_nums < self.order:
            self.lower_order_nums += 1


def convert_model_output(model_output, sample, sigmas, step_index):
    sigma_t = sigmas[step_index]
    return sample - sigma_t * model_output


def dpm_solver_first_order_update(model_output, sigmas, step_index, sample):
    sigma_t, sigma_s = sigmas[step_index + 1], sigmas[step_index]
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s, sigma_s = _sigma_to_alpha_sigma_t(sigma_s)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
    h = lambda_t - lambda_s
    return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output


def multistep_dpm_solver_second_order_update(model_output_list, sigmas, step_index, sample):
    sigma_t, sigma_s0, sigma_s1 = (sigmas[step_index + 1], sigmas[step_index],
                                   sigmas[step_index - 1])
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s0, sigma_s0 = _sigma_to_alpha_sigma_t(sigma_s0)
    alpha_s1, sigma_s1 = _sigma_to_alpha_sigma_t(sigma_s1)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = model_output_list[-1], model_output_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    D0, D1 = m0, (1.0 / r0) * (m0 - m1)
    return ((sigma_t / sigma_s0) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * D0
            - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1)


def ref_dpm_step(model_output, sample, step_index, timesteps, sigmas, dpm_state, order=2):
    lower_order_final = (step_index == len(timesteps) - 1)
    model_output = convert_model_output(model_output, sample, sigmas, step_index=step_index)
    dpm_state.update(model_output)
    sample = sample.to(torch.float32)
    if order == 1 or dpm_state.lower_order_nums < 1 or lower_order_final:
        prev_sample = dpm_solver_first_order_update(model_output, sigmas, step_index, sample)
    else:
        prev_sample = multistep_dpm_solver_second_order_update(dpm_state.model_outputs, sigmas,
                                                               step_index, sample)
    dpm_state.update_lower_order()
    return prev_sample


def ref_run_sample_step(z, sigma_schedule, determistic, velocity, eta, noises, ratio, shift):
    """run_sample_step, dpm_apply_strategy "post", flow_grpo_sampling, dpmsolver++ order 2."""
    dpm_state = DPMState(order=2)
    sigma_schedule, last_false_index = ref_post_schedule(sigma_schedule, determistic, ratio,
                                                         shift)
    for i in range(sigma_schedule.size(0) - 1):
        pred = velocity(z, sigma_schedule[i])
        if i <= last_false_index:
            x_0 = convert_model_output(pred, z.to(torch.float32), sigma_schedule, step_index=i)
            dpm_state.update(x_0)
            z, _ = ref_flow_grpo_step(pred, z.to(torch.float32), eta, sigma_schedule, i,
                                      noises[i], determistic[i])
            dpm_state.update_lower_order()
        else:
            z = ref_dpm_step(pred, z.to(torch.float32), i, sigma_schedule[:-1], sigma_schedule,
                             dpm_state)
    return z, sigma_schedule


# ---- the project's side ------------------------------------------------------------------
def _velocity_fn(seed: int, shape):
    g = torch.Generator().manual_seed(seed)
    a, c = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return lambda x, sigma: torch.tanh(a * x + c * sigma) * (0.5 + sigma)


def _project_loop(z, sigmas, window, velocity, eta, noises, post=SamplerKind.DPM2):
    """ODE before the window, SDE in it, DPM-Solver++(2M) after it, each step's x0 history."""
    x, history, rows = z, None, z.shape[0]
    for j in range(sigmas.shape[0] - 1):
        s, sn = sigmas[j].expand(rows), sigmas[j + 1].expand(rows)
        v = velocity(x, sigmas[j])
        if j >= window[1]:
            out = sampler_step(post, x, v, s, sn, 0.0, None,
                               history=history if post is SamplerKind.DPM2 else None)
        else:
            kind = SamplerKind.SDE if window[0] <= j else SamplerKind.ODE
            out = sampler_step(kind, x, v, s, sn, eta, noises[j] if kind is SamplerKind.SDE
                               else None)
        history = out.history or SolverHistory(x - s.reshape(-1, 1, 1, 1) * v, s)
        x = out.prev_sample
    return x


CASES = [  # (num_steps, window, ratio, shift)
    (10, (2, 5), 0.4, 3.0), (12, (1, 3), 0.6, 1.0), (16, (4, 8), 0.4, 3.0),
    (8, (1, 2), 1.0, 2.0), (25, (0, 4), 0.4, 3.0)]


@pytest.mark.parametrize("num_steps,window,ratio,shift", CASES)
def test_flash_schedule_equals_mixgrpos(num_steps, window, ratio, shift):
    sigmas = sd3_time_shift(shift, torch.linspace(1, 0, num_steps + 1))
    determistic = [not window[0] <= i < window[1] for i in range(num_steps)]
    want, _ = ref_post_schedule(sigmas, determistic, ratio, shift)
    got = flash_schedule(sigmas, window[1], ratio, shift)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert len(got) - 1 - window[1] == flash_post_points(num_steps, window[1], ratio) - 1
    assert float(got[-1]) == 0.0 and bool((got[1:] < got[:-1]).all())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_steps,window,ratio,shift", CASES[:4])
def test_flash_sampling_equals_mixgrpos(seed, num_steps, window, ratio, shift):
    shape = (3, 4, 4, 4)
    g = torch.Generator().manual_seed(100 + seed)
    z = torch.randn(shape, generator=g)
    noises = [torch.randn(shape, generator=g) for _ in range(num_steps)]
    velocity = _velocity_fn(seed, shape)
    sigmas = sd3_time_shift(shift, torch.linspace(1, 0, num_steps + 1))
    determistic = [not window[0] <= i < window[1] for i in range(num_steps)]
    want, table = ref_run_sample_step(z, sigmas, determistic, velocity, 0.7, noises, ratio,
                                      shift)
    got = _project_loop(z, flash_schedule(sigmas, window[1], ratio, shift), window, velocity,
                        0.7, noises)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # with two or more steps after the window the second-order solver matters: Euler on the
    # same table lands elsewhere (a single step into sigma 0 is first order: Euler itself)
    euler = _project_loop(z, table, window, velocity, 0.7, noises, post=SamplerKind.ODE)
    gap = float((euler - want).abs().max())
    assert gap > 1e-3 if flash_post_points(num_steps, window[1], ratio) >= 3 else gap < 1e-5


def test_bad_flash_options_are_typed_errors_naming_the_field():
    sigmas = torch.linspace(1, 0, 11)
    for args, field in [((sigmas, 10, 0.4, 3.0), "window_end"),     # window covers every step
                        ((sigmas, 9, 0.4, 3.0), "compress_ratio"),  # 1 point: no sigma 0
                        ((sigmas, 12, 0.4, 3.0), "window_end"),     # larger than the steps
                        ((sigmas, 4, 0.0, 3.0), "compress_ratio"),
                        ((sigmas, 4, 1.5, 3.0), "compress_ratio"),
                        ((sigmas, 4, 0.4, 0.0), "shift")]:
        with pytest.raises(InvalidRequestError) as e:
            flash_schedule(*args)
        assert e.value.field == field and str(args[{"window_end": 1, "compress_ratio": 2,
                                                    "shift": 3}[field]]) in str(e.value)
    assert math.isclose(float(flash_schedule(sigmas, 4, 0.5, 1.0)[4]), float(sigmas[4]))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("num_steps,window,ratio,shift", [CASES[0], CASES[1], CASES[3]])
def test_the_rollout_recorder_samples_flash_as_mixgrpo(seed, num_steps, window, ratio, shift):
    """The engines' SampleRecorder on a request with flash_compress (its table from
    diffusion.flash_sigmas, as ModelFamily.request_sigmas builds it) lands where MixGRPO's
    run_sample_step does with the same noise, and records the SDE window's trajectory."""
    shape = (3, 4, 4, 4)
    sampling = SamplingSpec(num_steps=num_steps, sde_window=window, noise_level=0.7,
                            seeds=(11 + seed, 12 + seed, 13 + seed), flash_compress=ratio)
    sigmas = sd3_time_shift(shift, torch.linspace(1, 0, num_steps + 1))
    g = torch.Generator().manual_seed(200 + seed)
    z = torch.randn(shape, generator=g)
    velocity = _velocity_fn(seed, shape)
    noises = [row_noise(sampling.seeds, j, shape[1:]) for j in range(num_steps)]
    determistic = [not window[0] <= i < window[1] for i in range(num_steps)]
    want, table = ref_run_sample_step(z, sigmas, determistic, velocity, 0.7, noises, ratio,
                                      shift)
    recorder = SampleRecorder(sampling, flash_sigmas(sigmas, sampling, shift))
    x = z
    while not recorder.done:
        x = recorder.advance(x, velocity(x, recorder.sigmas[recorder.step]))
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recorder.sigmas, table, rtol=1e-5, atol=1e-7)
    traj = recorder.trajectory(torch.zeros(len(table) - 1), "v")
    assert traj.window == window and traj.log_probs.shape == (3, window[1] - window[0])
    if len(table) != len(sigmas):                       # an uncompressed table is refused
        with pytest.raises(InvalidRequestError) as e:
            SampleRecorder(sampling, sigmas)
        assert e.value.field == "sampling.flash_compress"
    with pytest.raises(InvalidRequestError) as e:        # a window reaching the last step
        check_flash(sampling.model_copy(update={"sde_window": (1, num_steps)}))
    assert e.value.field == "sampling.sde_window"
