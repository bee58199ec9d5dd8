"""Every command-line entry point reports a user's error (a typed error, a missing file, bad YAML)
as one line on stderr naming the field and the value, exit status 2, never a traceback. Each
entry point runs as the user runs it, in its own process; the processes start together."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU_EXAMPLE = "configs/gpu_example.yaml"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
# eight interpreters importing torch (two of them Ray Serve) at once on a loaded 2-core machine
pytestmark = pytest.mark.timeout(2400)


def _cases(tmp: Path) -> dict[str, tuple[list[str], str, str]]:
    """entry point -> (argv after `python -m`, the line's prefix, what the line must name)."""
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("steps: [1\nsampler: {\n")
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    missing = str(tmp / "missing")
    return {
        "graph": (["graph", GPU_EXAMPLE, str(bad_yaml)], f"{bad_yaml}: ConfigError",
                  "field=config"),
        "trainer": (["trainer", "--config", str(bad_yaml)], "python -m trainer: ConfigError",
                    "field=config"),
        "bench.plan": (["bench.plan", "--config", GPU_EXAMPLE, "--gpus", "64",
                        "--learner-gpus", "many"], "python -m bench.plan: ConfigError",
                       "field=--learner-gpus; expected=\"a number or 'auto'\"; actual='many'"),
        "deployments.manifests": (["deployments.manifests", "--graph", GPU_EXAMPLE, "--cluster",
                                   missing, "--out", str(tmp / "deploy")],
                                  "python -m deployments.manifests: ConfigError",
                                  f"field=cluster; expected='a YAML file'; actual='{missing}'"),
        "scripts.eval_t2va": (["scripts.eval_t2va", "--weights", missing],
                              "python -m scripts.eval_t2va: ConfigError", "field=weights_path"),
        "scripts.pretrain_t2i": (["scripts.pretrain_t2i", "--init-from", missing, "--vae-steps",
                                  "5", "--out", str(tmp / "t2i")],
                                 "python -m scripts.pretrain_t2i: ConfigError",
                                 "field=vae_steps/dit_steps"),
        "scripts.pretrain_t2va": (["scripts.pretrain_t2va", "--init", missing, "--out",
                                   str(tmp / "t2va")], "python -m scripts.pretrain_t2va: "
                                  "ConfigError", "field=weights_path"),
        "testing.tiny_checkpoints": (["testing.tiny_checkpoints", "--family", "sd3", "--out",
                                      str(a_file)], "python -m testing.tiny_checkpoints: "
                                     "FileExistsError", f"actual='{a_file}'"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every entry point started at once (the imports dominate; they overlap)."""
    import os
    tmp = tmp_path_factory.mktemp("cli")
    cases = _cases(tmp)
    env = {**os.environ, **ENV}
    procs = {name: subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, _, _) in cases.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=2000)
        out[name] = (proc.returncode, stdout, stderr, cases[name][1], cases[name][2])
    return out


@pytest.mark.parametrize("entry", ["graph", "trainer", "bench.plan", "deployments.manifests",
                                   "scripts.eval_t2va", "scripts.pretrain_t2i",
                                   "scripts.pretrain_t2va", "testing.tiny_checkpoints"])
def test_entry_point_reports_one_line_and_exits_2(runs, entry):
    code, stdout, stderr, prefix, names = runs[entry]
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stderr
    assert names in lines[0], lines[0]
    if entry == "graph":            # the good config beside the bad one still checks, and says
        assert f"{GPU_EXAMPLE}: ok" in stdout and "not checked here" in stdout, stdout
