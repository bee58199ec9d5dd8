"""The project's own families (tiny_t2i, tiny_t2va: shipped weights, no diffusers pipeline) pass
the checks every family passes (tests/family_conformance.py FamilyChecks): LoRA targets, the
LoRA file form, engine-vs-learner SDE log-prob parity."""
from __future__ import annotations

from tests.family_conformance import FamilyChecks


class TestTinyT2I(FamilyChecks):
    family = "tiny_t2i"
    guidance_scale = 4.0


class TestTinyT2VA(FamilyChecks):
    family = "tiny_t2va"
    guidance_scale = 4.0
