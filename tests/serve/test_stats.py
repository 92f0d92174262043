"""`print(f.stats())` is a readable table, one figure a line; `repr()` and the fields
stay as they are."""

from __future__ import annotations

from collections import deque
from typing import Any

from batchkit.serve.dispatch.rule import DispatchReason
from batchkit.serve.stats import StatsRecorder


def recorded(**changes: Any) -> StatsRecorder:
    recorder = StatsRecorder(
        requests=40,
        batches=3,
        calls=4,
        items_run=40,
        rejected=2,
        shed=1,
        batch_sizes={8: 1, 16: 2},
        reasons={DispatchReason.FULL: 2, DispatchReason.IDLE: 1},
        queue_wait=deque([0.001, 0.002, 0.004]),
        batch_latency=deque([0.010, 0.012, 0.020]),
    )
    for name, value in changes.items():
        setattr(recorder, name, value)
    return recorder


def test_stats_print_as_a_table_of_short_lines() -> None:
    stats = recorded().snapshot(queue_depth=5, in_flight=1, caps={})
    text = str(stats)
    lines = text.splitlines()
    assert lines[0] == "Stats"
    assert max(len(line) for line in lines) <= 80
    assert len(repr(stats)) > 500 and "\n" not in repr(stats)  # the fields, as they are
    by_name = {line.split("  ")[1].strip(): line for line in lines[1:] if line.strip()}
    assert "40 admitted; rejected: 2, shed: 1" in by_name["requests"]
    assert "3 (calls 4), mean size 13.3" in by_name["batches"]
    assert by_name["batch sizes"].endswith("8: 1, 16: 2")
    assert by_name["dispatched"].endswith("full: 2, idle: 1")
    assert by_name["now"].endswith("5 waiting, 1 batches running")
    assert by_name["queue wait"].split()[2:] == ["2", "3.6", "3.96", "4", "(3)"]
    assert "first chunk" not in text and "latency model" not in text  # nothing to show


def test_what_a_function_does_not_use_is_left_out_and_empty_windows_show_dashes() -> None:
    text = str(StatsRecorder().snapshot(queue_depth=0, in_flight=0, caps={}))
    assert "none refused, timed out or failed" in text
    assert "errors" not in text and "group" not in text
    assert "-        -        -        -  (0)" in text


def test_errors_and_groups_are_shown_when_they_happened() -> None:
    recorder = recorded(oom_splits=2, isolated=1)
    recorder.record_group_request("a")
    text = str(recorder.snapshot(queue_depth=0, in_flight=0, caps={"default": 4}))
    assert "oom splits 2, isolated 1, caps default: 4" in text
    assert "group 'a'" in text and "1 requests, 0 batches" in text
