"""Trainer configuration: one pydantic model per concern, unknown fields forbidden.

    cfg = load_trainer_config("configs/train_tiny_t2i.yaml")
    cfg.graph_config()          # the rollout graph (a Serve YAML path or an inline GraphConfig)

Per-algorithm knobs live in their own sub-model (NFT `beta` is the guidance strength, not a KL
coefficient; the KL coefficients are `ref_kl_coef` / `kl_beta`).
"""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contract import (Algorithm, BranchSpec, ConfigError, InvalidRequestError, RolloutError,
                      SamplerKind, Task, check_branch)
from contract.request import MIN_NOISE_LEVEL, resolve_window
from deployments.config import GraphConfig, config_error, load_graph_config, read_yaml
from diffusion.windows import flash_post_points, sliding_sde_window, sliding_window_exhausted
from trainer.algorithms import (AWMWeighting, KLTarget, OldLogProbs, OldPolicySchedule,
                                PolicyRatio, StdScope, TimestepOrder, TreeAdvantage)
from trainer.algorithms.advantages import AdvantageMode, ZeroAdvantageRule
from trainer.datasets import DatasetFormat
from trainer.learner_config import LearnerConfig, check_recipe
from trainer.lora import LoRATrainConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class PipelineMode(str, Enum):
    SERIAL = "serial"    # rollout k, then train k, then rollout k+1
    ASYNC = "async"      # rollout k+1 is in flight while step k trains (bounded staleness)


class PromptSource(str, Enum):
    """Where training / held-out prompts come from (synthetic, verifiable)."""

    SHAPES = "shapes"    # synthetic/shapes.py captions, train / eval splits
    CLIPS = "clips"      # synthetic/clips.py captions, disjoint seed ranges


class SlidingWindow(Model):
    """MixGRPO: one SDE window for every prompt of an optimizer step, ODE outside it, sliding
    from the first step by `stride` every `shift_every` steps (diffusion.sliding_sde_window)."""

    size: int = Field(4, ge=1, description="SDE steps in the window (MixGRPO's group_size).")
    shift_every: int = Field(25, ge=1, description="Optimizer steps before the window moves "
                             "(MixGRPO's iters_per_group).")
    stride: int | None = Field(None, ge=1, description="Steps the window moves; None = size "
                               "(no overlap; MixGRPO's prog_overlap_step when overlapping).")
    roll_back: bool = Field(False, description="Past the last trainable step, start again at "
                            "step 0 (false: the run may not outlast the window).")


