"""vLLM-Omni 0.30 engine for GPU machines (rollout.engine_api.DiffusionEngine).

Importing this package imports no vLLM: `engine.VllmOmniEngine.create` loads it. Modules:
api (every upstream name used, checked against the wheel), lowering (pure request/output
translation), lora (validation + peft hand-off), pipeline (the worker-side custom pipeline),
engine (the client). The tests' CPU stand-in for AsyncOmni is testing/vllm_omni_fake.py.
"""


def build_engine(config, family):
    """rollout.strategy's entry point for EngineKind.VLLM_OMNI (GPU machines)."""
    from contract import ConfigError
    from rollout.vllm_omni.engine import VllmOmniEngine

    if config.weights_path is None:
        raise ConfigError("the vLLM-Omni engine needs a local model directory",
                          field="rollout.weights_path", expected="a local path", actual=None)
    return VllmOmniEngine.create(config.adapter, config.weights_path,
                                 max_num_seqs=config.limits.max_batch_rows)
