"""ExplicitLayout: units an engine placed itself, checked, and carried through JSON."""

import dataclasses
import json

import pytest

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.cache.head_units import KVUnit, StateUnit
from transfer.errors import InvalidInput
from transfer.geometry import GDNSpec, GQASpec, LayerSpec, ModelGeometry, Role

GEOMETRY = ModelGeometry(
    "explicit-test",
    (
        LayerSpec(0, GDNSpec(1, 1, 4, 4, 4)),
        LayerSpec(1, GQASpec(2, 1, 8)),
    ),
    hidden_size=16,
)
BLOCK, BLOCKS, PAGE = 4, 3, 256


def _units():
    # Attention page: [token][K|V] of one head, 8 bf16 each; state page: conv (time-major)
    # then SSM, like vLLM's pages.
    kv = (
        KVUnit(1, "k", 0, 0, 16, 0, PAGE, 32),
        KVUnit(1, "v", 0, 0, 16, 16, PAGE, 32),
    )
    conv = [StateUnit(0, "conv", Role.CONV, s, 0, 4, 3, 2, 8 * s, PAGE, 2, 24) for s in range(3)]
    ssm = StateUnit(0, "ssm", Role.SSM, 0, 0, 16, 1, 4, 72, PAGE, 4, 4)
    return kv, (ssm, *conv)


def _layout(**changes):
    kv, state = _units()
    fields = dict(kv=kv, state=state, extent=BLOCKS * PAGE, engine="test")
    fields.update(changes)
    return ExplicitLayout(GEOMETRY, 1, 0, BLOCK, BLOCKS, BLOCKS, **fields)


def test_round_trip_through_json():
    layout = _layout()
    again = ExplicitLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout
    assert again.kv_units() == layout.kv and again.state_units() == layout.state
    assert layout.arena_bytes == BLOCKS * PAGE


def test_units_outside_the_extent_are_refused():
    kv, _ = _units()
    far = (dataclasses.replace(kv[0], base=PAGE - 8), kv[1])
    with pytest.raises(InvalidInput, match=r"explicit layout.kv: layer 1 k head 0"):
        _layout(kv=far)


def test_missing_tensors_are_named():
    kv, state = _units()
    with pytest.raises(InvalidInput, match=r"explicit layout.state: units cover"):
        _layout(state=state[1:])
    with pytest.raises(InvalidInput, match=r"explicit layout.kv"):
        _layout(kv=kv[:1])


def test_malformed_dict_names_the_field():
    data = _layout().to_dict()
    data["explicit"]["kv"] = [[1, 2]]
    with pytest.raises(InvalidInput, match=r"layout.explicit: malformed units"):
        ExplicitLayout.from_dict(data)
    del data["explicit"]
    with pytest.raises(InvalidInput, match=r"layout.explicit: missing"):
        ExplicitLayout.from_dict(data)
