"""`python -m trainer --config configs/train_tiny_t2i.yaml [--set steps=20 ...]`

Connects to a running Ray cluster with the rollout graph deployed (`serve run <graph yaml>`), or
with `--deploy` starts a local cluster and deploys the trainer config's graph first; `--check`
checks the config, its graph and the family's declarations without a cluster or the weights.
"""
from __future__ import annotations

import argparse
import json
from typing import Sequence

import yaml

from contract import ConfigError
from contract.cli import run_cli
from trainer.config import load_trainer_config


def parse_overrides(items: Sequence[str]) -> dict:
    """['a.b=1', ...] -> {'a.b': 1}; each value is read as YAML (a ConfigError naming the key
    when it is not)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set expects KEY=VALUE", field="--set", expected="KEY=VALUE",
                              actual=item)
        try:
            out[key.strip()] = yaml.safe_load(value)
        except (yaml.YAMLError, RecursionError) as exc:
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ConfigError(f"--set value is not YAML: {problem}", field=key.strip(),
                              actual=value[:200]) from None
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """A bad config, override or prompt file (or any other typed error, a missing file, bad
    YAML) ends the run with one line on stderr naming the field (exit status 2), not a
    traceback."""
    status = run_cli("python -m trainer", _main, argv)
    if status:
        raise SystemExit(status)


def check(cfg) -> str:
    """The config check without a cluster or the weights: the trainer config, its graph and
    what the graph's family declares (from the checkpoint's JSON files here, or from
    `rollout.architecture` where the checkpoint is only on the cluster)."""
    from deployments.topology import declared_family
    graph = cfg.graph_config()
    note = declared_family(graph).source.note
    return "ok" + (f" ({note})" if note else "")


def _main(argv: Sequence[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/train_tiny_t2i.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (dotted), e.g. pipeline.mode=serial")
    parser.add_argument("--deploy", action="store_true",
                        help="start a local Ray cluster and deploy the graph first")
    parser.add_argument("--check", action="store_true",
                        help="check the config, its graph and the family's declarations, then "
                             "exit (no cluster, no weights)")
    args = parser.parse_args(argv)
    cfg = load_trainer_config(args.config, parse_overrides(args.set))
    if args.check:
        print(f"{args.config}: {check(cfg)}")
        return
    cfg.graph_config()                      # a bad graph file fails here, before Ray starts
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
