"""The rollout graph: `build_app(config)` and `app` (the embedded tiny_t2i default).

    serve run graph:app                      # embedded default, HTTP on 127.0.0.1:8000
    serve run configs/tiny_t2va.yaml         # any config in Serve's config-file form

Stages (one Ray Serve deployment each, resources/autoscaling from config):
    TextEncoder  deployments/encoder.py   token ids -> embeddings, tensor-parallel over ETP shards
    DiTRollout   deployments/rollout.py   rollout strategy + engine loop + LoRA slots (rollout/)
    Decoder_*    deployments/decoder.py   one per latent kind (image/video VAE, audio VAE)
    Scorer_*     deployments/scorer.py    one per scorer family (rewards/)
    RolloutGraph deployments/ingress.py   validation, DAG of DeploymentResponses, HTTP
LoRA versions come from the policy store actor (deployments/policy_store.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from adapters.registry import get_adapter
from contract import Representation
from deployments.config import GraphConfig, load_graph_config
from deployments.decoder import DecoderServer
from deployments.encoder import TextEncoderServer
from deployments.ingress import RolloutGraph
from deployments.rollout import DiTRolloutServer
from deployments.scorer import ScorerServer

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_t2i.yaml"


def build_encoder(config: GraphConfig) -> Application:
    opts = config.encoder.deployment_options("TextEncoder")
    enc = config.encoder
    opts.update(TextEncoderServer.deployment_options(
        enc.etp, enc.num_cpus_per_shard, enc.num_cpus, enc.num_gpus, enc.num_gpus_per_shard,
        enc.device))
    return serve.deployment(TextEncoderServer, **opts).bind(
        config.adapter, config.weights_path, enc.etp, enc.device)


def build_rollout(config: GraphConfig) -> Application:
    opts = config.rollout_stage.deployment_options("DiTRollout")
    return serve.deployment(DiTRolloutServer, **opts).bind(config.rollout, config.policy_store)


def build_decoders(config: GraphConfig) -> dict[str, Application]:
    io_spec = get_adapter(config.adapter).io_spec
    latents = sorted({a.source for a in io_spec.artifacts
                      if a.representation == Representation.DECODED})
    return {latent: serve.deployment(DecoderServer,
                                     **config.decoder.deployment_options(f"Decoder_{latent}")
                                     ).bind(config.adapter, config.weights_path, latent,
                                            config.http.max_preview_pixels)
            for latent in latents}


def build_scorers(config: GraphConfig) -> dict[str, Application]:
    return {spec.name: serve.deployment(ScorerServer,
                                        **spec.stage.deployment_options(f"Scorer_{spec.name}")
                                        ).bind(spec)
            for spec in config.scorers}


def build_app(args: dict[str, Any] | str | Path | GraphConfig) -> Application:
    """Serve application builder (`import_path: graph:build_app` + `args:`)."""
    config = load_graph_config(args)
    ingress = serve.deployment(RolloutGraph, **config.ingress.deployment_options("RolloutGraph"))
    return ingress.bind(config, build_encoder(config), build_rollout(config),
                        build_decoders(config), build_scorers(config))


app = build_app(DEFAULT_CONFIG)
