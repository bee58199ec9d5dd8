"""Shipped Serve config files started as a user starts them, on a fresh 2-CPU local cluster.

    python -m tests.serve_configs --http-port P CONFIG.yaml ...      # one JSON line per config

runs in a process of its own (a Ray driver holds one cluster; the test process may hold
another): `ray.init` of a local cluster with LOCAL_CPUS CPUs and LOCAL_MEMORY_BYTES of logical
memory, Serve on 127.0.0.1:P, then for each config file, one after another: `graph.build_app`
of the file (what `serve run CONFIG` builds), a ConfigError reported as a refusal; else the
application deployed, its status polled until RUNNING (or DEPLOY_FAILED, or READY_TIMEOUT_S),
one rollout posted to /rollout and the graph deleted. Also the helpers the tests share: which
configs are Serve config files, what a header says a config needs, the request a config's
family answers, the config a user would write for the tiny checkpoints.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
LOCAL_CPUS = 2
# Logical memory of the local cluster: what Ray gives a 2-core, 24 GiB machine (about 16 GiB)
# less a margin for a machine busy at start; fixed so the outcome does not depend on the load.
LOCAL_MEMORY_BYTES = 12 * 2**30
OBJECT_STORE_BYTES = 512 * 2**20
READY_TIMEOUT_S = 900.0       # deploy -> RUNNING on a loaded 2-core machine takes minutes
ROLLOUT_TIMEOUT_S = 600.0
NEEDS = "# Needs:"            # the header line of a config that does not fit LOCAL_CPUS

SHAPE_CAPTION = "a red circle at the top left on a black background"
CLIP_CAPTION = "a blue square bouncing up and down with high beeps"
# the smallest request each family answers (sizes the tiny checkpoints take; the family's
# sampling defaults otherwise)
REQUESTS: dict[str, dict[str, Any]] = {
    "tiny_t2i": {"prompts": [SHAPE_CAPTION]},
    "tiny_t2va": {"prompts": [CLIP_CAPTION]},
    "sd3": {"prompts": [SHAPE_CAPTION], "height": 32, "width": 48},
    "flux": {"prompts": [SHAPE_CAPTION], "height": 32, "width": 48},
    "wan": {"prompts": [SHAPE_CAPTION], "height": 32, "width": 48, "num_frames": 5},
    "ltx2": {"prompts": [CLIP_CAPTION], "height": 64, "width": 96, "num_frames": 9,
             "guidance_scale": 3.0},     # LTX-2 guides audio: guidance 1 is refused
    "qwen_image": {"prompts": [SHAPE_CAPTION], "height": 32, "width": 48},
    "minimax_h3": {"prompts": [CLIP_CAPTION], "height": 32, "width": 64, "num_frames": 124},
}
# the tiny checkpoint (testing/tiny_checkpoints.py Family) a family's config is pointed at
CHECKPOINTS = {"sd3": "sd3", "flux": "flux", "wan": "wan22", "ltx2": "ltx2",
               "qwen_image": "qwen_image", "minimax_h3": "minimax_h3"}


def serve_config_files() -> list[Path]:
    """The shipped Serve config files (`applications:`), not the trainer configs."""
    return sorted(p for p in CONFIGS.glob("*.yaml")
                  if "applications" in (yaml.safe_load(p.read_text()) or {}))


def header_needs(path: Path) -> str | None:
    """What the config's header says it needs beyond a 2-CPU machine (its `# Needs:` line)."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return None
        if line.startswith(NEEDS):
            return line[len(NEEDS):].strip()
    return None


def user_config(path: Path, checkpoint: Callable[[str], Path], clap_dir: Path | None,
                http_port: int) -> dict[str, Any]:
    """The file as a user edits it before `serve run`: rollout.weights_path at the tiny
    checkpoint of its family (unless an `architecture` stands in for the weights), CLAP's
    model_dir at a local snapshot, the HTTP port free."""
    data = yaml.safe_load(path.read_text())
    data["http_options"] = dict(data.get("http_options") or {}, host="127.0.0.1",
                                port=http_port)
    args = data["applications"][0]["args"]
    rollout = args["rollout"]
    family = CHECKPOINTS.get(rollout["adapter"])
    if family is not None and "architecture" not in rollout:
        rollout["weights_path"] = str(checkpoint(family))
    for spec in args.get("scorers", []):
        if spec["scorer"]["kind"] == "clap" and clap_dir is not None:
            spec["scorer"]["params"]["model_dir"] = str(clap_dir)
    return data


