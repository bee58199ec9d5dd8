"""Planning a cluster without the weights: what a family declares comes from the checkpoint's
JSON files where it is on this machine, else from the shipped architecture description the
config names (adapters/architectures); the config check, the planner and the manifest renderer
run on the GPU configs here (no /models), say that the path was not checked, and the stages that
load the weights still refuse the missing path with the typed error."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from adapters.architectures import (ROOT, ConfigOrigin, architecture_root, config_source, declare,
                                    names)
from contract import ConfigError

REPO = Path(__file__).resolve().parent.parent
GPU_EXAMPLE = REPO / "configs" / "gpu_example.yaml"
TRAIN_SD35 = REPO / "configs" / "train_sd35_gpu.yaml"
CLUSTER = REPO / "deploy" / "cluster_t2va_64gpu.yaml"
MISSING = "/models/not-on-this-machine"
# the families and options each description is served with (the real Wan schedulers are UniPC)
FAMILIES = {"sd3.5-medium": ("sd3", {}), "sd3.5-large": ("sd3", {}), "flux.1-dev": ("flux", {}),
            "wan2.1-t2v-14b": ("wan", {"unipc": "flow_euler"}),
            "wan2.2-t2v-a14b": ("wan", {"unipc": "flow_euler"}), "ltx-2": ("ltx2", {}),
            "qwen-image": ("qwen_image", {}), "minimax-h3": ("minimax_h3", {})}


def test_every_shipped_description_declares_its_family():
    assert set(names()) == set(FAMILIES)
    for arch, (family, options) in FAMILIES.items():
        declared = declare("auto", MISSING, options, arch)
        assert declared.family == family and declared.source.origin is ConfigOrigin.ARCHITECTURE
        assert MISSING in declared.source.note and "not checked here" in declared.source.note
        spec = declared.spec
        for component in (*spec.transformers, *(c for cs in spec.decoders.values() for c in cs),
                          *(e.component for e in spec.encoders)):
            assert declared.component_config(component), (arch, component)
    wan22 = declare("wan", MISSING, FAMILIES["wan2.2-t2v-a14b"][1], "wan2.2-t2v-a14b")
    assert wan22.spec.transformers == ("transformer", "transformer_2")
    ltx2 = declare("ltx2", MISSING, {}, "ltx-2")
    assert dict(ltx2.spec.decoders) == {"video_latent": ("vae",),
                                        "audio_latent": ("audio_vae", "vocoder")}
    # Qwen-Image checks its template split against the tokenizer where one is first loaded: a
    # description ships none, so it declares, and tokenizing from it is the typed error
    from adapters.registry import get_family
    qwen = get_family("qwen_image", str(architecture_root("qwen-image")), {})
    with pytest.raises(ConfigError) as e:
        qwen.conditioner.tokenize(["a red cat"])
    assert e.value.field == "weights_path.tokenizer"


def test_sd35_medium_encoders_split_over_the_gpu_examples_etp_4():
    """configs/gpu_example.yaml shards CLIP-L, CLIP-G and T5-XXL over 4 GPUs: every encoder's
    head count in the description divides by 4 (12, 20, 64), as the ETP stage requires."""
    declared = declare("sd3", MISSING, {}, "sd3.5-medium")
    heads = {e.name: declared.component_config(e.component)[e.etp.heads]
             for e in declared.spec.encoders}
    assert heads == {"clip_l": 12, "clip_g": 20, "t5": 64}
    etp = yaml.safe_load(GPU_EXAMPLE.read_text())["applications"][0]["args"]["encoder"]["etp"]
    assert all(h % etp == 0 for h in heads.values())


@pytest.mark.parametrize("arch, component, published", [
    ("flux.1-dev", "transformer", 11.9e9),          # FLUX.1-dev: "12B" (11.9 B)
    ("sd3.5-large", "transformer", 8.1e9),          # SD3.5 Large: 8.1 B
    ("wan2.1-t2v-14b", "transformer", 14.0e9),      # Wan2.1-T2V-14B
    ("ltx-2", "transformer", 19.0e9),               # LTX-2: 19 B (video + audio streams)
    ("qwen-image", "transformer", 20.0e9),          # Qwen-Image: 20 B MMDiT
    ("qwen-image", "text_encoder", 8.29e9),         # Qwen2.5-VL-7B-Instruct: 8.29 B
    ("minimax-h3", "transformer", 33.0e9),          # MiniMax-H3: 33 B DiT
    ("minimax-h3", "text_encoder", 33.0e9),         # Qwen3-VL-32B-Instruct: 33 B
])
def test_descriptions_build_the_published_model_sizes(arch, component, published):
    """The description's config builds (on the meta device, no memory) a transformer (or text
    encoder) of the size its authors publish: the values are the real model's, not a
    look-alike's."""
    import diffusers
    import transformers
    from accelerate import init_empty_weights
    index = json.loads((architecture_root(arch) / "model_index.json").read_text())
    library, name = index[component]
    folder = architecture_root(arch) / component
    with init_empty_weights():
        if library == "transformers":
            cls = getattr(transformers, name)
            model = cls(cls.config_class.from_pretrained(folder))
        else:
            cls = getattr(diffusers, name)
            model = cls.from_config(cls.load_config(folder))
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(published, rel=0.03), params