class SamplerSettings(Model):
    """How rollouts are sampled (SamplingSpec fields the trainer chooses)."""

    sampler: SamplerKind = SamplerKind.SDE
    num_steps: int = Field(10, ge=2)
    noise_level: float = Field(0.7, ge=0.0, le=2.0)
    window: tuple[int, int] | None = Field(
        None, description="[start, end) SDE steps; None = all but the last step.")
    window_size: int | None = Field(
        None, ge=1, description="Flow-GRPO-Fast: an SDE window of this many steps at a random "
        "start per prompt group (ODE elsewhere; only those steps are trained).")
    window_range: tuple[int, int] | None = Field(
        None, description="[lo, hi) the random windows lie in; None = (0, num_steps // 2).")
    sliding_window: SlidingWindow | None = Field(
        None, description="MixGRPO's sliding SDE window (one per optimizer step); exclusive "
        "with window and window_size.")
    flash_compress: float | None = Field(
        None, gt=0.0, le=1.0, description="MixGRPO-Flash: after the SDE window, DPM-Solver++(2M) "
        "on a schedule compressed to this share of the remaining points (MixGRPO's "
        "dpm_post_compress_ratio, 0.4 in its Flash recipe); None = ODE after the window.")
    guidance_scale: float = Field(1.0, ge=0.0)
    height: int | None = Field(None, ge=8, description="None = the adapter's sampling default.")
    width: int | None = Field(None, ge=8, description="None = the adapter's sampling default.")
    num_frames: int | None = Field(None, ge=1, description="None = the adapter's default.")

    def media_shape(self, adapter_defaults: dict[str, int]) -> dict[str, int]:
        """height / width / num_frames of every request: these settings over the adapter's."""
        out = {k: v for k, v in adapter_defaults.items() if k in ("height", "width", "num_frames")}
        for key in ("height", "width", "num_frames"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @model_validator(mode="after")
    def _check(self) -> "SamplerSettings":
        least = MIN_NOISE_LEVEL.get(self.sampler, 0.0)
        if 0.0 < self.noise_level < least:
            raise ValueError(f"noise_level {self.noise_level!r} is below the {self.sampler.value} "
                             f"sampler's minimum {least} (float32 cannot carry its steps' noise)")
        if self.window is not None and not 0 <= self.window[0] < self.window[1] <= self.num_steps:
            raise ValueError(f"window {self.window} must satisfy 0 <= start < end <= "
                             f"num_steps={self.num_steps}")
        if self.window_size is not None:
            if self.window is not None:
                raise ValueError("give either a fixed window or window_size (random windows)")
            lo, hi = self.random_window_range
            if not 0 <= lo < hi <= self.num_steps - 1 or hi - lo < self.window_size:
                raise ValueError(f"window_range {(lo, hi)} must hold window_size="
                                 f"{self.window_size} steps within 0..num_steps-1="
                                 f"{self.num_steps - 1} (the step into sigma 0 is not trained)")
        elif self.window_range is not None:
            raise ValueError("window_range needs window_size")
        if self.sliding_window is not None:
            if self.window is not None or self.window_size is not None:
                raise ValueError("give one of window, window_size, sliding_window")
            w = self.sliding_window
            try:
                sliding_sde_window(0, self.num_steps, w.size, w.shift_every, w.stride,
                                   w.roll_back)
            except InvalidRequestError as exc:
                raise ValueError(f"sliding_window.{exc.field}={exc.actual!r} at num_steps="
                                 f"{self.num_steps}: {exc}") from None
        return self

    @property
    def random_window_range(self) -> tuple[int, int]:
        return self.window_range or (0, self.num_steps // 2)


class OptimizerConfig(Model):
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(1e-4, ge=0)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)


class NFTConfig(Model):
    beta: float = Field(1.0, gt=0, description="Guidance strength of the implicit policies.")
    adv_clip_max: float = Field(5.0, gt=0)
    adv_mode: AdvantageMode = AdvantageMode.CONTINUOUS
    ref_kl_coef: float = Field(1e-4, ge=0, description="Velocity KL to the base model.")
    old_refresh_every: int = Field(2, ge=1, description="Optimizer steps between old refreshes.")
    decay: OldPolicySchedule = OldPolicySchedule.LINEAR_TO_0_5
    train_timesteps: int = Field(4, ge=1, description="Random noise levels per sample per step.")
    timesteps: TimestepOrder = Field(
        TimestepOrder.UNIFORM, description="uniform: i.i.d. schedule steps; permutation: a "
        "per-sample permutation of the rollout's steps, no repeats (the NFT reference).")


class FlowGRPOConfig(Model):
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    kl_beta: float = Field(0.0, ge=0)
    kl_target: KLTarget = KLTarget.SDE_MEAN
    max_train_steps: int | None = Field(None, ge=1, description="Window steps trained (first n).")
    old_log_probs: OldLogProbs = Field(
        OldLogProbs.ROLLOUT, description="rollout: rows the learner's old policy sampled keep "
        "their stored rollout log-probs, others are recomputed; recompute: every row's old "
        "log-prob is recomputed by the learner (one extra forward per trained step).")
    ratio: PolicyRatio = Field(
        PolicyRatio.FLOW_GRPO, description="flow_grpo: exp(log p - log p_old); grpo_guard: "
        "GRPO-Guard's ratio, normalised by the step's std with the drift of the transition mean "
        "added (one extra no-grad forward per trained step for the old policy's mean).")
    tree_advantage: TreeAdvantage = Field(
        TreeAdvantage.BRANCH_DEPTHWISE, description="Branched rollouts (rows forked mid-denoise, "
        "updates.plan_tree_update): branch_depthwise = BranchGRPO's per-depth z-scores of "
        "leaf-mean node rewards; tree_backprop = TreeGRPO's leaf z-scores averaged up the tree.")
    branch: BranchSpec | None = Field(
        None, description="Tree GRPO: every training request is a branch rollout (fork_steps, "
        "factor; contract.BranchSpec, bounded by the graph's limits) and each step trains with "
        "the advantage of the node it enters (tree_advantage); None = independent rows.")
    guard_reweight: bool = Field(
        True, description="grpo_guard: divide each step's loss by sigma - sigma_next (verl-omni; "
        "false: Flow-Factory's unweighted loss). Only with ratio: grpo_guard.")

    @model_validator(mode="after")
    def _check(self) -> "FlowGRPOConfig":
        if self.ratio is not PolicyRatio.GRPO_GUARD and not self.guard_reweight:
            raise ValueError(f"guard_reweight=False applies only to ratio: grpo_guard, not "
                             f"ratio: {self.ratio.value}")
        return self


class AWMConfig(Model):
    """Advantage-weighted matching (trainer/algorithms/awm.py): per row, train_timesteps draws
    (sigma from the rollout's schedule, fresh eps) of the flow-matching error as the log-prob in
    FlowGRPO's clipped surrogate; the old policy is the pre-step weights (Flow-Factory's
    AWMTrainer: discrete timesteps, clip 1e-4, advantages clipped to 5, velocity KL)."""

    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    weighting: AWMWeighting = AWMWeighting.UNIFORM
    ghuber_power: float = Field(0.25, gt=0, description="weighting: ghuber only.")
    kl_beta: float = Field(0.0, ge=0, description="Velocity KL to the base model.")
    train_timesteps: int = Field(4, ge=1, description="Draws per row per step.")
    timesteps: TimestepOrder = Field(
        TimestepOrder.PERMUTATION, description="permutation: distinct schedule steps per row "
        "(Flow-Factory's discrete sampling); uniform: i.i.d. steps.")

    @model_validator(mode="after")
    def _check(self) -> "AWMConfig":
        if self.weighting is not AWMWeighting.GHUBER and \
                self.ghuber_power != AWMConfig.model_fields["ghuber_power"].default:
            raise ValueError(f"ghuber_power applies only to weighting: ghuber, not weighting: "
                             f"{self.weighting.value}")
        return self


class DPOConfig(Model):
    beta: float = Field(100.0, gt=0)
    draws_per_pair: int = Field(4, ge=1, description="(sigma, eps) draws per pair per step.")


class PipelineConfig(Model):
    mode: PipelineMode = PipelineMode.ASYNC
    max_staleness: int = Field(1, ge=0, description="Sampling-policy versions a batch may lag.")
    expected_step_s: float = Field(
        120.0, gt=0, description="Wall seconds one training step is expected to take (rollouts, "
        "update, publish). A batch's outputs wait in the graph's ObjectHolder until the trainer "
        "collects them, up to about (1 + max_staleness) steps: the graph's objects.ttl_s must be "
        "at least HOLD_MARGIN times that (checked at start-up, `check_holder_ttl`).")

    @model_validator(mode="after")
    def _check(self) -> "PipelineConfig":
        if self.mode is PipelineMode.ASYNC and self.max_staleness < 1:
            raise ValueError("async pipelining samples the next batch with the previous policy: "
                             "max_staleness must be >= 1")
        return self


class AdvantageConfig(Model):
    """Rewards -> advantages (FlowGRPO, DiffusionNFT; DPO uses best/worst pairs)."""

    std: StdScope = Field(StdScope.GLOBAL, description="global: std of the whole batch; group: "
                          "of the prompt group")
    ddof: int = Field(0, ge=0, le=1, description="0: population std (the recipes); 1: sample std")
    eps: float = Field(1e-4, gt=0)
    per_reward: bool = Field(False, description="GDPO: normalise each reward within its group, "
                             "combine with the reward weights, normalise over the batch")
    streams: dict[str, list[str]] | None = Field(
        None, description="Per-modality advantages (OmniNFT-style, nft only): latent stream "
        "(e.g. video_latent, audio_latent) -> the scorers that judge it; each stream's entries "
        "train with the advantage of its own weighted reward (trainer/algorithms/modality.py).")
    zero_advantage: ZeroAdvantageRule | None = Field(
        None, description="rows with advantage 0 left out of the update: keep (none), rows "
        "(each), groups (of all-zero groups); None = the algorithm's reference code: nft keep "
        "(DiffusionNFT trains every row), flow_grpo rows (flow_grpo). Not for dpo.")


class EMAConfig(Model):
    """EMA of the trained adapter; when enabled, evaluation samples with it."""

    enabled: bool = False
    decay: float = Field(0.9, ge=0.0, lt=1.0)
    every: int = Field(1, ge=1, description="Optimizer steps between EMA updates: after step s "
                       "(1 = the first) when (s + 1) % every == 0, as flow_grpo / DiffusionNFT.")
    warmup: bool = Field(True, description="decay_s = min(decay, (1 + s) / (10 + s)) after "
                         "optimizer step s (flow_grpo's and DiffusionNFT's EMA); false: decay")


class PromptFiles(Model):
    """Prompt files (trainer/datasets.py formats), repo-relative or absolute paths."""

    train: str
    test: str | None = Field(None, description="Held-out prompts for evaluation; None = the "
                             "first eval.num_prompts of the training file (not held out).")
    format: DatasetFormat = DatasetFormat.AUTO
    shuffle: bool = Field(True, description="Reshuffle every epoch (seeded by `seed`).")


class WandbConfig(Model):
    """Weights & Biases beside TensorBoard; offline writes a local run (`wandb sync` later)."""

    enabled: bool = False
    mode: str = Field("offline", pattern="^(offline|online)$")
    project: str = "omni-rollout"
    name: str | None = Field(None, description="Run name; None = the run folder's name.")
    media_every: int = Field(1, ge=1, description="Log gallery media every N evaluations.")


class EvalConfig(Model):
    every: int = Field(5, ge=1, description="Evaluate every N steps (and at step 0 and the end).")
    num_prompts: int = Field(8, ge=1)
    samples_per_prompt: int = Field(2, ge=1)
    num_steps: int = Field(10, ge=1, description="ODE steps of the held-out evaluation.")
    seed: int = 10_000


class ChecksConfig(Model):
    time_convention: bool = True
    lora_map: bool = True
    token_ids: bool = True
    lora_map_atol: float = Field(1e-4, gt=0)
    logprob_ratio_tol: float = Field(1e-4, gt=0, description="|ratio - 1| at version parity.")
    logprob_parity_every: int = Field(
        1, ge=1, description="Run the log-prob parity check (learner vs rollout at the sampled "
        "version; a mismatch over logprob_ratio_tol fails the run) every N steps.")


class TrainerConfig(Model):
    graph: str | GraphConfig = Field("configs/tiny_t2i.yaml",
                                     description="Serve YAML path (repo-relative) or inline.")
    algorithm: Algorithm = Algorithm.NFT
    prompts: PromptSource = PromptSource.SHAPES
    task: Task | None = Field(None, description="The task requested; None = the family's first "
                              "(a conditioned task, e.g. fl2va, takes its condition media from "
                              "the prompt files).")
    data: PromptFiles | None = Field(None, description="Prompt files; None = the synthetic "
                                     "`prompts` source (which the start-up probe always uses).")
    steps: int = Field(50, ge=1)
    prompts_per_step: int = Field(4, ge=1)
    samples_per_prompt: int = Field(4, ge=2, description="Group size.")
    sampler: SamplerSettings = Field(default_factory=SamplerSettings)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lora: LoRATrainConfig = Field(default_factory=LoRATrainConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    nft: NFTConfig = Field(default_factory=NFTConfig)
    flow_grpo: FlowGRPOConfig = Field(default_factory=FlowGRPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    awm: AWMConfig = Field(default_factory=AWMConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    run_dir: str = "runs/train"
    seed: int = 0
    checkpoint_every: int = Field(10, ge=1)
    resume: bool = False
    gallery: bool = True

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.algorithm is Algorithm.FLOW_GRPO and self.sampler.sampler in (SamplerKind.ODE,
                                                                              SamplerKind.DPM2):
            raise ValueError("flow_grpo trains on SDE transition log-probs: sampler must not "
                             f"be deterministic ('{self.sampler.sampler.value}')")
        if self.nft.timesteps is TimestepOrder.PERMUTATION and \
                self.nft.train_timesteps > self.sampler.num_steps:
            raise ValueError(f"nft.train_timesteps={self.nft.train_timesteps} exceeds the "
                             f"{self.sampler.num_steps} rollout steps a permutation can visit")
        if self.algorithm is Algorithm.AWM and self.awm.timesteps is TimestepOrder.PERMUTATION \
                and self.awm.train_timesteps > self.sampler.num_steps:
            raise ValueError(f"awm.train_timesteps={self.awm.train_timesteps} exceeds the "
                             f"{self.sampler.num_steps} rollout steps a permutation can visit")
        if self.flow_grpo.ratio is PolicyRatio.GRPO_GUARD and \
                self.algorithm is not Algorithm.FLOW_GRPO:
            raise ValueError("flow_grpo.ratio=grpo_guard is FlowGRPO's ratio: algorithm must be "
                             f"flow_grpo, not {self.algorithm.value}")
        a = self.advantage
        if a.streams is not None and (self.algorithm is not Algorithm.NFT or a.per_reward or
                                      a.zero_advantage not in (None, ZeroAdvantageRule.KEEP)):
            raise ValueError("advantage.streams (per-modality advantages) trains every row of "
                             f"nft with its streams' own rewards: algorithm={self.algorithm.value}"
                             f", per_reward={a.per_reward}, zero_advantage="
                             f"{a.zero_advantage and a.zero_advantage.value} do not combine")
        if self.algorithm is Algorithm.DPO and self.advantage.zero_advantage is not None:
            raise ValueError("advantage.zero_advantage does not apply to dpo: it trains one "
                             "(best, worst) pair per group and a tied group has none")
        self._check_flash()
        self._check_branch()
        w = self.sampler.sliding_window
        if w is not None:
            empty = sliding_window_exhausted(self.sampler.num_steps, w.size, w.shift_every,
                                             w.stride, w.roll_back)
            if empty is not None and empty < self.steps:
                raise ValueError(f"sampler.sliding_window has no step left at optimizer step "
                                 f"{empty} of steps={self.steps}: set roll_back, a larger "
                                 f"shift_every or fewer steps")
        check_recipe(self)
        return self

    def _check_branch(self) -> None:
        """Tree GRPO: flow_grpo on one fixed SDE window, every fork step inside it."""
        branch, s = self.flow_grpo.branch, self.sampler
        if branch is None:
            return
        if self.algorithm is not Algorithm.FLOW_GRPO:
            raise ValueError("flow_grpo.branch (Tree GRPO) trains flow_grpo's per-node "
                             f"advantages: algorithm must be flow_grpo, not {self.algorithm.value}")
        if s.window_size is not None or s.sliding_window is not None:
            raise ValueError("flow_grpo.branch forks inside one fixed SDE window: give "
                             "sampler.window (or none), not window_size / sliding_window")
        window = resolve_window(s.sampler, s.num_steps, s.window)
        for i, step in enumerate(branch.fork_steps):
            if not step < window[1]:
                raise ValueError(f"flow_grpo.branch.fork_steps[{i}]={step} must lie before the "
                                 f"SDE window's end {window[1]} (window {window}, num_steps="
                                 f"{s.num_steps}): its children would be identical")

    def _check_flash(self) -> None:
        """Every SDE window the run samples must leave MixGRPO-Flash >= 2 points after it."""
        s = self.sampler
        if s.flash_compress is None:
            return
        if s.sampler in (SamplerKind.ODE, SamplerKind.DPM2):
            raise ValueError(f"sampler.flash_compress follows an SDE window: the "
                             f"{s.sampler.value} sampler has none")
        if s.sliding_window is not None:
            w = s.sliding_window
            ends = set()
            for step in range(self.steps):
                try:
                    ends.add(sliding_sde_window(step, s.num_steps, w.size, w.shift_every,
                                                w.stride, w.roll_back)[1])
                except InvalidRequestError:
                    break                       # an exhausted window is refused below
        elif s.window_size is not None:
            lo, hi = s.random_window_range
            ends = set(range(lo + s.window_size, hi + 1))
        else:
            ends = {(s.window or (0, s.num_steps - 1))[1]}
        for end in sorted(ends):
            try:
                flash_post_points(s.num_steps, end, s.flash_compress)
            except InvalidRequestError as exc:
                raise ValueError(f"sampler.flash_compress={s.flash_compress} with an SDE window "
                                 f"ending at step {end} of num_steps={s.num_steps}: "
                                 f"{exc.message}") from None

    def graph_config(self) -> GraphConfig:
        if isinstance(self.graph, GraphConfig):
            return self.graph
        path = Path(self.graph)
        if not path.is_absolute() and not path.exists():
            path = REPO_ROOT / path
        if not path.is_file():
            raise ConfigError("graph config file not found", field="graph",
                              expected="a Serve YAML path", actual=self.graph)
        return load_graph_config(path)


def load_trainer_config(source: str | Path | dict[str, Any],
                        overrides: dict[str, Any] | None = None) -> TrainerConfig:
    """YAML path or dict -> TrainerConfig, `overrides` ({dotted key: value}, the CLI's --set)
    applied on top; every error is a ConfigError naming the field or the file."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file() and (REPO_ROOT / path).is_file():
            path = REPO_ROOT / path
        data = read_yaml(path)
        data = {} if data is None else data
    else:
        data = source
    if not isinstance(data, dict):
        raise ConfigError("a trainer config is a mapping of fields", field="config",
                          expected="mapping", actual=type(data).__name__)
    data = dict(data)
    graph = data.get("graph", TrainerConfig.model_fields["graph"].default)
    if isinstance(graph, (str, Path)) and any(k.startswith("graph.") for k in overrides or {}):
        data["graph"] = _graph_fields(graph)        # `graph.*` overrides reach into the YAML
    for dotted, value in (overrides or {}).items():
        _override(data, dotted, value)
    try:
        return TrainerConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, "invalid trainer config") from exc


def _graph_fields(graph: str | Path) -> dict[str, Any]:
    """The fields of a graph YAML named by path (repo-relative or absolute)."""
    path = Path(graph)
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    return load_graph_config(path).model_dump()


def _override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data[a][b][c] = value for dotted 'a.b.c' (sections are copied, never shared)."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError("an override key is dotted field names", field=dotted or "--set",
                          expected="e.g. pipeline.mode", actual=dotted)
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted}: {'.'.join(keys[:depth + 1])} is not a "
                              "section", field=dotted, actual=type(child).__name__)
        node[key] = child = dict(child)
        node = child
    node[keys[-1]] = value


def check_group_sizes(cfg: "TrainerConfig", graph: GraphConfig) -> None:
    """A groupwise scorer (rewards/groupwise.py) compares each sample with its prompt group, so
    every request the trainer sends needs two or more samples: the training groups have them
    (samples_per_prompt >= 2), evaluation must too. A ConfigError naming the field."""
    branch = cfg.flow_grpo.branch
    if branch is not None:          # the graph's limits, as every request of the run meets them
        s = cfg.sampler
        try:
            check_branch(branch, s.num_steps, resolve_window(s.sampler, s.num_steps, s.window),
                         cfg.samples_per_prompt, graph.limits)
        except RolloutError as exc:
            raise ConfigError(f"flow_grpo.branch against the graph's limits: {exc.message}",
                              field=f"flow_grpo.{exc.field}", expected=exc.expected,
                              actual=exc.actual) from None
    groupwise = [s.name for s in graph.scorers if s.scorer.groupwise]
    if groupwise and cfg.eval.samples_per_prompt < 2:
        raise ConfigError(f"groupwise scorers {groupwise} compare the samples of a prompt "
                          "group: evaluation needs two or more per prompt",
                          field="eval.samples_per_prompt", expected=">= 2",
                          actual=cfg.eval.samples_per_prompt)


HOLD_MARGIN = 2.0     # the holder's TTL over the longest a batch's outputs wait to be collected


def check_holder_ttl(cfg: "TrainerConfig", graph: GraphConfig) -> None:
    """The graph's ObjectHolder must keep a batch's outputs until the trainer collects them:
    objects.ttl_s >= HOLD_MARGIN * (1 + max_staleness) * expected_step_s, else outputs are
    dropped under a trainer still to fetch them. A ConfigError naming the field."""
    waits = (1 + cfg.pipeline.max_staleness) * cfg.pipeline.expected_step_s
    if graph.objects.ttl_s < HOLD_MARGIN * waits:
        raise ConfigError("the graph's object holder would drop rollout outputs before the "
                          f"trainer collects them ({1 + cfg.pipeline.max_staleness} steps of "
                          f"pipeline.expected_step_s={cfg.pipeline.expected_step_s} s, x "
                          f"{HOLD_MARGIN})", field="graph.objects.ttl_s",
                          expected=f">= {HOLD_MARGIN * waits}", actual=graph.objects.ttl_s)
