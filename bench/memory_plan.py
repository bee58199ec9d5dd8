"""Memory plan at real sizes: every process's model bytes from the architecture's own modules,
built on torch's meta device (no memory, no weights) from the configuration values.

    python -m bench.plan --memory configs/train_sd35_gpu.yaml [--architecture NAME|all]
        [--workers 2 4 8] [--etp 1 2 4 8] [--markdown]

Per process, in bytes (GB = 1e9 B):
  encoder shard   the text encoders at each ETP degree: the weights the tensor-parallel plan
                  splits (Linear / Embedding) / etp + the rest (norms) whole; weights in
                  `encoder.dtype`
  rollout         the transformer(s) in `rollout.dtype` (+ the VAE encoder of a task with
                  condition media); activations: one block's live tensors (inference) of the
                  rows one transformer call runs (below) at the sampling size's tokens
  decoder         each latent's decoder components in `decoder.dtype`
  learner         per worker, DDP (LoRA: the whole model and adapter on each) or FSDP2 (full
                  weights: the fp32 masters, their gradients, AdamW's two moments and the
                  frozen old / reference copies sharded over N): parameters, gradients,
                  optimizer state, and activations of `micro_batch_size` rows
  controller      0: the trainer process loads no model beside a worker group
                  (trainer/distributed.py)
Parameters, gradients and optimizer state are exact counts of the built modules; activations
are an ESTIMATE of one pre-norm, AdaLN-modulated block with rotary q / k and its MLP (MiniMax-H3's;
tests/test_memory_plan.py measures the real block's live bytes against it), in units of
tokens x hidden x bytes per row (hidden H: the input width most of the blocks' Linear weights
read; A: the attention width; U: the MLP's up projection output, 2 x ffn when gated):
  inference   the caller's block input + the larger of the attention phase (1 + 6 A / H) and the
              MLP phase (3 + 2 U / H): one block's live tensors, nothing kept across blocks
              (the engine runs under inference_mode)
  training    each block keeps what its backward reads: 10 + 8 A / H + 4 ffn / H (LoRA: frozen
              base weights) or 18 + 12 A / H + 4 ffn / H (full); with gradient checkpointing
              each block keeps only its input (1) and one block is recomputed at a time: its
              kept tensors + backward's own, 3 + 2 ffn / H
Rows: a forward's rows (max_batch_rows, micro_batch_size; doubled under CFG) run through the
transformer at most `rows_per_call` at a time where the family's denoiser declares it
(MiniMax-H3: 1, each row's packed sequence alone), so only that many rows' block tensors are live;
without checkpointing every row's kept tensors live until backward. Fit: the sum against 80 GB
(H100) and 141 GB (H200), no allowance for the CUDA context or fragmentation.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from contract import ConfigError, PolicyKind, SamplingSpec, Task

GPUS = {"80GB": 80e9, "141GB": 141e9}
ARCHITECTURE_FAMILY = {"sd3.5-medium": "sd3", "sd3.5-large": "sd3", "flux.1-dev": "flux",
                       "wan2.1-t2v-14b": "wan", "wan2.2-t2v-a14b": "wan", "ltx-2": "ltx2",
                       "qwen-image": "qwen_image", "minimax-h3": "minimax_h3"}
# adapter options a description needs to build its family (Wan's UniPC table stepped by Euler)
ARCHITECTURE_OPTIONS = {"wan2.1-t2v-14b": {"unipc": "flow_euler"},
                        "wan2.2-t2v-a14b": {"unipc": "flow_euler"}}
CONDITIONED_TASKS = (Task.FL2VA, Task.I2V, Task.I2VA, Task.EDIT)


def dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


# ---- modules on the meta device ---------------------------------------------------------------
def meta_module(root: Path, component: str) -> nn.Module:
    """One checkpoint component built on the meta device from its config (no weights)."""
    from adapters.checkpoint import component_class, read_model_index
    cls = component_class(read_model_index(root), component, root)
    folder = root / component
    with torch.device("meta"):
        if hasattr(cls, "from_config") and hasattr(cls, "load_config"):      # diffusers
            return cls.from_config(cls.load_config(folder))
        config = cls.config_class.from_pretrained(folder)                    # transformers
        return cls(config)


@dataclass(frozen=True)
class ModuleCount:
    """What a built module holds: parameters (elements), the part a tensor-parallel plan
    splits (Linear / Embedding weights), its blocks and widths (hidden, the MLP's inner width
    `ffn` and its up projection's output `up`, 2 x ffn when gated; the attention width)."""

    params: int
    split_params: int
    blocks: int
    hidden: int
    ffn: int
    up: int = 0
    attention: int = 0

    @classmethod
    def of(cls, module: nn.Module) -> "ModuleCount":
        params = sum(p.numel() for p in module.parameters())
        split = sum(p.numel() for p in {id(p): p for m in module.modules()
                                        if isinstance(m, (nn.Linear, nn.Embedding))
                                        for p in m.parameters(recurse=False)}.values())
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)
                 and len(m) > 1 and all(type(c) is type(m[0]) for c in m)]
        outer = [m for m in lists if not any(m is not o and _inside(m, o) for o in lists)]
        blocks = sum(len(m) for m in outer)
        # the hidden size: the input width that most of the blocks' Linear weights read (the
        # whole module's Linears where it has no blocks)
        linears = [m for m in (nn.ModuleList(outer) if outer else module).modules()
                   if isinstance(m, nn.Linear)]
        weights: dict[int, int] = {}
        for m in linears:
            weights[m.in_features] = weights.get(m.in_features, 0) + m.weight.numel()
        hidden = max(weights, key=weights.get, default=0)
        ffn = mlp_width(module, hidden)
        gated = any(isinstance(m, nn.Linear) and m.in_features == hidden
                    and m.out_features == 2 * ffn for m in module.modules()) if ffn else False
        return cls(params, split, blocks, hidden, ffn, 2 * ffn if gated else ffn,
                   attention_width(module, hidden))


