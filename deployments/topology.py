"""The graph's topology from its config: which deployments it has and each one's Serve options.

`stage_options(config)` is the one derivation that graph.py's build_* functions, the placement
check, the planner (bench/plan.py) and the cluster manifests (deployments/manifests.py) use:
deployment name -> (its config field, its Serve options). Deployments: TextEncoder, DiTRollout,
one Decoder_<latent> per decoded latent kind the family declares, one Scorer_<name> per scorer,
RolloutGraph (the ingress). Nothing here needs the checkpoint's weights or a cluster.
"""
from __future__ import annotations

from typing import Any, Sequence

from adapters.architectures import Declaration, declare
from contract import Representation
from deployments.config import GraphConfig
from deployments.encoder import TextEncoderServer
from deployments.placement import (StageDemand, StageReplicas, demand_from_options, head_actor,
                                   into_bundles, replica_counts)
from deployments.policy_store import HEAD_NODE


def encoder_options(config: GraphConfig) -> dict[str, Any]:
    opts = config.encoder.deployment_options("TextEncoder")
    enc = config.encoder
    opts.update(TextEncoderServer.deployment_options(
        enc.etp, enc.num_cpus_per_shard, enc.num_cpus, enc.num_gpus, enc.num_gpus_per_shard,
        enc.device, enc.memory_bytes, enc.memory_bytes_per_shard))
    return into_bundles(opts)          # custom resources / labels onto the ETP group's bundles


def declared_family(config: GraphConfig) -> Declaration:
    """What the config's family declares, from its checkpoint's JSON files on this machine or,
    where the checkpoint is only on the cluster, from `rollout.architecture`'s description
    (adapters/architectures): the graph is built and planned without its weights; each stage
    loads them on its node (a missing path is its ConfigError there)."""
    return declare(config.adapter, config.weights_path, config.adapter_options,
                   config.rollout.architecture)


def decoded_latents(config: GraphConfig) -> list[str]:
    """Latent kinds with a decoded artifact: one Decoder deployment each."""
    io_spec = declared_family(config).spec.io_spec
    return sorted({a.source for a in io_spec.artifacts
                   if a.representation == Representation.DECODED})


def stage_options(config: GraphConfig, latents: Sequence[str] | None = None
                  ) -> dict[str, tuple[str, dict[str, Any]]]:
    """Deployment name -> (its config field, its Serve options). `latents`: the decoded latent
    kinds, when the caller states them instead of reading the checkpoint (a plan for a
    checkpoint this machine does not hold)."""
    out = {"TextEncoder": ("encoder", encoder_options(config)),
           "DiTRollout": ("rollout_stage",
                          config.rollout_stage.deployment_options("DiTRollout"))}
    for latent in (decoded_latents(config) if latents is None else latents):
        name = f"Decoder_{latent}"
        out[name] = ("decoder", config.decoder.deployment_options(name))
    for i, spec in enumerate(config.scorers):
        name = f"Scorer_{spec.name}"
        out[name] = (f"scorers[{i}].stage", spec.stage.deployment_options(name))
    out["RolloutGraph"] = ("ingress", config.ingress.deployment_options("RolloutGraph"))
    return out


def stage_demands(config: GraphConfig) -> list[StageDemand]:
    """One replica's resources and label selector per deployment."""
    return [demand_from_options(field, opts) for field, opts in stage_options(config).values()]


def graph_replicas(config: GraphConfig) -> list[StageReplicas]:
    """Everything the deployed graph asks the cluster for: each deployment's replica demand with
    its starting and maximum replica counts, and the two detached actors on the head node."""
    out = [StageReplicas(demand_from_options(field, opts), *replica_counts(opts))
           for field, opts in stage_options(config).values()]
    for field, name, count in (("policy_store", "PolicyStore", 1),
                               ("app_name", "ObjectHolder", config.objects.shards)):
        out.append(StageReplicas(head_actor(field, name, HEAD_NODE), count, count))
    return out
