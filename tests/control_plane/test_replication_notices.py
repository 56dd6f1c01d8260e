"""What a replica makes of the other replicas' NOTIFY payloads (`control_plane.replicas.following`):
the kinds to read back, and from which saved beat on (pure; no database)."""

from __future__ import annotations

import math

from control_plane.replicas.following import ALL_KINDS, Notices, everything


def test_kinds_from_other_replicas_are_gathered_and_its_own_ignored() -> None:
    notices = Notices()
    for payload in ("keys b", "nodes b", "regions a", "credentials c", "nonsense b"):
        notices.note(payload, "a")
    assert notices.kinds == {"keys", "nodes", "credentials"}
    assert notices.beats_since == math.inf  # no beats announced: none to read


def test_beats_are_read_from_the_oldest_of_the_saves_announced() -> None:
    notices = Notices()
    notices.note("beats=1764600000.5 b", "a")
    notices.note("beats=1764599999.25 c", "a")
    notices.note("beats=1764600001.0 b", "a")
    notices.note("beats=1.0 a", "a")  # its own save: already in memory
    assert notices.kinds == {"beats"} and notices.beats_since == 1764599999.25


def test_a_save_that_names_no_usable_beat_reads_them_all() -> None:
    for payload in ("beats b", "beats= b", "beats=soon b", "beats=nan b", "beats=inf b"):
        notices = Notices()
        notices.note("beats=1764600000.5 c", "a")
        notices.note(payload, "a")
        assert notices.beats_since == 0.0, payload


def test_after_a_reconnect_everything_is_read() -> None:
    notices = everything()
    assert notices.kinds == set(ALL_KINDS) and notices.beats_since == 0.0


def test_credentials_are_read_for_the_nodes_named_or_all_when_one_names_none() -> None:
    notices = Notices()
    notices.note("credentials=n1 b", "a")
    notices.note("credentials=n2,n3 c", "a")
    notices.note("credentials=n4 a", "a")  # its own mint
    assert notices.kinds == {"credentials"} and notices.credential_ids == {"n1", "n2", "n3"}
    notices.note("credentials b", "a")  # a change too long to name its nodes
    notices.note("credentials=n5 b", "a")
    assert notices.credential_ids is None
    assert everything().credential_ids is None
