"""Pure sampler math (no Ray, no models): schedules, time conventions, steps with log-prob, CFG,
SDE windows and batch-independent per-row noise."""
from diffusion.conventions import (from_sigma_velocity, model_time, predict_velocity,
                                   to_sigma_velocity)
from diffusion.guidance import cfg_velocity, cfg_x0
from diffusion.noise import NoiseStream, initial_noise, row_noise, row_seed
from diffusion.samplers import (StepOutput, cps_step, dance_sde_step, log_prob_of, ode_step,
                                sampler_step, sde_step)
from diffusion.schedule import flow_match_sigmas, shift_sigma
from diffusion.windows import (flash_post_points, flash_schedule, sample_sde_window,
                               sliding_sde_window, sliding_window_exhausted, uses_sde)

__all__ = [
    "NoiseStream", "StepOutput", "cfg_velocity", "cfg_x0", "cps_step", "dance_sde_step",
    "flash_post_points", "flash_schedule",
    "flow_match_sigmas", "from_sigma_velocity", "initial_noise", "log_prob_of", "model_time",
    "ode_step", "predict_velocity", "row_noise", "row_seed", "sample_sde_window", "sampler_step",
    "sde_step", "shift_sigma", "sliding_sde_window", "sliding_window_exhausted",
    "to_sigma_velocity", "uses_sde",
]
