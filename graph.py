"""The rollout graph: `build_app(config)` and `app` (the embedded tiny_t2i default).

    serve run graph:app                      # embedded default, HTTP on 127.0.0.1:8000
    serve run configs/tiny_t2va.yaml         # any config in Serve's config-file form

Stages (one Ray Serve deployment each, resources/autoscaling from config):
    TextEncoder  deployments/encoder.py   token ids -> embeddings, tensor-parallel over ETP shards
    DiTRollout   deployments/rollout.py   rollout strategy + engine loop + LoRA slots (rollout/)
    Decoder_*    deployments/decoder.py   one per latent kind (image/video VAE, audio VAE)
    Scorer_*     deployments/scorer.py    one per scorer family (rewards/)
    RolloutGraph deployments/ingress.py   validation, DAG of DeploymentResponses, HTTP
LoRA versions come from the policy store actor (deployments/policy_store.py). Which deployments a
config has and their Serve options: deployments/topology.py (shared with the planner and the
cluster manifests). `app` is bound on first use: importing this module builds nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ray import serve
from ray.serve import Application

from contract.cli import error_line, user_errors
from deployments.config import GraphConfig, load_graph_config
from deployments.decoder import DecoderServer
from deployments.encoder import TextEncoderServer
from deployments.ingress import RolloutGraph
from deployments.objects import get_object_holder, holder_name, shard_name
from deployments.placement import check_graph_fits, check_placement, live_nodes
from deployments.policy_store import get_policy_store
from deployments.rollout import DiTRolloutServer
from deployments.scorer import ScorerServer
from deployments.topology import (declared_family, decoded_latents, encoder_options,
                                  graph_replicas)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny_t2i.yaml"


def routing_options(config: GraphConfig) -> dict[str, Any]:
    """The request router of the stages a prompt group should stay on (encoder, rollout)."""
    if not config.group_affinity:
        return {}
    from ray.serve.config import RequestRouterConfig

    from deployments.routing import GroupAffinityRouter
    return {"request_router_config": RequestRouterConfig(
        request_router_class=GroupAffinityRouter)}


def build_encoder(config: GraphConfig) -> Application:
    enc = config.encoder
    return serve.deployment(TextEncoderServer, **encoder_options(config),
                            **routing_options(config)).bind(
        config.adapter, config.weights_path, enc.etp, enc.device, enc.dtype,
        config.adapter_options, enc.prompt_cache_bytes, enc.max_batch_size,
        enc.batch_wait_timeout_s)


def build_rollout(config: GraphConfig) -> Application:
    opts = {**config.rollout_stage.deployment_options("DiTRollout"), **routing_options(config)}
    return serve.deployment(DiTRolloutServer, **opts).bind(config.rollout, config.policy_store,
                                                           config.limits,
                                                           config.object_holder)


def build_decoders(config: GraphConfig) -> dict[str, Application]:
    return {latent: serve.deployment(DecoderServer,
                                     **config.decoder.deployment_options(f"Decoder_{latent}")
                                     ).bind(config.adapter, config.weights_path, latent,
                                            config.http.max_preview_pixels,
                                            config.decoder.device, config.decoder.dtype,
                                            config.adapter_options,
                                            config.object_holder,
                                            config.decoder.max_batch_size,
                                            config.decoder.batch_wait_timeout_s)
            for latent in decoded_latents(config)}


def build_scorers(config: GraphConfig) -> dict[str, Application]:
    return {spec.name: serve.deployment(ScorerServer,
                                        **spec.stage.deployment_options(f"Scorer_{spec.name}")
                                        ).bind(spec)
            for spec in config.scorers}


def build_app(args: dict[str, Any] | str | Path | GraphConfig) -> Application:
    """Serve application builder (`import_path: graph:build_app` + `args:`). Connected to a
    cluster (`serve run`, a Serve config deploy, `ray.init` then `serve.run`), it first checks
    that every stage fits on some node and that the whole graph at its starting replica counts
    fits the cluster (deployments/placement.py): a ConfigError naming the stage and the
    resource, the demand and the capacity, instead of replicas that never schedule."""
    config = load_graph_config(args)
    import ray
    if ray.is_initialized():
        nodes, replicas = live_nodes(), graph_replicas(config)
        check_placement([r.demand for r in replicas], nodes)
        check_graph_fits(replicas, nodes)
    return bind_graph(config)


def bind_graph(config: GraphConfig) -> Application:
    """The application of a validated config, without the placement check."""
    ingress = serve.deployment(RolloutGraph, **config.ingress.deployment_options("RolloutGraph"))
    return ingress.bind(config, build_encoder(config), build_rollout(config),
                        build_decoders(config), build_scorers(config))


_default_app: Application | None = None


def __getattr__(name: str) -> Any:
    """`graph.app` (`serve run graph:app`): the embedded default graph, bound on first use.
    Importing this module builds nothing; `serve run` reads `app` before it connects, so the
    default graph is not checked against a cluster here (build_app does that)."""
    global _default_app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _default_app is None:
        _default_app = bind_graph(load_graph_config(DEFAULT_CONFIG))
    return _default_app


DELETE_TIMEOUT_S = 60.0     # delete_graph: for Ray to finish killing the two detached actors


def delete_graph(args: dict[str, Any] | str | Path | GraphConfig) -> None:
    """Take a deployed graph down whole: its Serve application, then the detached actors it
    made, its ObjectHolder and its policy store with every stored version. `serve.delete` alone
    leaves those two running by design (a redeployed graph or a restarted trainer finds the
    versions again); this is for when the graph is done with. Returns once both names are free,
    so a graph deployed next under the same names gets new actors, not the dying ones."""
    import time

    import ray
    config = load_graph_config(args)
    serve.delete(config.app_name)
    lookups = (*((get_object_holder, shard_name(holder_name(config.app_name), i))
                 for i in range(config.objects.shards)),
               (get_policy_store, config.policy_store))
    for lookup, name in lookups:
        try:
            ray.kill(lookup(name, create=False), no_restart=True)
        except ValueError:          # never created
            pass
    deadline = time.monotonic() + DELETE_TIMEOUT_S
    for lookup, name in lookups:
        while True:
            try:
                lookup(name, create=False)
            except ValueError:      # gone: the name is free
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor {name!r} still alive {DELETE_TIMEOUT_S} s after "
                                   "ray.kill")
            time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graph CONFIG.yaml ...`: build each Serve config file as `serve run` would (no
    cluster needed, no weights: a checkpoint that is only on the cluster is declared by its
    `rollout.architecture`, and the output says the path was not checked here); a bad one
    prints its typed error naming the field on one line and exits 2, where `serve run` would
    show it inside Serve's build traceback and retry."""
    import sys
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m graph CONFIG.yaml [CONFIG.yaml ...]", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        try:
            config = load_graph_config(path)
            build_app(config)
            note = declared_family(config).source.note
            print(f"{path}: ok" + (f" ({note})" if note else ""))
        except user_errors() as exc:
            print(f"{path}: {error_line(exc)}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())
