"""Entry points besides HTTP: the trainer CLI's config and --set overrides, prompt (dataset)
files, and the Serve config file. Random and malformed input gives a typed ConfigError /
DatasetError naming the field or file:line, never another exception or a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract import ConfigError, DatasetError

REPO = Path(__file__).resolve().parent.parent
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

SCALARS = (st.none() | st.booleans() | st.integers() | st.sampled_from([2**64, -1, 0, 10**30])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
TEXT = (st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1"))
        | st.sampled_from(["[" * 5000, "a: &x [1]\nb: *x\n", "{a: 1, a: 2}", "- !!python/object:os.system x",
                           "steps: [1\n", "\t- x", "%YAML 9.9\n---\n", "a: b: c"]))


def _keys(model) -> list[str]:
    return sorted(model.model_fields)


# ---- trainer config and --set --------------------------------------------------------------
@st.composite
def _trainer_data(draw) -> dict:
    from trainer.config import SamplerSettings, TrainerConfig
    data = {}
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(_keys(TrainerConfig) + ["bogus"]))
        data[key] = draw(VALUES | st.dictionaries(st.sampled_from(_keys(SamplerSettings)),
                                                  SCALARS, max_size=3))
    return data


@st.composite
def _overrides(draw) -> dict:
    from trainer.config import TrainerConfig
    parts = st.sampled_from(_keys(TrainerConfig) + ["num_steps", "mode", "", "x"])
    keys = draw(st.lists(st.lists(parts, min_size=1, max_size=3).map(".".join), max_size=3))
    return {k: draw(VALUES) for k in keys}


def test_trainer_config_and_overrides_raise_only_config_errors():
    from trainer.config import TrainerConfig, load_trainer_config

    @FUZZ
    @given(_trainer_data(), _overrides())
    def case(data, overrides):
        try:
            cfg = load_trainer_config(data, overrides)
        except ConfigError as err:
            assert err.field, err
            return
        assert isinstance(cfg, TrainerConfig)

    case()


def test_trainer_config_files_raise_only_config_errors(tmp_path):
    from trainer.config import load_trainer_config
    path = tmp_path / "train.yaml"

    @FUZZ
    @given(TEXT | st.binary(max_size=64))
    def case(content):
        path.write_bytes(content if isinstance(content, bytes)
                         else content.encode("utf-8", "surrogatepass"))
        try:
            load_trainer_config(path)
        except ConfigError as err:
            assert err.field, err

    case()


@pytest.mark.parametrize("argv, field", [
    (["--set", "steps=abc"], "steps"),
    (["--set", "sampler.num_steps=[1"], "sampler.num_steps"),
    (["--set", "nonsense"], "--set"),
    (["--set", "steps.deeper=3"], "steps.deeper"),
    (["--set", "graph.encoder.etp=0"], "graph.encoder.etp"),
    (["--config", "configs/no_such_file.yaml"], "config"),
])
def test_trainer_cli_reports_the_field_and_exits_2(argv, field, capsys):
    from trainer.__main__ import main
    if "graph.encoder.etp=0" in argv:      # an inline graph the override reaches into
        argv = ["--set", "graph={app_name: x}", *argv]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Error" in err and f"field={field}" in err and "Traceback" not in err, err


def test_trainer_cli_process_prints_no_traceback(tmp_path):
    bad = tmp_path / "train.yaml"
    bad.write_text("steps: 3\nsampler: {num_steps: 1}\n")
    run = subprocess.run([sys.executable, "-m", "trainer", "--config", str(bad)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "ConfigError" in run.stderr and "field=sampler.num_steps" in run.stderr
    assert "Traceback" not in run.stderr


# ---- prompt files ---------------------------------------------------------------------------
JSONL_RECORD = st.fixed_dictionaries({}, optional={
    "prompt": VALUES, "negative_prompt": VALUES, "metadata": VALUES | st.text(max_size=20),
    "image": VALUES, "video": st.text(max_size=10), "bogus": SCALARS})


@st.composite
def _jsonl(draw) -> bytes:
    lines = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.integers(0, 5))
        if kind == 0:
            lines.append(draw(TEXT))                          # not JSON, or JSON not an object
        elif kind == 1:
            lines.append("[" * draw(st.integers(1, 5000)))
        else:
            lines.append(json.dumps(draw(JSONL_RECORD), allow_nan=True))
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def test_prompt_files_raise_only_dataset_errors(tmp_path):
    from trainer.datasets import load_prompt_file

    @FUZZ
    @given(st.sampled_from([".txt", ".jsonl", ".json", ""]),
           _jsonl() | TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))
           | st.binary(max_size=100))
    def case(suffix, content):
        path = tmp_path / f"prompts{suffix}"
        path.write_bytes(content)
        try:
            records = load_prompt_file(path)
        except DatasetError as err:
            assert str(path) in err.field, err                # names the file (and line)
            return
        assert records and all(r.text.strip() for r in records)

    case()


def test_parquet_prompt_files_raise_only_dataset_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.datasets import load_prompt_file
    path = tmp_path / "prompts.parquet"

    @FUZZ
    @given(st.lists(JSONL_RECORD, min_size=1, max_size=3) | st.binary(max_size=60))
    def case(rows):
        if isinstance(rows, bytes):
            path.write_bytes(rows)                            # not a parquet file at all
        else:
            try:
                pq.write_table(pa.Table.from_pylist(rows), path)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                return                                        # rows pyarrow cannot store
        try:
            records = load_prompt_file(path)
        except DatasetError as err:
            assert str(path) in err.field, err
            return
        assert records and all(r.text.strip() for r in records)

    case()


# ---- the Serve config file ------------------------------------------------------------------
@st.composite
def _serve_config(draw) -> str:
    from deployments.config import GraphConfig
    args = {draw(st.sampled_from(_keys(GraphConfig) + ["bogus"])): draw(VALUES)
            for _ in range(draw(st.integers(0, 3)))}
    app = draw(st.sampled_from([{"name": "omni", "import_path": "graph:build_app", "args": args},
                                {"args": draw(VALUES)}, draw(VALUES)]))
    doc = draw(st.sampled_from([{"applications": [app]}, {"applications": draw(VALUES)}, args]))
    return yaml.safe_dump(doc, allow_unicode=True)


def test_serve_config_files_raise_only_config_errors(tmp_path):
    from deployments.config import GraphConfig, load_graph_config
    path = tmp_path / "graph.yaml"

    @FUZZ
    @given(_serve_config() | TEXT)
    def case(text):
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            assert isinstance(load_graph_config(path), GraphConfig)
        except ConfigError as err:
            assert err.field, err

    case()


def test_serve_config_check_names_the_field_and_exits_2(tmp_path, capsys):
    """`python -m graph CONFIG`: the build `serve run` does, without its traceback."""
    from graph import main
    bad = tmp_path / "bad.yaml"
    serve_form = yaml.safe_load((REPO / "configs" / "tiny_t2i.yaml").read_text())
    serve_form["applications"][0]["args"]["limits"]["max_prompts"] = "many"
    bad.write_text(yaml.safe_dump(serve_form))
    assert main([str(REPO / "configs" / "tiny_t2i.yaml"), str(bad)]) == 2
    out = capsys.readouterr()
    assert "tiny_t2i.yaml: ok" in out.out
    assert "ConfigError" in out.err and "field=limits.max_prompts" in out.err
    assert "Traceback" not in out.err
