"""The family table (adapters/families.py): one entry per family, each resolving to what it names,
and the registry, `auto` and the tiny-checkpoint script reading it (no second table)."""
from __future__ import annotations

import pytest
from pydantic import BaseModel

from adapters.families import (FAMILIES, FAMILY_OF_PIPELINE, TINY_CHECKPOINTS, family_entry,
                               resolve)
from adapters.family import CheckpointFamily, ModelFamily
from adapters.registry import family_name
from contract import ConfigError
from testing.tiny_checkpoints import PIPELINE_CLASSES, SAMPLE_SIZES, Family


def test_each_name_and_pipeline_class_is_registered_once():
    names = [entry.name for entry in FAMILIES]
    assert len(set(names)) == len(names)
    classes = [cls for entry in FAMILIES for cls in entry.pipeline_classes]
    assert len(set(classes)) == len(classes) == len(FAMILY_OF_PIPELINE)
    tiny = [t.name for entry in FAMILIES for t in entry.tiny_checkpoints]
    assert len(set(tiny)) == len(tiny) == len(TINY_CHECKPOINTS)


@pytest.mark.parametrize("entry", FAMILIES, ids=lambda e: e.name)
def test_every_entry_resolves_to_what_it_names(entry):
    family = entry.family_class
    assert issubclass(family, ModelFamily)
    assert issubclass(entry.options_model, BaseModel)
    if entry.embedded:
        assert not entry.pipeline_classes and not entry.tiny_checkpoints
    else:
        assert entry.pipeline_classes
    if issubclass(family, CheckpointFamily):          # its constructor reads this entry
        assert family.entry_name == entry.name
    for tiny in entry.tiny_checkpoints:
        assert (tiny.builder is None) != (tiny.writer is None)    # one way to make it
        assert callable(resolve(tiny.writer or tiny.builder))
        assert tiny.pipeline_class in entry.pipeline_classes      # `auto` finds its family
        assert FAMILY_OF_PIPELINE[tiny.pipeline_class] == entry.name


def test_the_checkpoint_script_reads_the_table():
    assert [f.value for f in Family] == list(TINY_CHECKPOINTS)
    assert all(SAMPLE_SIZES[f] == TINY_CHECKPOINTS[f.value].sample_size and
               PIPELINE_CLASSES[f] == TINY_CHECKPOINTS[f.value].pipeline_class for f in Family)


def test_unknown_names_and_classes_are_typed_errors(tmp_path):
    with pytest.raises(ConfigError) as err:
        family_entry("no_such_family")
    assert (err.value.field, err.value.actual) == ("adapter", "no_such_family")
    with pytest.raises(ConfigError) as err:
        family_name("no_such_family", tmp_path)
    assert err.value.field == "adapter"
    with pytest.raises(ConfigError) as err:
        family_entry("sd3").pipeline_class_of({"_class_name": "FluxPipeline"})
    assert (err.value.field, err.value.actual) == ("weights_path", "FluxPipeline")


def _write_folder(root, seed):
    (root / "sd3").mkdir()
    (root / "sd3" / "model_index.json").write_text(f'{{"seed": {seed}}}')
    return root / "sd3"


def _write_elsewhere(root, seed):
    (root / "other").mkdir()
    return root / "other"


def test_a_writer_entry_writes_its_own_layout_atomically(tmp_path, monkeypatch):
    """A checkpoint whose layout no pipeline class saves (a modular pipeline's) is written by
    its entry's writer, renamed into place; a writer that wrote elsewhere leaves nothing."""
    import dataclasses

    from testing import tiny_checkpoints
    sd3 = TINY_CHECKPOINTS["sd3"]
    for writer in ("_write_folder", "_write_elsewhere"):
        entry = dataclasses.replace(sd3, builder=None, writer=f"tests.test_family_table:{writer}")
        monkeypatch.setattr(tiny_checkpoints, "tiny_entry", lambda family, e=entry: e)
        if writer == "_write_folder":
            path = tiny_checkpoints.build("sd3", tmp_path / "ok", seed=3)
            assert (path / "model_index.json").read_text() == '{"seed": 3}'
            assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["sd3"]
        else:
            with pytest.raises(FileNotFoundError):
                tiny_checkpoints.build("sd3", tmp_path / "bad")
            assert list((tmp_path / "bad").iterdir()) == []
