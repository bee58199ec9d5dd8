"""vLLM-Omni 0.30 engine for GPU machines (rollout.engine_api.DiffusionEngine).

Importing this package imports no vLLM: `engine.VllmOmniEngine.create` loads it. Modules:
api (every upstream name used, checked against the wheel), lowering (pure request/output
translation), lora (validation + peft hand-off), pipeline (the worker-side custom pipeline),
engine (the client), fake (a CPU stand-in for AsyncOmni used by the tests).
"""
