"""`python -m trainer --config configs/train_tiny_t2i.yaml [--set steps=20 ...]`

Connects to a running Ray cluster with the rollout graph deployed (`serve run <graph yaml>`), or
with `--deploy` starts a local cluster and deploys the trainer config's graph first.
"""
from __future__ import annotations

import argparse
import json
from typing import Sequence

import yaml

from trainer.config import load_trainer_config


def parse_overrides(items: Sequence[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/train_tiny_t2i.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (dotted), e.g. pipeline.mode=serial")
    parser.add_argument("--deploy", action="store_true",
                        help="start a local Ray cluster and deploy the graph first")
    args = parser.parse_args(argv)
    cfg = load_trainer_config(args.config, parse_overrides(args.set))
    from trainer.demo import local_cluster
    from trainer.loop import Trainer
    if args.deploy:
        with local_cluster(cfg) as info:
            history = Trainer(cfg, progress=True).run()
            print(json.dumps({"dashboard": info.get("dashboard_url")}))
    else:
        history = Trainer(cfg, progress=True).run()
    print(f"run folder: {cfg.run_dir}  ({len(history)} steps, metrics.jsonl, reward_curve.png, "
          f"gallery/, checkpoints/)")


if __name__ == "__main__":
    main()
