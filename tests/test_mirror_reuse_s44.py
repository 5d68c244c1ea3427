"""The host transcript mirror and a host that reuses one of its entry ids for another message at a later
position (session 44), on both backends.

The mirror refused such a range as ``cursor`` whenever it held that id at an earlier position it kept:
every re-import of the host's transcript (from its beginning too) failed the same way, for ever, although
integrations/openclaw/README.md says a host id reused for another message is mirrored without copies.
Only the same message named again at a later position is refused (an overlapping page: it would be
shown twice)."""

from __future__ import annotations

import pytest
from conftest import module_store_fixtures
from mirror_helpers import A, a, every_entry, hosted, page, state_of, u, visible

from transcript_store import TranscriptStore
from transcript_store.errors import MirrorConflict

shared_url, store, sid = module_store_fixtures(A, "mirror_reuse_s44")


def test_an_id_reused_after_the_host_renamed_its_message_imports_and_replays(store: TranscriptStore, sid: str) -> None:
    """The host renamed its first message (x -> y, the same text) and gave x to a new message at position 2:
    the mirror's x at 0 is matched by its text, and the new message goes under an id derived from x. The
    same import again adds nothing."""
    page(store, sid, None, "c1", hosted(("x", u("hi")), ("b", a("yo"))))
    moved = hosted(("y", u("hi")), ("b", a("yo")), ("x", u("new")))
    done = page(store, sid, None, "c2", moved)  # was: MirrorConflict cursor, on every try
    assert (done.imported, done.matched, done.rewound) == (1, 2, False)
    shown = visible(store, sid)
    assert [m for _, m in shown] == [u("hi"), a("yo"), u("new")]
    assert [e for e, _ in shown][:2] == ["x", "b"] and shown[2][0] != "x"
    before = every_entry(store, sid)
    again = page(store, sid, None, "c2", moved)
    assert (again.imported, again.matched) == (0, 3)
    assert every_entry(store, sid) == before and state_of(store, sid) == ("c2", 3)


def test_an_id_reused_for_another_message_on_a_later_page_imports_and_replays(
    store: TranscriptStore, sid: str
) -> None:
    """The host's id x names a message at 0 and another at 2, read on two pages: the second page was refused
    (``cursor``), and so was every re-import from the beginning. Now it lands once; a re-import matches."""
    page(store, sid, None, "c1", hosted(("x", u("hi")), ("b", a("yo"))))
    page(store, sid, "c1", "c2", hosted(("x", u("other"))))
    assert [m for _, m in visible(store, sid)] == [u("hi"), a("yo"), u("other")]
    before = every_entry(store, sid)
    assert page(store, sid, None, "c1", hosted(("x", u("hi")), ("b", a("yo")))).imported == 0
    assert page(store, sid, "c1", "c2", hosted(("x", u("other")))).imported == 0
    assert every_entry(store, sid) == before and state_of(store, sid) == ("c2", 3)


def test_the_same_message_named_again_later_is_still_refused_naming_both_positions(
    store: TranscriptStore, sid: str
) -> None:
    """An overlapping page (the same message, under its id, one position on) is still refused: it would show
    that message twice. The error names the id and both positions, and says what to do; nothing is written."""
    page(store, sid, None, "c1", hosted(("x", u("hi")), ("b", a("yo"))))
    before = every_entry(store, sid)
    with pytest.raises(MirrorConflict) as refused:
        page(store, sid, "c1", "c2", hosted(("x", u("hi"))))
    assert refused.value.reason == "cursor"
    text = str(refused.value)
    assert "'x'" in text and "position 0" in text and "position 2" in text
    assert "resume point" in text
    assert every_entry(store, sid) == before and state_of(store, sid) == ("c1", 2)
