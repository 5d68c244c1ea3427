"""The shapes a caller builds by hand refuse a bad value with ``InvalidInput``, never pydantic's error.

``Anchor``, ``Admission``, ``AppendItem``, ``Replacement``, ``StoreConfig``, ``HostSettings``,
``LosslessConfig`` and the store's other records are pydantic models. Called with a bad value they raised
pydantic's ``ValidationError``, the one refusal of the library that was not a class of
``transcript_store.errors``. Calling one now raises ``InvalidInput`` (a ``ValueError`` as before) naming
the field; pydantic's own ``model_validate`` keeps its ``ValidationError``. These tests build no store:
the constructors touch no backend.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_faults_input import ints, json_values, payloads, texts, weighted, wrong
from workers.fault_worker import report

import transcript_store
from engines.lossless.config import LosslessConfig
from transcript_store import Admission, Anchor, AppendItem, InvalidInput, Replacement, StoreConfig
from transcript_store.settings import HostSettings
from transcript_store.shapes import Shape

EXAMPLES = int(os.environ.get("FAULT_INPUT_SHAPE_EXAMPLES", "25"))
SLOW_EXAMPLES = 1000
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
    "parent_id": None, "position": 0, "incarnation": 1, "idempotency_key": None, "turn_id": "T1",
    "message": {"role": "user", "content": "q"}, "url": "sqlite:///x.db", "engine": "legacy", "kind": "message",
}
VALID["anchor"] = {k: VALID[k] for k in Anchor.model_fields}


def values_for(cls: type[Shape]) -> st.SearchStrategy[dict[str, Any]]:
    """The fields of ``cls``: those with a known valid value valid 5 draws in 6 (so a call with one
    hostile field gets past the others), the rest drawn hostile or left out, an unknown key 1 in 8."""
    hostile = st.one_of(json_values, payloads, wrong, texts, ints, st.just(float("inf")), st.just(2**70))
    known = {name: weighted(st.just(VALID[name]), hostile, 6) for name in cls.model_fields if name in VALID}
    unknown = {name: hostile for name in cls.model_fields if name not in VALID}
    odd = st.dictionaries(st.one_of(st.just("no_such_field"), texts), hostile, min_size=1, max_size=2)
    extra = weighted(st.just({}), odd, 8)
    return st.builds(lambda a, b: {**a, **b}, st.fixed_dictionaries(known, optional=unknown), extra)


def shapes_campaign(request: pytest.FixtureRequest, examples: int) -> None:
    """Every shape called ``examples`` times with drawn fields: it builds, or refuses with InvalidInput."""
    started = time.monotonic()
    figures: dict[str, dict[str, int]] = {}

    def hypothesis_test(cls: type[Shape]) -> Callable[[], None]:
        counts = figures.setdefault(cls.__name__, {"calls": 0, "refused": 0})

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            kwargs = data.draw(values_for(cls))
            counts["calls"] += 1
            try:
                built = cls(**kwargs)
            except InvalidInput as e:
                assert str(e).startswith(f"invalid {cls.__name__}"), e
                assert str(e).isprintable(), f"an error message that is not one printable line: {e!r}"
                counts["refused"] += 1
                return
            assert isinstance(built, cls)

        return run

    for cls in shapes():
        hypothesis_test(cls)()
        if cls in BY_HAND:
            # One call with every known field valid builds (drawn, all 25 calls of a shape with many fields
            # could be refused by chance: each field is hostile 1 draw in 6).
            assert isinstance(cls(**{n: VALID[n] for n in cls.model_fields if n in VALID}), cls)
            figures[cls.__name__]["calls"] += 1
    total = sum(c["calls"] for c in figures.values())
    refused = sum(c["refused"] for c in figures.values())
    report(request, "none", {
        "shapes": len(figures), "examples_per_shape": examples, "calls": total, "refusals": refused,
        "built": total - refused, "untyped_errors": 0, "seconds": round(time.monotonic() - started, 1),
    })
    assert all(c["calls"] >= examples for c in figures.values()), figures
    assert all(c["calls"] > c["refused"] for n, c in figures.items() if n in {b.__name__ for b in BY_HAND}), figures


def test_a_shape_called_with_anything_builds_or_refuses_with_invalid_input(request: pytest.FixtureRequest) -> None:
    shapes_campaign(request, EXAMPLES)


@pytest.mark.slow
def test_a_shape_called_with_anything_1000_examples_per_shape(request: pytest.FixtureRequest) -> None:
    shapes_campaign(request, SLOW_EXAMPLES)


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
    # An unknown key a caller made up is quoted: the message stays one printable line.
    with pytest.raises(InvalidInput, match=r"^invalid Replacement: '\\x1b\[2J\\n': Extra inputs"):
        Replacement(entry_id="E1", message={"role": "user", "content": "q"}, **{"\x1b[2J\n": 1})


def test_model_validate_keeps_pydantics_error_and_nested_shapes_validate_as_before() -> None:
    """Only the call is translated: pydantic's own classmethods keep their documented error."""
    with pytest.raises(ValidationError):
        AppendItem.model_validate({"kind": "nothing"})
    with pytest.raises(ValidationError):
        Anchor.model_validate_json('{"scope": 1}')
    anchor = Anchor(**{k: VALID[k] for k in Anchor.model_fields if k in VALID})
    assert Admission.model_validate_json(Admission(anchor=anchor, turn_id="T1").model_dump_json()).anchor == anchor
    assert isinstance(InvalidInput("x"), ValueError)  # code catching ValueError around a constructor still does


def test_an_anchor_takes_numbers_as_ints_only() -> None:
    """``Anchor`` is strict: ``seq="1"``, ``seq=True`` or ``generation=1.0`` is refused with InvalidInput.
    Coerced, ``True`` became the anchor of the entry at seq 1, which the caller never named; a fence
    inside an HTTP request (``{"seq": "1"}``) read the same way."""
    anchor = {k: VALID[k] for k in Anchor.model_fields if k in VALID}
    for name, bad in (("seq", "1"), ("seq", True), ("seq", 1.0), ("generation", False), ("generation", "0"),
                      ("position", "0"), ("position", True), ("incarnation", True), ("incarnation", "1"),
                      ("entry_id", 1)):
        with pytest.raises(InvalidInput, match=rf"^invalid Anchor: {name}: "):
            Anchor(**{**anchor, name: bad})
        with pytest.raises(InvalidInput, match=rf"^invalid Admission: anchor\.{name}: "):
            Admission(anchor={**anchor, name: bad}, turn_id="T1")
        with pytest.raises(ValidationError):
            Anchor.model_validate_json(json.dumps({**anchor, name: bad}))
    # What the store and its callers build: ints, and an anchor stored as JSON reads back.
    built = Anchor(**{**anchor, "seq": 3, "position": None, "incarnation": None})
    assert Anchor.model_validate_json(built.model_dump_json()) == built
    assert Admission(anchor=built.model_dump(), turn_id="T1").anchor == built
