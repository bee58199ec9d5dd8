"""Every training algorithm on the same task, budget and seeds: the held-out verifier reward of
tiny_t2i against wall time and against samples, in one process (the embedded rollout engine,
the learner with its LoRA, the image verifier; no Ray).

    python -m bench.algorithms_bench [--steps 6] [--group 8] [--eval-every 3] [--seeds 0 1 2]
-> bench/results/algorithms.json + bench/results/algorithms.png

Each algorithm trains `steps` optimizer steps on two prompts whose colour the base model mostly
misses, `group` samples per prompt per step (its own sampler: NFT / DPO / AWM sample ODE,
FlowGRPO and its variants SDE; MixGRPO-Flash DPM-Solver++(2M) on a compressed table after its
window; BranchGRPO / TreeGRPO fork group / 4 roots twice into 4 leaves each, sharing their
prefix), from the same base adapter and run seed. forwards_per_sample: the rows the engine runs
over the steps, per final sample (6 for an unbranched 6-step rollout). The held-out reward is
the mean image-verifier score of fixed held-out seeds sampled deterministically (ODE, the same
steps for every algorithm) with the trained adapter, every `eval_every` steps; wall time counts
rollouts and updates, not evaluations. The machine's load average is recorded: on a shared
machine the wall times are not clean measurements, the samples axis is.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

from adapters.tiny_t2i import TinyT2IFamily
from contract import Algorithm, MediaArtifact, RewardReport, RolloutOutput, SamplerKind
from rewards.base import ScoreRequest
from rewards.verifiers.image import ImageAttributeScorer
from rollout.engine import EmbeddedEngine
from rollout.engine_api import EngineRequest, Fork
from diffusion.windows import flash_post_points, sliding_sde_window
from trainer.algorithms.nft import old_decay
from trainer.config import SamplerSettings, load_trainer_config
from trainer.learner import Learner
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.prompts import make_requests
from trainer.rollout_batch import build_batch
from trainer.updates import UPDATES, plan_tree_update, run_update, tree_node_ids

RESULTS = Path(__file__).parent / "results"
PROMPTS = ("a blue triangle at the top right on a white background",
           "a yellow triangle at the bottom left on a black background")
HELD_OUT_SEED = 10_000
NUM_STEPS = 6

COMMON = {"prompts_per_step": len(PROMPTS), "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0},
          "lora": {"rank": 8, "alpha": 16}}
ODE = {"sampler": "ode", "num_steps": NUM_STEPS}
SDE = {"sampler": "sde", "num_steps": NUM_STEPS, "noise_level": 0.7}
GRPO = {"clip_range": 0.2, "adv_clip_max": 5.0}
# name -> trainer config fields (besides COMMON, steps and group)
RECIPES = {
    "nft": {"algorithm": "nft", "sampler": ODE,
            "nft": {"beta": 1.0, "train_timesteps": 3, "old_refresh_every": 2}},
    "flow_grpo": {"algorithm": "flow_grpo", "sampler": SDE, "flow_grpo": GRPO},
    "grpo_guard": {"algorithm": "flow_grpo", "sampler": SDE,
                   "flow_grpo": {**GRPO, "ratio": "grpo_guard"}},
    "mixgrpo": {"algorithm": "flow_grpo", "flow_grpo": GRPO, "sampler": {
        **SDE, "sliding_window": {"size": 1, "shift_every": 4, "roll_back": True}}},
    "mixgrpo_flash": {"algorithm": "flow_grpo", "flow_grpo": GRPO, "sampler": {
        **SDE, "flash_compress": 0.5,
        "sliding_window": {"size": 1, "shift_every": 4, "roll_back": True}}},
    "branch_grpo": {"algorithm": "flow_grpo", "sampler": {**SDE, "window": [0, 5]},
                    "flow_grpo": {**GRPO, "tree_advantage": "branch_depthwise"}},
    "tree_grpo": {"algorithm": "flow_grpo", "sampler": {**SDE, "window": [0, 5]},
                  "flow_grpo": {**GRPO, "tree_advantage": "tree_backprop"}},
    "dpo": {"algorithm": "dpo", "sampler": ODE, "dpo": {"beta": 100.0, "draws_per_pair": 2}},
    "awm": {"algorithm": "awm", "sampler": ODE,
            "awm": {"clip_range": 0.2, "train_timesteps": 3}},
}


# branched rollouts: each prompt's group is roots x 2 x 2 leaves, forked at steps 2 and 3
FORKS = {"branch_grpo": (Fork(2, 2), Fork(3, 2)), "tree_grpo": (Fork(2, 2), Fork(3, 2))}


def forwards_per_sample(forks: tuple[Fork, ...], roots: int, num_steps: int) -> float:
    """Rows the engine runs per step (a fork's children from its step on), per final sample."""
    rows, total = roots, 0
    by_step = {f.step: f.children for f in forks}
    for j in range(num_steps):
        rows *= by_step.get(j, 1)
        total += rows
    return total / rows


class Run:
    """One algorithm from the base model: rollouts of its sampling adapter (NFT: the old one)
    on the embedded engine, decoded and scored by the image verifier, one update per batch."""

    def __init__(self, base, recipe: dict, steps: int, group: int, seed: int,
                 forks: tuple[Fork, ...] = ()):
        self.family, transformers, encoders, self.decoder = base
        self.forks = forks
        leaves = 1
        for f in forks:
            leaves *= f.children
        if group % leaves:
            raise ValueError(f"--group {group} is not a multiple of the {leaves} leaves per root")
        roots = group // leaves
        self.cfg = load_trainer_config({**COMMON, **recipe, "steps": steps,
                                        "samples_per_prompt": max(roots, 2), "seed": seed})
        self.group, self.roots, self.seed = group, roots, seed
        self.engine = EmbeddedEngine(self.family, copy.deepcopy(transformers), {})
        torch.manual_seed(seed)               # the LoRA's initial A matrices
        self.learner = Learner(self.family, copy.deepcopy(transformers), encoders, self.cfg.lora,
                               self.cfg.optimizer)
        self.bundles = self.family.conditioner.tokenize(list(PROMPTS))
        self.scorer = ImageAttributeScorer()
        self.image = next(a for a in self.family.io_spec.artifacts if a.name == "image")
        self.samples = 0
        self.names = 0

    def publish(self, adapter: str) -> str:
        self.names += 1
        name = f"v{self.names}"
        self.engine.load_lora(name, *self.learner.export(adapter))
        return name

    def rollout(self, version: str, settings: SamplerSettings, group: int, seed: int,
                step: int = 0, forks: tuple[Fork, ...] = ()):
        requests = make_requests(self.family, self.bundles, settings, group, seed, version,
                                 step=step)

        async def generate():
            return [await self.engine.generate(EngineRequest(
                r, self.learner.encode([b]), None, ("image_latent",), {}, version, forks))
                for r, b in zip(requests, self.bundles)]
        results = asyncio.run(generate())
        rewards = []
        for request, result, prompt in zip(requests, results, PROMPTS):
            latent = result.latents["image_latent"].data
            pixels = self.family.codec.decode("image_latent", self.decoder, latent,
                                              request.sampling)
            scored = self.scorer.score(ScoreRequest({"image": MediaArtifact(self.image, pixels)},
                                                    (prompt,) * latent.shape[0]))
            rewards.append(scored.scores[self.scorer.primary])
        return requests, results, rewards

    def held_out(self, group: int) -> float:
        settings = SamplerSettings(sampler=SamplerKind.ODE, num_steps=NUM_STEPS)
        _, _, rewards = self.rollout(self.publish(TRAIN_ADAPTER), settings, group,
                                     HELD_OUT_SEED)
        return sum(map(sum, rewards)) / (len(PROMPTS) * group)

    def train(self, eval_every: int, eval_group: int) -> list[dict]:
        cfg, nft = self.cfg, self.cfg.algorithm is Algorithm.NFT
        generator = torch.Generator().manual_seed(self.seed)
        curve = [{"step": 0, "samples": 0, "wall_s": 0.0, "reward": self.held_out(eval_group)}]
        wall = 0.0
        sampling = self.publish(OLD_ADAPTER) if nft else None
        for step in range(cfg.steps):
            start = time.perf_counter()
            version = sampling if nft else self.publish(TRAIN_ADAPTER)
            requests, results, rewards = self.rollout(
                version, cfg.sampler, self.roots if self.forks else self.group,
                self.seed * 100_000 + step * 100, step, self.forks)
            outputs = [RolloutOutput(r.request_id, dict(e.latents), e.trajectory,
                                     e.policy_version, r.sampling.seeds if e.tree is None else
                                     tuple(e.tree.seeds[n] for n in e.tree.leaves),
                                     rewards=RewardReport({}, tuple(rw), {}))
                       for r, e, rw in zip(requests, results, rewards)]
            batch = build_batch(self.learner, self.bundles, outputs,
                                [r.sampling for r in requests])
            if self.forks:
                node_of = tree_node_ids([e.tree for e in results],
                                        [len(rw) for rw in rewards], cfg.sampler.num_steps)
                run_update(self.learner, plan_tree_update(batch, cfg, generator, node_of), cfg)
            else:
                UPDATES[cfg.algorithm](self.learner, batch, cfg, generator)
            if nft and (step + 1) % cfg.nft.old_refresh_every == 0:
                self.learner.refresh_old(old_decay(step + 1, cfg.nft.decay))
                sampling = self.publish(OLD_ADAPTER)
            wall += time.perf_counter() - start
            self.samples += len(PROMPTS) * self.group
            if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
                curve.append({"step": step + 1, "samples": self.samples, "wall_s": wall,
                              "reward": self.held_out(eval_group)})
        return curve

    def close(self) -> None:
        asyncio.run(self.engine.shutdown())


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, runs in data["algorithms"].items():
        for ax, key in zip(axes, ("samples", "wall_s")):
            xs = [sum(r["curve"][i][key] for r in runs) / len(runs)
                  for i in range(len(runs[0]["curve"]))]
            ys = [sum(r["curve"][i]["reward"] for r in runs) / len(runs)
                  for i in range(len(runs[0]["curve"]))]
            ax.plot(xs, ys, marker="o", label=name)
    axes[0].set_xlabel("training samples")
    axes[1].set_xlabel("wall seconds (rollouts + updates; shared, loaded machine)")
    for ax in axes:
        ax.set_ylabel(f"held-out verifier reward (mean of {len(data['seeds'])} seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"tiny_t2i, {data['steps']} steps x {data['group']} samples x "
                 f"{len(PROMPTS)} prompts per algorithm; load avg {data['load_avg_start'][0]:.1f}"
                 f" -> {data['load_avg_end'][0]:.1f} on {data['cpus']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--eval-group", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES))
    parser.add_argument("--out", type=Path, default=RESULTS / "algorithms.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    family = TinyT2IFamily()
    base = (family, family.load_transformers(), family.load_encoders(),
            family.load_decoder("image_latent"))
    data = {"task": "tiny_t2i, image verifier (colour / shape / position of the caption)",
            "prompts": list(PROMPTS), "steps": args.steps, "group": args.group,
            "eval_every": args.eval_every, "held_out": {
                "seeds_from": HELD_OUT_SEED, "samples_per_prompt": args.eval_group,
                "sampler": "ode", "num_steps": NUM_STEPS},
            "seeds": args.seeds, "recipes": {k: RECIPES[k] for k in args.only},
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(), "load_avg_start": os.getloadavg(),
            "algorithms": {}}
    data["forwards_per_sample"] = {}
    for name in args.only:
        forks = FORKS.get(name, ())
        leaves = 1
        for f in forks:
            leaves *= f.children
        if name == "mixgrpo_flash":       # the compressed table of each step's window
            c = RECIPES[name]["sampler"]
            w = c["sliding_window"]
            ends = [sliding_sde_window(k, c["num_steps"], w["size"], w["shift_every"],
                                       roll_back=w["roll_back"])[1] for k in range(args.steps)]
            data["forwards_per_sample"][name] = sum(
                e + flash_post_points(c["num_steps"], e, c["flash_compress"]) - 1
                for e in ends) / len(ends)
        else:
            data["forwards_per_sample"][name] = forwards_per_sample(
                forks, args.group // leaves, NUM_STEPS)
        if forks:
            data.setdefault("forks", {})[name] = [[f.step, f.children] for f in forks]
        for seed in args.seeds:
            run = Run(base, RECIPES[name], args.steps, args.group, seed, FORKS.get(name, ()))
            try:
                curve = run.train(args.eval_every, args.eval_group)
            finally:
                run.close()
            data["algorithms"].setdefault(name, []).append(
                {"seed": seed, "curve": curve, "load_avg_after": os.getloadavg()})
            print(name, seed, [round(p["reward"], 3) for p in curve],
                  f"{curve[-1]['wall_s']:.1f} s", flush=True)
    data["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    plot(data, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
