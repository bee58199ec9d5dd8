"""Pure sampler math (no Ray, no models): schedules, time conventions, steps with log-prob, CFG."""
