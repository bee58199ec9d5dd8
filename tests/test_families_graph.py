"""Tiny SD3 and FLUX checkpoints through the whole system: the Serve graph loaded from the
checkpoint folder, an HTTP rollout (with a negative prompt for SD3), and a few steps of
DiffusionNFT, FlowGRPO and Diffusion-DPO through handles with every start-up check on (the
time convention against the checkpoint's scheduler, the LoRA map, the token ids), plus those
checks failing on purpose."""
from __future__ import annotations

import httpx
import pytest
import torch

from contract import Algorithm, StartupCheckError, TimeConvention
from tests.lora_utils import swap_qk
from tests.trainer_helpers import checked_steps
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(900)

FAMILIES = {"sd3": {"max_sequence_length": 32}, "flux": {"max_sequence_length": 48}}
SIZE = {"height": 32, "width": 48}


def graph_config(family: str, root) -> dict:
    return {"app_name": f"fam_{family}",
            "rollout": {"adapter": family, "weights_path": str(root),
                        "adapter_options": FAMILIES[family]},
            "rollout_stage": {"num_cpus": 0.5},
            "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                         "inputs": ["image"], "reward": {"policy": "required"}}],
            "limits": {"max_prompts": 4, "max_samples_per_prompt": 4, "max_steps": 8,
                       "max_height": 64, "max_width": 64, "max_frames": 1},
            "policy_store": f"fam_{family}_store"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def deployed(request, ray_cluster, tiny_checkpoint):
    from ray import serve

    from graph import build_app, delete_graph
    family = request.param
    config = graph_config(family, tiny_checkpoint(family))
    serve.run(build_app(config), name=config["app_name"], route_prefix=f"/{family}")
    yield family, config, ray_cluster["http_port"]
    delete_graph(config)


def trainer_config(tmp_path, family, config, algorithm: Algorithm, **over):
    guidance = 2.0 if family == "sd3" else 3.5        # SD3: true CFG; FLUX: the embedding
    cfg = {"graph": config, "algorithm": algorithm.value, "steps": 2,
           "prompts_per_step": 2, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2],
                       "guidance_scale": guidance, **SIZE},
           "lora": {"rank": 2, "alpha": 4}, "nft": {"train_timesteps": 1},
           "awm": {"train_timesteps": 1},
           "dpo": {"draws_per_pair": 1}, "pipeline": {"mode": "serial", "max_staleness": 1},
           "eval": {"every": 2, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
           "run_dir": str(tmp_path / algorithm.value), "checkpoint_every": 100, "gallery": False}
    cfg.update(over)
    return load_trainer_config(cfg)


def test_http_rollout_from_the_checkpoint(deployed):
    family, _, port = deployed
    body = {"prompts": ["a red circle at the top left on a black background"],
            "samples_per_prompt": 2, "seed": 3, "num_steps": 3, "sampler": "ode",
            "noise_level": 0.0, "guidance_scale": 2.0 if family == "sd3" else 3.5,
            "include_media": True, **SIZE}
    if family == "sd3":
        body["negative_prompts"] = ["blurry"]
    reply = httpx.post(f"http://127.0.0.1:{port}/{family}/rollout", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    [result] = reply.json()["results"]
    assert [s["seed"] for s in result["samples"]] == [3, 4]
    for sample in result["samples"]:
        shapes = {a["name"]: a["shape"] for a in sample["artifacts"]}
        assert shapes["image"] == [3, 32, 48]
        assert sample["media"]["image"].startswith("data:image/png;base64,")
        assert 0.0 <= sample["reward"] <= 1.0
    if family == "flux":                        # a negative prompt is refused, with the field
        bad = httpx.post(f"http://127.0.0.1:{port}/{family}/rollout",
                         json=body | {"negative_prompts": ["blurry"]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "prompt.negative"


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_each_algorithm_trains_with_every_check(deployed, tmp_path, algorithm):
    from trainer.loop import Trainer
    family, config, _ = deployed
    torch.manual_seed(0)
    trainer = Trainer(trainer_config(tmp_path, family, config, algorithm))
    history = trainer.run()
    assert len(history) == 2
    steps, _ = checked_steps(tmp_path / algorithm.value)
    assert any(r.get("grad_norm", 0) > 0 for r in steps)     # it really stepped
    for r in steps:
        if "logprob_ratio_err_max" in r:
            assert r["logprob_ratio_err_max"] <= 1e-4        # version parity, fp32


def test_startup_checks_fail_on_purpose(deployed, tmp_path, monkeypatch):
    from trainer import checks
    from trainer.loop import Trainer
    family, config, _ = deployed
    trainer = Trainer(trainer_config(tmp_path, family, config, Algorithm.FLOW_GRPO))

    with pytest.raises(StartupCheckError) as err:
        trainer.startup.lora_map(publish_transform=swap_qk)
    assert err.value.field == "lora_map"
    trainer.publish_sampling()
    pending = trainer.submit(0)
    outputs, _ = trainer.collect(pending)
    names = trainer.family.spec.encoder_names
    assert checks.check_token_ids(pending.prompts, outputs, names) == 2
    last = names[-1]
    altered = [p.model_copy(update={"encoder_token_ids": {
        **p.encoder_token_ids, last: p.encoder_token_ids[last][:-1] + (7,)}})
        for p in pending.prompts]
    with pytest.raises(StartupCheckError) as err:
        checks.check_token_ids(altered, outputs, names)
    assert err.value.field == f"encoded_token_ids.{last}"
    monkeypatch.setattr(trainer.family.denoiser, "time_convention",
                        TimeConvention.DATA_PROGRESS)
    with pytest.raises(StartupCheckError) as err:
        trainer.startup.time_convention()
    assert err.value.field == "adapter.time_convention"
