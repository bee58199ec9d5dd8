"""Cluster manifests and placement, without a cluster: the checked-in KubeRay / `ray up` files are
exactly what deployments/manifests.py renders from the graph config and the cluster spec; the
embedded Serve config validates as the same GraphConfig; every stage's Serve resources fit the
worker group its labels select, also at every stage's maximum replica count; placements no node
can hold are ConfigErrors naming the stage and the resource."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from contract import ConfigError
from deployments.config import load_graph_config
from deployments.manifests import (LABEL_KEY, check_cluster, load_cluster_spec, max_replicas,
                                   node_shapes, render_all)
from deployments.placement import (NodeShape, StageDemand, check_placement, labels_match,
                                   pack_first_fit, parse_selector_value)

ROOT = Path(__file__).resolve().parents[1]
GRAPH = Path("configs/cluster_t2va_64gpu.yaml")
CLUSTER = Path("deploy/cluster_t2va_64gpu.yaml")


@pytest.fixture(scope="module")
def rendered():
    return render_all(ROOT / GRAPH, ROOT / CLUSTER)


def test_checked_in_manifests_are_the_rendered_ones(rendered):
    for rel, text in rendered.items():
        assert (ROOT / "deploy" / rel).read_text() == text, \
            f"deploy/{rel} is stale: run `python -m deployments.manifests`"


def test_manifests_match_the_graph_config(rendered):
    from deployments.topology import stage_options
    service = yaml.safe_load(rendered["kuberay/rayservice.yaml"])
    serve_cfg = yaml.safe_load(service["spec"]["serveConfigV2"])
    embedded = load_graph_config(serve_cfg["applications"][0]["args"])
    assert embedded == load_graph_config(ROOT / GRAPH)              # one source of truth
    assert serve_cfg["applications"][0]["runtime_env"]["working_dir"].endswith(".zip")

    spec = load_cluster_spec(ROOT / CLUSTER)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster == yaml.safe_load(rendered["kuberay/raycluster.yaml"])["spec"]
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head["rayStartParams"]["num-cpus"] == "0"
    text = "\n".join(rendered.values())
    assert "LoadBalancer" not in text and "NodePort" not in text    # cluster network only
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {g.name for g in spec.groups} == {"rollout", "encoder", "media",
                                                           "learner"}
    for g in spec.groups:
        k8s = groups[g.name]
        limits = k8s["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert k8s["labels"] == {LABEL_KEY: g.role}
        assert k8s["rayStartParams"]["num-gpus"] == limits["nvidia.com/gpu"] == str(g.gpus)
        assert k8s["rayStartParams"]["num-cpus"] == limits["cpu"] == str(g.cpus)
        assert k8s["maxReplicas"] == g.max_replicas

    # each stage's Serve options select an existing group, and one replica fits a node of it
    options = stage_options(embedded)
    roles = {g.role: g for g in spec.groups}
    for name, (field, opts) in options.items():
        selector = (opts.get("placement_group_bundle_label_selector") or
                    [opts["ray_actor_options"].get("label_selector", {})])[0]
        group = roles[selector[LABEL_KEY]]
        if opts.get("placement_group_bundles"):           # ETP: the whole group on one node
            gpus = sum(b.get("GPU", 0) for b in opts["placement_group_bundles"])
            assert opts["placement_group_strategy"] == "STRICT_PACK"
            assert gpus == embedded.encoder.etp <= group.gpus
        else:
            assert opts["ray_actor_options"]["num_gpus"] <= group.gpus, name
    # ... and every stage at its maximum replica count fits the groups at theirs
    placed = check_cluster(embedded, spec)
    rollout_nodes = [n for n in placed if n.startswith("rollout-")]
    assert sum(placed[n].count("DiTRollout") for n in rollout_nodes) == \
        max_replicas(options["DiTRollout"][1]) == 10
    assert placed["head"] == ["PolicyStore"] and placed["learner-0"] == []

    launcher = yaml.safe_load(rendered["ray-up.yaml"])
    rules = launcher["provider"]["security_group"]["IpPermissions"]
    assert [r["IpRanges"] for r in rules] == [[{"CidrIp": spec.cluster_cidr}]]
    for g in spec.groups:
        node_type = launcher["available_node_types"][g.name]
        assert node_type["labels"] == {LABEL_KEY: g.role}
        assert node_type["resources"]["GPU"] == g.gpus


def test_groups_too_small_for_the_maximum_replicas_are_refused():
    spec = load_cluster_spec(ROOT / CLUSTER)
    small = spec.model_copy(update={"groups": tuple(
        g.model_copy(update={"replicas": 4, "max_replicas": 4}) if g.role == "rollout" else g
        for g in spec.groups)})
    with pytest.raises(ConfigError) as e:
        check_cluster(load_graph_config(ROOT / GRAPH), small)
    assert e.value.field == "rollout_stage.resources" and "DiTRollout" in e.value.message


def test_placement_errors_name_the_stage_and_the_resource():
    nodes = [NodeShape("gpu-0", {"CPU": 64.0, "GPU": 8.0}, {LABEL_KEY: "encoder"}),
             NodeShape("gpu-1", {"CPU": 64.0, "GPU": 8.0, "fast_nvme": 1.0},
                       {LABEL_KEY: "rollout"})]
    etp16 = StageDemand("encoder", "TextEncoder", ({"CPU": 1.0},) + ({"CPU": 1.0, "GPU": 1.0},) * 16,
                        {LABEL_KEY: "encoder"})
    with pytest.raises(ConfigError) as e:           # an ETP group larger than any node's GPUs
        check_placement([etp16], nodes)
    assert e.value.field == "encoder.resources.GPU"
    assert e.value.expected == 16.0 and e.value.actual == 8.0
    assert "STRICT_PACK" in e.value.message and "TextEncoder" in e.value.message
    nvme_on_encoder = StageDemand("rollout_stage", "DiTRollout", ({"CPU": 1.0, "fast_nvme": 0.1},),
                                  {LABEL_KEY: "encoder"})
    with pytest.raises(ConfigError) as e:           # the resource exists, not on that group
        check_placement([nvme_on_encoder], nodes)
    assert e.value.field == "rollout_stage.resources.fast_nvme"
    with pytest.raises(ConfigError) as e:
        check_placement([StageDemand("decoder", "Decoder_x", ({"CPU": 1.0},),
                                     {LABEL_KEY: "in(media, scoring)"})], nodes)
    assert e.value.field == "decoder.node_labels"
    check_placement([StageDemand("decoder", "Decoder_x", ({"GPU": 1.0},),
                                 {LABEL_KEY: "!encoder"})], nodes)       # fits gpu-1
    with pytest.raises(ConfigError) as e:
        pack_first_fit([(StageDemand("decoder", "Decoder_x", ({"GPU": 3.0},)), 6)], nodes)
    assert e.value.field == "decoder.resources"


def test_label_selectors_follow_rays_grammar():
    labels = {LABEL_KEY: "rollout", "zone": "a"}
    assert labels_match({LABEL_KEY: "rollout"}, labels)
    assert labels_match({LABEL_KEY: "in(rollout, media)"}, labels)
    assert not labels_match({LABEL_KEY: "!in(rollout, media)"}, labels)
    assert labels_match({"spot": "!true"}, labels)          # '!' holds when the key is absent
    assert not labels_match({"spot": "true"}, labels)
    assert parse_selector_value("!in(a,b)") == (True, frozenset({"a", "b"}))
    for bad in ("in()", "-x", "!!x", "in(a,"):
        with pytest.raises(ConfigError):
            parse_selector_value(bad)


def test_stage_placement_fields_are_validated_and_mapped():
    base = {"rollout": {"adapter": "tiny_t2i"}}
    cfg = load_graph_config(dict(base, rollout_stage={"resources": {"rollout_node": 0.01},
                                                      "node_labels": {LABEL_KEY: "rollout"}}))
    actor = cfg.rollout_stage.deployment_options("DiTRollout")["ray_actor_options"]
    assert actor["resources"] == {"rollout_node": 0.01}
    assert actor["label_selector"] == {LABEL_KEY: "rollout"}
    for bad, field in (({"resources": {"GPU": 1}}, "rollout_stage.resources"),
                       ({"resources": {"x": 0}}, "rollout_stage.resources"),
                       ({"node_labels": {LABEL_KEY: "in("}}, "rollout_stage.node_labels")):
        with pytest.raises(ConfigError) as e:
            load_graph_config(dict(base, rollout_stage=bad))
        assert e.value.field == field
    # the ETP encoder: custom resources join bundle 0, the selector applies to every bundle
    from deployments.topology import encoder_options
    enc = load_graph_config(dict(base, encoder={"etp": 2, "resources": {"enc": 0.5},
                                                "node_labels": {LABEL_KEY: "encoder"}}))
    opts = encoder_options(enc)
    assert opts["placement_group_bundles"][0]["enc"] == 0.5
    assert opts["placement_group_bundle_label_selector"] == [{LABEL_KEY: "encoder"}]
    assert "label_selector" not in opts["ray_actor_options"]
    assert node_shapes(load_cluster_spec(ROOT / CLUSTER), at_max=False)[0].name == "head"