def mlp_width(module: nn.Module, hidden: int) -> int:
    """The MLP's inner width: the input width of the down projections (Linear inner -> hidden)
    outside the attention modules whose width an up projection (hidden -> inner, or
    hidden -> 2 x inner for a fused gated projection: diffusers' SwiGLU / GEGLU) produces;
    0 for a module without one. Attention is left out because its inner width (heads x head
    dim) need not be the hidden size (MiniMax-H3: 56 x 128 = 7168 over a 5376 hidden), and an
    up projection is asked for because a modulation (hidden -> 6 hidden) or a block's joint
    output projection (hidden + MLP -> hidden) is no MLP."""
    attention = {id(l) for m in module.modules() if "Attention" in type(m).__name__
                 for l in m.modules()}
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in attention]
    up = {w for m in linears if m.in_features == hidden and m.out_features > hidden
          for w in (m.out_features, m.out_features // 2)}
    down = [m.in_features for m in linears
            if m.out_features == hidden and m.in_features > hidden and m.in_features in up]
    return max(set(down), key=lambda w: (down.count(w), w)) if down else 0


def attention_width(module: nn.Module, hidden: int) -> int:
    """The attention's inner width (heads x head dim): the input width of the attention
    modules' output projections (Linear inner -> hidden); 0 for a module without one."""
    widths = [m.in_features for a in module.modules() if "Attention" in type(a).__name__
              for m in a.modules() if isinstance(m, nn.Linear) and m.out_features == hidden]
    return max(set(widths), key=lambda w: (widths.count(w), w)) if widths else 0


def inference_factor(count: ModuleCount) -> float:
    """Live bytes of one block in inference per row-token, in hidden x bytes units: the block's
    input (held by the caller) + the larger of the attention phase (residual, q / k / v and the
    rotary temporaries) and the MLP phase (residual, attention output, MLP input, its up
    projection and one tensor of that size)."""
    h = max(count.hidden, 1)
    attention = count.attention or count.hidden
    return 1 + max(1 + 6 * attention / h, 3 + 2 * (count.up or 4 * count.hidden) / h)


def training_factor(count: ModuleCount, lora: bool) -> float:
    """Bytes one block keeps for its backward per row-token, in hidden x bytes units (LoRA:
    frozen base weights, the adapters' inputs kept; full: every weight trained)."""
    h = max(count.hidden, 1)
    attention = count.attention or count.hidden
    ffn = count.ffn or 4 * count.hidden
    return (10 + 8 * attention / h + 4 * ffn / h) if lora else \
        (18 + 12 * attention / h + 4 * ffn / h)


def recompute_factor(count: ModuleCount, lora: bool) -> float:
    """The peak of one checkpointed block's backward per row-token (hidden x bytes units): its
    recomputed kept tensors + backward's own (the MLP's gradients, 3 + 2 ffn / H)."""
    ffn = count.ffn or 4 * count.hidden
    return training_factor(count, lora) + 3 + 2 * ffn / max(count.hidden, 1)


def rows_per_call(family, rows: int) -> int:
    """Rows one transformer call runs of a forward of `rows`: the denoiser's `rows_per_call`
    where it declares one (diffusion.step.Denoiser), else all of them."""
    bound = getattr(family.denoiser, "rows_per_call", None)
    return rows if bound is None else min(rows, int(bound))


def _inside(inner: nn.Module, outer: nn.Module) -> bool:
    return any(inner is m for m in outer.modules())


def count_components(root: Path, components: Sequence[str]) -> dict[str, ModuleCount]:
    return {c: ModuleCount.of(meta_module(root, c)) for c in components}


# ---- the plan -----------------------------------------------------------------------------------
@dataclass
class ProcessMemory:
    process: str
    parameters: int
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0        # estimate
    note: str = ""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def fits(self) -> dict[str, bool]:
        return {name: self.total <= size for name, size in GPUS.items()}


@dataclass
class MemoryPlan:
    architecture: str
    settings: dict[str, Any]
    components: dict[str, dict[str, int]]
    processes: list[ProcessMemory] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "settings": self.settings,
                "components": self.components,
                "processes": [asdict(p) | {"total": p.total, "fits": p.fits()}
                              for p in self.processes]}


@dataclass(frozen=True)
class Settings:
    """What the shipped config decides about memory (trainer + graph config)."""

    encoder_dtype: str
    rollout_dtype: str
    decoder_dtype: str
    learner_dtype: str
    fine_tune: PolicyKind
    lora_rank: int
    workers: int
    micro_batch_size: int
    gradient_checkpointing: bool
    max_batch_rows: int
    guidance_scale: float
    height: int | None
    width: int | None
    num_frames: int | None
    task: Task | None
    etp: int

    @classmethod
    def from_config(cls, path: Path) -> tuple["Settings", Any]:
        import yaml
        raw = yaml.safe_load(Path(path).read_text())
        if isinstance(raw, dict) and "graph" in raw:
            from trainer.config import load_trainer_config
            cfg = load_trainer_config(path)
            graph, learner, sampler = cfg.graph_config(), cfg.learner, cfg.sampler
            return cls(graph.encoder.dtype, graph.rollout.dtype, graph.decoder.dtype,
                       learner.dtype, PolicyKind(learner.fine_tune), cfg.lora.rank,
                       learner.workers, learner.micro_batch_size or
                       cfg.prompts_per_step * cfg.samples_per_prompt // learner.workers,
                       learner.gradient_checkpointing, graph.rollout.limits.max_batch_rows,
                       sampler.guidance_scale, sampler.height, sampler.width,
                       getattr(sampler, "num_frames", None), cfg.task,
                       graph.encoder.etp), graph
        from deployments.config import load_graph_config
        graph = load_graph_config(path)
        return cls(graph.encoder.dtype, graph.rollout.dtype, graph.decoder.dtype, "bfloat16",
                   PolicyKind.LORA, 32, 1, 1, True, graph.rollout.limits.max_batch_rows, 4.5,
                   None, None, None, None, graph.encoder.etp), graph


def own_architecture(name: str, graph) -> bool:
    """Whether the description `name` is the config's model: the one its
    `rollout.architecture` names or, where it names none, a description of its adapter's
    family. Its plan takes the config's sizes and adapter options; any other description
    its family's defaults."""
    if graph is None:
        return False
    if graph.rollout.architecture is not None:
        return graph.rollout.architecture == name
    return ARCHITECTURE_FAMILY.get(name) == graph.adapter


def _architecture_family(name: str, graph) -> tuple[str, Path, Any]:
    """(family name, description folder, the family built from it, weights-free)."""
    from adapters.architectures import architecture_root
    from adapters.registry import get_family
    root = architecture_root(name)
    adapter = ARCHITECTURE_FAMILY.get(name, graph.adapter if graph is not None else None)
    if adapter is None:
        raise ConfigError("no family is known for this architecture", field="architecture",
                          expected=sorted(ARCHITECTURE_FAMILY), actual=name)
    options = graph.adapter_options if own_architecture(name, graph) \
        else ARCHITECTURE_OPTIONS.get(name, {})
    return adapter, root, get_family(adapter, str(root), options)


def _tokens(family, counts: Mapping[str, ModuleCount], sampling: SamplingSpec,
            root: Path, task: Task | None = None) -> int:
    """Tokens of one row: the denoiser's own count where it declares `sequence_tokens`
    (MiniMax-H3's packed sequence: text, the task's keyframes, audio, video), else the sampler
    state's elements over the transformer's input channels (and its patch, for an unpacked
    latent) + the longest text encoder's window (the text tokens it attends to; an estimate)."""
    text = max((e.max_length for e in family.spec.encoders), default=0)
    count = getattr(family.denoiser, "sequence_tokens", None)
    if count is not None:
        return int(count(sampling, text, len(family.spec.tasks.get(task, ()))))
    component = family.spec.transformers[0]
    config = json.loads((root / component / "config.json").read_text())
    shape = family.codec.state_shape(sampling)
    elements = math.prod(shape)
    channels = int(config.get("in_channels") or config.get("in_dim") or shape[0])
    patch = config.get("patch_size") or 1
    patch_elems = math.prod(patch) if isinstance(patch, (list, tuple)) else patch * patch
    packed = shape[-1] == channels and len(shape) <= 2
    tokens = elements // channels // (1 if packed else patch_elems)
    return int(tokens + text)


def plan_memory(architecture: str, settings: Settings, graph=None,
                workers: Sequence[int] = (2, 4, 8), etps: Sequence[int] = (1, 2, 4, 8),
                root_override: Path | None = None, config_size: bool = True) -> MemoryPlan:
    """The plan of one architecture under the config's settings. Sizes: the config's sampler
    (config_size), else the family's defaults. root_override: a checkpoint folder to read the
    configs from instead of the description (the config's own adapter)."""
    if root_override is not None:
        from adapters.registry import get_family
        root = root_override
        family = get_family(graph.adapter, str(root), graph.adapter_options)
    else:
        _, root, family = _architecture_family(architecture, graph)
    spec = family.spec
    encoders = {e.name: e.component for e in spec.encoders}
    extra = [c for e in spec.encoders for c in e.extra_components]
    decoders = sorted({c for cs in spec.decoders.values() for c in cs})
    counts = count_components(root, [*spec.transformers, *encoders.values(), *extra,
                                     *decoders, *spec.media_encoders])
    defaults = dict(spec.sampling_defaults)
    size = {k: v for k, v in (("height", settings.height), ("width", settings.width),
                              ("num_frames", settings.num_frames)) if v}
    if not config_size:               # another architecture: its own sizes
        size = {k: v for k, v in defaults.items() if k in ("height", "width", "num_frames")}
    sampling = SamplingSpec(**{**{k: v for k, v in defaults.items()
                                  if k in ("height", "width", "num_frames")}, **size},
                            guidance_scale=settings.guidance_scale, seeds=(0,))
    from diffusion.step import doubles_rows
    cfg_rows = 2 if doubles_rows(spec.guidance, settings.guidance_scale) else 1
    tokens = _tokens(family, counts, sampling, root, settings.task)
    plan = MemoryPlan(architecture, asdict(settings) | {
        "sampling": {k: getattr(sampling, k) for k in ("height", "width", "num_frames")},
        "tokens_per_row": tokens, "cfg_rows": cfg_rows},
        {c: {"params": n.params, "blocks": n.blocks, "hidden": n.hidden, "ffn": n.ffn,
             "up": n.up, "attention": n.attention} for c, n in counts.items()})
    # text encoders, one shard at each ETP degree
    enc_b = dtype_bytes(settings.encoder_dtype)
    text_tokens = max((e.max_length for e in spec.encoders), default=0)
    for etp in sorted({*etps, settings.etp}):
        params = sum((counts[c].split_params / etp + counts[c].params - counts[c].split_params)
                     for c in [*encoders.values(), *extra])
        act = sum(settings.max_batch_rows * cfg_rows * text_tokens * counts[c].hidden
                  * (4 + counts[c].ffn / max(counts[c].hidden, 1) / etp) * enc_b
                  for c in encoders.values())
        plan.processes.append(ProcessMemory(f"encoder shard (etp={etp})", int(params * enc_b),
                                            activations=int(act)))
    # rollout replica
    roll_b = dtype_bytes(settings.rollout_dtype)
    conditioned = settings.task in CONDITIONED_TASKS
    params = sum(counts[c].params for c in spec.transformers) * roll_b
    if conditioned:
        params += sum(counts[c].params for c in spec.media_encoders) * roll_b
    main = counts[spec.transformers[0]]
    rows = settings.max_batch_rows * cfg_rows
    live = rows_per_call(family, rows)
    act = live * tokens * main.hidden * inference_factor(main) * roll_b
    plan.processes.append(ProcessMemory("rollout replica", int(params), activations=int(act),
                                        note=f"{rows} rows a forward, {live} a transformer call "
                                             f"x {tokens} tokens"))
    # decoders
    dec_b = dtype_bytes(settings.decoder_dtype)
    for latent, components in sorted(spec.decoders.items()):
        plan.processes.append(ProcessMemory(
            f"decoder {latent}", int(sum(counts[c].params for c in components) * dec_b)))
    # learner workers
    learn_b = dtype_bytes(settings.learner_dtype)
    trained = sum(counts[c].params for c in spec.transformers)
    micro = settings.micro_batch_size * cfg_rows
    live = rows_per_call(family, micro)
    per_row = tokens * main.hidden * learn_b
    blocks = max(main.blocks, 1)

    def learner_activations(lora: bool) -> int:
        if settings.gradient_checkpointing:      # every row's block inputs + one block redone
            return int(per_row * (micro * blocks + live * recompute_factor(main, lora)))
        return int(per_row * micro * blocks * training_factor(main, lora))

    media = sum(counts[c].params for c in spec.media_encoders) * learn_b if conditioned else 0
    lora = lora_params(family, root, settings.lora_rank)
    plan.processes.append(ProcessMemory(          # DDP: the whole model on every worker
        f"learner worker (DDP, LoRA r{settings.lora_rank}, any N)",
        int(trained * learn_b + 2 * lora * 4 + media), gradients=int(lora * 4),
        optimizer=int(2 * lora * 4), activations=learner_activations(True),
        note="the transformer in the learner dtype + adapters 'default' and 'old' in fp32"))
    for n in sorted(set(workers)):                # FSDP2: full weights sharded over n
        masters, frozen = trained * 4, 2 * trained * learn_b     # + old and reference copies
        plan.processes.append(ProcessMemory(
            f"learner worker (FSDP2, full, N={n})", int((masters + frozen) / n + media),
            gradients=int(trained * 4 / n), optimizer=int(2 * trained * 4 / n),
            activations=learner_activations(False),
            note="fp32 masters, old + reference copies, AdamW"))
    plan.processes.append(ProcessMemory("controller (trainer process)", 0,
                                        note="no model beside a worker group"))
    return plan


def lora_params(family, root: Path, rank: int) -> int:
    """Elements of one LoRA adapter of `rank` on the family's declared targets."""
    total = 0
    for component in family.spec.transformers:
        targets = tuple(family.spec.lora_targets.get(component, ()))
        module = meta_module(root, component)
        for name, m in module.named_modules():
            if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t)
                                                for t in targets):
                total += rank * (m.in_features + m.out_features)
    return total


