"""The mutation run (scripts/mutation_check.py) can only mean something while each mutation's
text is still in the tree: a refactor that moves a core computation must move its mutation with
it, or the row would be a mutation of nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from scripts.mutation_check import MUTATIONS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_changes_text_found_once_and_names_default_tier_tests(mutation):
    text = (ROOT / mutation.path).read_text()
    assert text.count(mutation.original) == 1, (mutation.name, mutation.path)
    assert mutation.mutated != mutation.original
    mutated = text.replace(mutation.original, mutation.mutated)
    compile(mutated, mutation.path, "exec")          # a mutation still parses: tests, not syntax
    for test in mutation.tests:
        assert (ROOT / test.split("::")[0]).is_file(), (mutation.name, test)