def test_a_checkpoint_here_is_read_and_checked_against_the_description(tmp_path):
    ckpt = tmp_path / "sd35"
    shutil.copytree(architecture_root("sd3.5-medium"), ckpt)
    source = config_source(str(ckpt), "sd3.5-medium")
    assert source.origin is ConfigOrigin.CHECKPOINT and source.root == ckpt and not source.note
    # the checkpoint's own files win: a transformer of another depth is not SD3.5-medium
    config = json.loads((ckpt / "transformer" / "config.json").read_text())
    (ckpt / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": 12}))
    with pytest.raises(ConfigError) as e:
        config_source(str(ckpt), "sd3.5-medium")
    assert e.value.field == "rollout.architecture" and "num_layers" in str(e.value)
    # without an architecture the checkpoint is simply read
    assert declare("sd3", str(ckpt)).source.origin is ConfigOrigin.CHECKPOINT


def test_bad_architecture_inputs_are_typed():
    with pytest.raises(ConfigError) as e:
        declare("sd3", MISSING, {}, "sd9")
    assert e.value.field == "rollout.architecture" and e.value.actual == "sd9"
    assert set(e.value.expected) == set(names())
    with pytest.raises(ConfigError) as e:              # not here, nothing describes it
        declare("sd3", MISSING, {})
    assert e.value.field == "weights_path" and "rollout.architecture" in e.value.message
    with pytest.raises(ConfigError) as e:              # a description of which checkpoint?
        declare("sd3", None, {}, "sd3.5-medium")
    assert e.value.field == "rollout.weights_path"
    with pytest.raises(ConfigError) as e:              # the description is not this family's
        declare("flux", MISSING, {}, "sd3.5-medium")
    assert e.value.field == "weights_path"


def test_the_stage_that_loads_the_weights_refuses_the_missing_path():
    """The graph builds from the description; on a node without the path the stage that loads
    the weights (here the decoder, built in-process as its replica would) raises the same
    typed error the checkpoint reader raises."""
    from deployments.config import load_graph_config
    from deployments.decoder import DecoderServer
    from deployments.topology import stage_options
    from graph import build_app
    config = load_graph_config(GPU_EXAMPLE)
    assert not Path(config.weights_path).exists()
    build_app(config)
    assert "Decoder_image_latent" in stage_options(config)
    with pytest.raises(ConfigError) as e:
        DecoderServer(config.adapter, config.weights_path, "image_latent", 4096, "cpu",
                      "float32", config.adapter_options)
    assert e.value.field == "weights_path" and e.value.actual == config.weights_path


def test_config_check_plan_and_manifests_run_without_the_weights(tmp_path, capsys):
    from bench.plan import main as plan
    from deployments.manifests import main as manifests
    from graph import main as check
    from trainer.__main__ import main as trainer
    assert check([str(GPU_EXAMPLE)]) == 0
    assert "not checked here" in capsys.readouterr().out
    trainer(["--config", str(TRAIN_SD35), "--check"])
    assert "not checked here" in capsys.readouterr().out
    for config, batch in ((GPU_EXAMPLE, 64), (TRAIN_SD35, 256)):
        assert plan(["--config", str(config), "--gpus", "64", "--learner-gpus", "auto",
                     "--out", str(tmp_path / config.stem)]) == 0
        out = capsys.readouterr().out
        assert "not checked here" in out and f"trainer step ({batch} samples)" in out
        assert json.loads((tmp_path / config.stem / "plan.json").read_text())["trainer"][
            "learner_devices"] > 0
    for config in (GPU_EXAMPLE, TRAIN_SD35):
        out_dir = tmp_path / f"deploy-{config.stem}"
        assert manifests(["--graph", str(config), "--cluster", str(CLUSTER),
                          "--out", str(out_dir)]) == 0
        assert "not checked here" in capsys.readouterr().out
        _check_rayservice(out_dir / "kuberay" / "rayservice.yaml", config)


def _check_rayservice(path: Path, config: Path) -> None:
    """As tests/test_manifests.py: the embedded Serve config is the graph config, each stage's
    Serve options fit a node of the group it selects, every stage at its maximum fits."""
    from deployments.config import load_graph_config
    from deployments.manifests import check_cluster, load_cluster_spec, max_replicas
    from deployments.topology import stage_options
    from trainer.config import load_trainer_config
    graph = load_trainer_config(config).graph_config() if config == TRAIN_SD35 else \
        load_graph_config(config)
    service = yaml.safe_load(path.read_text())
    serve_cfg = yaml.safe_load(service["spec"]["serveConfigV2"])
    embedded = load_graph_config(serve_cfg["applications"][0]["args"])
    assert embedded == graph and embedded.rollout.architecture == "sd3.5-medium"
    spec = load_cluster_spec(CLUSTER)
    cluster = service["spec"]["rayClusterConfig"]
    assert {g["groupName"] for g in cluster["workerGroupSpecs"]} == {g.name for g in spec.groups}
    options = stage_options(embedded)
    assert "Decoder_image_latent" in options
    for name, (_, opts) in options.items():
        if opts.get("placement_group_bundles"):        # ETP: the whole group on one node
            gpus = sum(b.get("GPU", 0) for b in opts["placement_group_bundles"])
            assert opts["placement_group_strategy"] == "STRICT_PACK"
            assert gpus == embedded.encoder.etp * embedded.encoder.num_gpus_per_shard
            assert any(gpus <= g.gpus for g in spec.groups), name
        else:
            assert any(opts["ray_actor_options"]["num_gpus"] <= g.gpus for g in spec.groups)
    placed = check_cluster(embedded, spec)
    assert sum(stages.count("DiTRollout") for stages in placed.values()) == \
        max_replicas(options["DiTRollout"][1])


def test_descriptions_ship_as_package_data():
    text = (REPO / "pyproject.toml").read_text()
    assert '"architectures/**/*.json"' in text
    assert all((ROOT / n / "model_index.json").is_file() for n in names())