# ---- output --------------------------------------------------------------------------------------
def gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def format_summary(plans: Sequence[MemoryPlan]) -> str:
    """One markdown row per architecture: each process's total GB, and where it fits."""
    def cell(plan: MemoryPlan, prefix: str) -> str:
        p = next((p for p in plan.processes if p.process.startswith(prefix)), None)
        if p is None:
            return "-"
        fit = "80" if p.total <= GPUS["80GB"] else "141" if p.total <= GPUS["141GB"] else "none"
        return f"{gb(p.total)} ({fit})"
    fsdp = sorted({p.process for plan in plans for p in plan.processes
                   if p.process.startswith("learner worker (FSDP2")},
                  key=lambda n: int(n.split("N=")[1].rstrip(")")))
    head = ["architecture", "size, tokens / row", "encoder etp=1", "encoder etp=4",
            "rollout replica", "decoder (largest)", "learner DDP LoRA",
            *(f"learner FSDP2 full {n.split('(')[1].split(', ')[-1].rstrip(')')}"
              for n in fsdp)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for plan in plans:
        size = plan.settings["sampling"]
        frames = f"x{size['num_frames']}f" if (size.get("num_frames") or 1) > 1 else ""
        decoders = [p for p in plan.processes if p.process.startswith("decoder")]
        largest = max(decoders, key=lambda p: p.total).process if decoders else "decoder"
        lines.append("| " + " | ".join([
            plan.architecture,
            f"{size['height']}x{size['width']}{frames}, {plan.settings['tokens_per_row']}",
            cell(plan, "encoder shard (etp=1)"), cell(plan, "encoder shard (etp=4)"),
            cell(plan, "rollout replica"), cell(plan, largest),
            cell(plan, "learner worker (DDP"), *(cell(plan, n) for n in fsdp)]) + " |")
    return "\n".join(lines)


def format_plan(plan: MemoryPlan, markdown: bool = False) -> str:
    head = ["process", "params GB", "grads GB", "optim GB", "activ. GB (est.)", "total GB",
            "80 GB", "141 GB"]
    rows = [[p.process, gb(p.parameters), gb(p.gradients), gb(p.optimizer), gb(p.activations),
             gb(p.total), *("yes" if ok else "NO" for ok in p.fits().values())]
            for p in plan.processes]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(r, widths))
                     for r in [head, *rows])


