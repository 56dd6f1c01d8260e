"""A replica's report on its Envoys round-trips through the shared PostgreSQL, aged by the
database's clock; the reader sees only the other replicas' reports."""

from __future__ import annotations

import time
from functools import partial

from control_plane.drain.envoy_reports import EnvoyAcks, load_reports, save_report
from control_plane.store import open_store


def test_reports_round_trip_and_age(pg_url: str) -> None:
    store = open_store(pg_url, replica_id="a")
    try:
        report = {"n1": EnvoyAcks(2, ("envoy-1",)), "n2": EnvoyAcks(0, ())}
        store.write_sync(partial(save_report, "a", report))
        store.write_sync(partial(save_report, "b", {}))
        time.sleep(0.2)
        [(replica_id, read, old_age_s)] = store.read_sync(partial(load_reports, "b"))
        assert replica_id == "a" and read == report
        assert 0.2 <= old_age_s < 5.0
        store.write_sync(partial(save_report, "a", {}))  # written again: younger, and replaced
        [(_, read, age_s)] = store.read_sync(partial(load_reports, "b"))
        assert read == {} and age_s < old_age_s
        assert [r for r, _, _ in store.read_sync(partial(load_reports, "a"))] == ["b"]
    finally:
        store.close()
