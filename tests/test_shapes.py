"""The shapes a caller builds by hand refuse a bad value with ``InvalidInput``, never pydantic's error.

``Anchor``, ``Admission``, ``AppendItem``, ``Replacement``, ``StoreConfig``, ``HostSettings``,
``LosslessConfig`` and the store's other records are pydantic models. Called with a bad value they raised
pydantic's ``ValidationError``, the one refusal of the library that was not a class of
``transcript_store.errors``. Calling one now raises ``InvalidInput`` (a ``ValueError`` as before) naming
the field; pydantic's own ``model_validate`` keeps its ``ValidationError``. These tests build no store:
the constructors touch no backend.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_faults_input import ints, json_values, payloads, texts, wrong

import transcript_store
from engines.lossless.config import LosslessConfig
from transcript_store import Admission, Anchor, AppendItem, InvalidInput, Replacement, StoreConfig
from transcript_store.settings import HostSettings
from transcript_store.shapes import Shape

EXAMPLES = int(os.environ.get("FAULT_INPUT_SHAPE_EXAMPLES", "40"))
#: the shapes the README names as built by hand; every other Shape subclass is drawn too
BY_HAND = (Anchor, Admission, AppendItem, Replacement, StoreConfig, HostSettings, LosslessConfig)


def shapes() -> list[type[Shape]]:
    """Every Shape subclass the package and the bundled engines define."""
    found: list[type[Shape]] = []
    todo = list(Shape.__subclasses__())
    while todo:
        cls = todo.pop()
        if not cls.__name__.startswith("_"):
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


def test_every_shape_built_by_hand_refuses_with_a_class_of_the_library() -> None:
    assert transcript_store.InvalidInput is InvalidInput
    assert set(BY_HAND) <= set(shapes())


VALID: dict[str, Any] = {
    "scope": "s", "session_id": "x", "session_key": None, "generation": 0, "entry_id": "E1", "seq": 0,
    "parent_id": None, "position": 0, "incarnation": 1, "turn_id": "T1", "message": {"role": "user", "content": "q"},
    "url": "sqlite:///x.db", "engine": "legacy", "kind": "message",
}


def values_for(cls: type[Shape]) -> st.SearchStrategy[dict[str, Any]]:
    """Some of the fields of ``cls``: valid values mostly, any of them hostile, an unknown key now and then."""
    hostile = st.one_of(json_values, payloads, wrong, texts, ints, st.just(float("inf")), st.just(2**70))
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for name in cls.model_fields:
        valid = st.just(VALID[name]) if name in VALID else hostile
        fields[name] = st.one_of(valid, hostile)
    fields["no_such_field"] = hostile
    return st.fixed_dictionaries({}, optional=fields)


@pytest.mark.parametrize("cls", shapes(), ids=lambda c: c.__name__)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_shape_called_with_anything_builds_or_refuses_with_invalid_input(cls: type[Shape], data: Any) -> None:
    kwargs = data.draw(values_for(cls))
    try:
        built = cls(**kwargs)
    except InvalidInput as e:
        assert str(e).startswith(f"invalid {cls.__name__}")
        return
    assert isinstance(built, cls)


def test_the_refusal_names_the_field_and_nested_fields() -> None:
    anchor = {k: VALID[k] for k in Anchor.model_fields if k in VALID}
    assert Anchor(**anchor).entry_id == "E1"
    with pytest.raises(InvalidInput, match=r"^invalid Anchor: seq: Input should be a valid integer"):
        Anchor(**{**anchor, "seq": "x"})
    with pytest.raises(InvalidInput, match=r"^invalid Admission: anchor\.scope: "):
        Admission(anchor={**anchor, "scope": 5}, turn_id="T1")
    with pytest.raises(InvalidInput, match=r"^invalid AppendItem: entry_id: "):
        AppendItem(message={"role": "user", "content": "q"}, entry_id=b"E1")
    with pytest.raises(InvalidInput, match=r"^invalid StoreConfig: retry_attempts: "):
        StoreConfig(retry_attempts=0)
    # A rule of the shape's own validator: pydantic's "Value error, " is not repeated.
    with pytest.raises(InvalidInput, match=r"^invalid LosslessConfig: target must not exceed threshold$"):
        LosslessConfig(target=0.9, threshold=0.5)
    with pytest.raises(InvalidInput, match=r"^invalid HostSettings: engine: "):
        HostSettings(engine="x\x00")
    with pytest.raises(InvalidInput, match=r"^invalid Replacement: no_such_field: Extra inputs are not permitted"):
        Replacement(entry_id="E1", message={"role": "user", "content": "q"}, no_such_field=1)


def test_model_validate_keeps_pydantics_error_and_nested_shapes_validate_as_before() -> None:
    """Only the call is translated: pydantic's own classmethods keep their documented error."""
    with pytest.raises(ValidationError):
        AppendItem.model_validate({"kind": "nothing"})
    with pytest.raises(ValidationError):
        Anchor.model_validate_json('{"scope": 1}')
    anchor = Anchor(**{k: VALID[k] for k in Anchor.model_fields if k in VALID})
    assert Admission.model_validate_json(Admission(anchor=anchor, turn_id="T1").model_dump_json()).anchor == anchor
    assert isinstance(InvalidInput("x"), ValueError)  # code catching ValueError around a constructor still does