def _is_trainer_config(path: Path) -> bool:
    import yaml
    raw = yaml.safe_load(Path(path).read_text())
    return isinstance(raw, dict) and "graph" in raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", required=True, type=Path, metavar="CONFIG")
    parser.add_argument("--architecture", default=None,
                        help="a shipped description, or 'all' (default: the config's)")
    parser.add_argument("--workers", type=int, nargs="+", default=None)
    parser.add_argument("--etp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--summary", action="store_true",
                        help="one markdown row per architecture (docs/CLUSTER.md)")
    parser.add_argument("--out", type=Path, default=None, help="write the plans as JSON")
    args = parser.parse_args(argv)
    settings, graph = Settings.from_config(args.memory)
    workers = args.workers or sorted({settings.workers, 2, 4, 8})
    if args.architecture == "all":
        from adapters.architectures import names
        archs = [a for a in names() if a in ARCHITECTURE_FAMILY]
    else:
        archs = [args.architecture or graph.rollout.architecture]
        if archs[0] is None:
            raise ConfigError("the config names no architecture description",
                              field="rollout.architecture", actual=None)
    plans = []
    for arch in archs:
        own = own_architecture(arch, graph)
        plan = plan_memory(arch, settings, graph, workers, args.etp, config_size=own)
        plans.append(plan)
        if args.summary:
            continue
        title = f"{arch} ({'the config' if own else 'its default size'}: " \
                f"{plan.settings['sampling']}, {plan.settings['tokens_per_row']} tokens / row)"
        print(f"\n### {title}\n" if args.markdown else f"\n{title}")
        print(format_plan(plan, args.markdown))
        if own and _is_trainer_config(args.memory):
            print("\non the config's GPUs (num_gpus x the card its stage's labels pin; "
                  "none: 80 GB):")
            for row in config_fit(args.memory, arch, plan):
                print(f"  {row['process']}: {gb(row['total'])} GB of {gb(int(row['share']))} GB"
                      f" -> {'fits' if row['fits'] else 'DOES NOT FIT'}")
    if args.summary:
        print(format_summary(plans))
    if args.out:
        args.out.write_text(json.dumps([p.to_json() for p in plans], indent=1) + "\n")
    return 0


