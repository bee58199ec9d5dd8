"""Request bodies far over a graph's request bounds, each with the field its 413 names: what
tests/test_graph.py and tests/test_request_bounds.py post, and bench/refusal_bench.py times,
against the same LIMITS."""
from __future__ import annotations

PROMPT = "a red circle at the top left on a black background"
LIMITS = {"max_prompts": 4, "max_samples_per_prompt": 8, "max_steps": 20, "max_height": 32,
          "max_width": 32, "max_frames": 1}          # max_prompt_chars 4096, body 1 MiB: defaults
OVERSIZED = [({"prompts": [PROMPT], "samples_per_prompt": 10**9}, "samples_per_prompt"),
             ({"prompts": ["a"] * 10**5}, "prompts"),
             ({"prompts": [PROMPT], "num_steps": 10**7}, "num_steps"),
             ({"prompts": [PROMPT], "height": 10**6}, "height"),
             ({"prompts": ["x" * 800_000]}, "prompts[0]")]