def rollout_body(adapter: str, scorers: list[dict]) -> dict[str, Any]:
    """One prompt, one sample, two ODE steps; the OCR scorer's target text in its metadata."""
    body = {"samples_per_prompt": 1, "seed": 0, "num_steps": 2, "sampler": "ode",
            "noise_level": 0.0, **REQUESTS.get(adapter, {"prompts": [SHAPE_CAPTION]})}
    keys = {s["scorer"].get("params", {}).get("target_key", "ocr_text")
            for s in scorers if s["scorer"]["kind"] == "ocr"}
    if keys:
        body["metadata"] = [{k: "OPEN" for k in keys}]
    return body


def _serve_one(path: Path, http_port: int) -> dict[str, Any]:
    import httpx
    from ray import serve
    from ray.serve.api import RunTarget

    from contract import ConfigError
    from graph import build_app, delete_graph
    data = yaml.safe_load(path.read_text())
    args = data["applications"][0]["args"]
    out: dict[str, Any] = {"config": path.name}
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            app = build_app(args)
        except ConfigError as exc:
            return out | {"outcome": "refused", "field": exc.field, "message": exc.message,
                          "build_s": time.monotonic() - t0}
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                       if issubclass(w.category, UserWarning)]
    name = args.get("app_name", "omni")
    serve.run_many([RunTarget(app, name=name, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False,
                   wait_for_applications_running=False)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            status = serve.status().applications.get(name)
            state = None if status is None else str(status.status.value)
            if state == "RUNNING":
                break
            if state == "DEPLOY_FAILED" or time.monotonic() > deadline:
                stages = {} if status is None else {
                    d: f"{s.status.value}: {s.message}" for d, s in status.deployments.items()}
                return out | {"outcome": "not_ready", "state": state,
                              "message": None if status is None else status.message,
                              "deployments": stages, "waited_s": time.monotonic() - t0}
            time.sleep(1.0)
        out["ready_s"] = time.monotonic() - t0
        body = rollout_body(args["rollout"]["adapter"], args.get("scorers", []))
        reply = httpx.post(f"http://127.0.0.1:{http_port}/rollout", json=body,
                           timeout=ROLLOUT_TIMEOUT_S)
        out |= {"outcome": "served", "status_code": reply.status_code,
                "rollout_s": time.monotonic() - t0 - out["ready_s"]}
        answer = reply.json()
        if reply.status_code == 200:
            [result] = answer["results"]
            out["samples"] = [{"seed": s["seed"], "reward": s["reward"],
                               "artifacts": {a["name"]: a["shape"] for a in s["artifacts"]}}
                              for s in result["samples"]]
        else:
            out["error"] = answer
        return out
    finally:
        delete_graph(args)


STARTUP_TIMED_OUT = "timed out during startup"   # Ray's fixed 30 s wait for its raylet
STARTS = 3


def start_local_cluster() -> None:
    """`ray.init` of the fresh local cluster; on a machine so loaded that Ray's raylet misses
    Ray's fixed 30 s start-up wait, started again (said on stderr), at most STARTS times."""
    import ray
    for attempt in range(1, STARTS + 1):
        try:
            ray.init(address="local", num_cpus=LOCAL_CPUS, num_gpus=0,
                     object_store_memory=OBJECT_STORE_BYTES, _memory=LOCAL_MEMORY_BYTES,
                     include_dashboard=False, log_to_driver=False, namespace="serve-configs")
            return
        except Exception as exc:  # noqa: BLE001 -- Ray raises a bare Exception for this one
            if STARTUP_TIMED_OUT not in str(exc) or attempt == STARTS:
                raise
            print(f"local cluster start {attempt} of {STARTS}: {exc}; starting again",
                  file=sys.stderr, flush=True)
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("configs", nargs="+", type=Path)
    opts = parser.parse_args(argv)
    import ray
    from ray import serve
    start_local_cluster()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": opts.http_port})
        for path in opts.configs:
            try:
                outcome = _serve_one(path, opts.http_port)
            except Exception as exc:  # noqa: BLE001 -- reported per config, the others still run
                outcome = {"config": path.name, "outcome": "error",
                           "message": "".join(traceback.format_exception(exc))[-4000:]}
            print(json.dumps(outcome), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