__all__ = ["MemoryPlan", "ProcessMemory", "Settings", "plan_memory", "format_plan",
           "own_architecture", "inference_factor", "training_factor", "recompute_factor",
           "config_fit", "main"]


# ---- a config's processes on its GPUs --------------------------------------------------------------
ACCELERATOR_LABEL = "ray.io/accelerator-type"      # the node label Ray sets from the GPU model
ACCELERATOR_BYTES = {"H100": GPUS["80GB"], "H200": GPUS["141GB"]}


def card_bytes(selector: Mapping[str, str], field: str) -> float:
    """The memory of the card a stage's label selector pins (ray.io/accelerator-type); without
    one, any card may run it, so the smallest planned (80 GB)."""
    kind = selector.get(ACCELERATOR_LABEL)
    if kind is None:
        return min(GPUS.values())
    if kind not in ACCELERATOR_BYTES:
        raise ConfigError("no memory is planned for this accelerator type",
                          field=f"{field}.{ACCELERATOR_LABEL}",
                          expected=sorted(ACCELERATOR_BYTES), actual=kind)
    return ACCELERATOR_BYTES[kind]


def config_fit(path: Path, architecture: str,
               plan: MemoryPlan | None = None) -> list[dict[str, Any]]:
    """Each GPU process of a trainer config (its graph's encoder shard, rollout replica and
    decoders, its learner worker) against its share of the card its stage is pinned to:
    num_gpus (per shard / per worker) x the card's bytes. One row each: process, total bytes,
    share bytes, fits. `plan`: the config's plan when already made (its own sizes)."""
    from trainer.config import load_trainer_config
    settings, graph = Settings.from_config(path)
    cfg = load_trainer_config(path)
    learner = cfg.learner
    plan = plan or plan_memory(architecture, settings, graph,
                               workers=(max(learner.workers, 1),), etps=(settings.etp,),
                               config_size=own_architecture(architecture, graph))
    worker = "learner worker (DDP" if settings.fine_tune is PolicyKind.LORA else \
        f"learner worker (FSDP2, full, N={max(learner.workers, 1)})"
    shares = [(f"encoder shard (etp={settings.etp})", graph.encoder.num_gpus_per_shard,
               graph.encoder.node_labels, "encoder"),
              ("rollout replica", graph.rollout_stage.num_gpus, graph.rollout_stage.node_labels,
               "rollout_stage"),
              ("decoder ", graph.decoder.num_gpus, graph.decoder.node_labels, "decoder"),
              (worker, learner.resources_per_worker.get("GPU", 0.0), learner.label_selector,
               "learner")]
    rows = []
    for prefix, gpus, selector, field in shares:
        share = gpus * card_bytes(selector, f"{field}.node_labels")
        for p in plan.processes:
            if p.process.startswith(prefix):
                rows.append({"process": p.process, "total": p.total, "share": share,
                             "fits": p.total <= share})
    return rows
