"""The picker's book of the region's nodes: their reported load, and what the picker sent them
that no report counts yet (pending until the response starts; prompt tokens for REPORT_LAG_S,
except those of the prompt's own prefix)."""

from __future__ import annotations

from region_picker.node_book import REPORT_LAG_S, NodeBook
from wire.region_nodes import NodeLoad, RegionNodes


def document(**running_prefill: int) -> RegionNodes:
    return RegionNodes(
        index=1,
        region="us-east",
        nodes=tuple(
            NodeLoad(
                node_id=name,
                url=f"http://127.0.0.1:{9001 + i}",
                model="m",
                block_size=16,
                kv_blocks_total=100,
                kv_blocks_free=100,
                num_running_prefill_tokens=tokens,
                step_s=0.02 * (i + 1),
            )
            for i, (name, tokens) in enumerate(running_prefill.items())
        ),
    )


def test_a_send_counts_until_the_report_can_and_the_report_counts_admitted_prefill() -> None:
    now = [0.0]
    book = NodeBook(clock=lambda: now[0])
    book.adopt(document(a=700, b=0))
    book.note_sent("b", 1500)
    book.note_started("b")  # a stream: its headers came back before its prefill
    loads = {c.node_id: c for c in book.candidates("m")}
    assert loads["a"].num_running_prefill_tokens == 700 and loads["a"].num_sent_prefill_tokens == 0
    assert loads["b"].num_sent_prefill_tokens == 1500 and loads["b"].num_pending == 0
    assert (loads["a"].step_s, loads["b"].step_s) == (0.02, 0.04)  # as reported
    now[0] = REPORT_LAG_S / 2
    book.note_sent("b", 100)
    assert {c.node_id: c.num_sent_prefill_tokens for c in book.candidates("m")}["b"] == 1600
    now[0] = REPORT_LAG_S + 0.1  # the first send is in b's reports by now
    loads = {c.node_id: c for c in book.candidates("m")}
    assert loads["b"].num_sent_prefill_tokens == 100 and loads["b"].num_pending == 1


def test_sends_of_the_prompts_own_prefix_are_no_work_ahead_of_it() -> None:
    book = NodeBook(clock=lambda: 0.0)
    book.adopt(document(a=0))
    book.note_sent("a", 700, prefix=b"tenant-1")
    book.note_sent("a", 300, prefix=b"tenant-2")
    book.note_sent("a", 50)  # a prompt too short to hash
    sent = {p: book.candidates("m", p)[0].num_sent_prefill_tokens for p in (b"tenant-1", None)}
    assert sent == {b"tenant-1": 350, None: 1050}
