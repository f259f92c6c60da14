"""The patched surface (conformance/surface.py) is exactly what the runtime mutants replace, and every name
on it exists where it is listed: a refactor that moves one fails here, naming it, not deep in `make verify`."""
from __future__ import annotations

import pytest

from conformance import mutants
from conformance.surface import PATCHED, resolve, surface_name


def _targets() -> set[str]:
    return {surface_name(obj, attr) for patches in mutants.MUTANTS.values() for obj, attr, _ in patches}


def test_every_mutant_patches_a_name_of_the_surface_and_every_name_is_patched() -> None:
    targets = _targets()
    assert sorted(targets - PATCHED) == [], "patched by a mutant, not on the surface"
    assert sorted(PATCHED - targets) == [], "on the surface, patched by no mutant"


def test_every_name_of_the_surface_exists_where_it_is_listed() -> None:
    gone = []
    for name in sorted(PATCHED):
        try:
            resolve(name)
        except (AttributeError, ImportError, KeyError) as e:
            gone.append(f"{name}: {type(e).__name__}: {e}")
    assert gone == []


def test_a_name_off_the_surface_is_refused() -> None:
    with pytest.raises(LookupError, match="not on the patched surface"):
        with mutants.patched(mutants, "patched", lambda orig: orig):
            pass
