"""runtime/busypoll.py: the front polls without sleeping only while replies are due.

Judged by the CPU time the selector burns (time.process_time), not by how
fast anything is: a spinning window costs CPU, a sleeping one does not.
"""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from runtime.busypoll import BusyPollSelector, event_loop_factory

WINDOW = 0.05


@pytest.fixture
def pair():
    reader, writer = socket.socketpair()
    yield reader, writer
    reader.close()
    writer.close()


def cpu_of(call) -> tuple[float, object]:
    started = time.process_time()
    result = call()
    return time.process_time() - started, result


def test_sleeps_when_no_reply_is_due(pair):
    selector = BusyPollSelector(WINDOW)
    selector.register(pair[0], 1)  # selectors.EVENT_READ
    cpu, events = cpu_of(lambda: selector.select(0.2))
    assert events == [] and cpu < 0.02, f"burnt {cpu:.3f} s of CPU with nothing awaited"


def test_polls_through_the_window_while_replies_are_due(pair):
    selector = BusyPollSelector(WINDOW)
    selector.register(pair[0], 1)
    selector.poll_while(lambda: True)
    cpu, events = cpu_of(lambda: selector.select(0.2))
    assert events == [] and cpu >= 0.005, f"only {cpu:.4f} s of CPU: the window was slept through"


def test_zero_window_always_sleeps(pair):
    selector = BusyPollSelector(0)
    selector.register(pair[0], 1)
    selector.poll_while(lambda: True)
    cpu, events = cpu_of(lambda: selector.select(0.2))
    assert events == [] and cpu < 0.02


def test_stops_polling_once_nothing_is_due(pair):
    selector = BusyPollSelector(10.0)  # a window far longer than the test
    selector.register(pair[0], 1)
    due = iter([True, True, False])
    selector.poll_while(lambda: next(due, False))
    started = time.monotonic()
    assert selector.select(0.3) == []
    assert time.monotonic() - started < 5, "kept polling after replies stopped being due"


def test_returns_ready_descriptors_from_the_window(pair):
    reader, writer = pair
    selector = BusyPollSelector(WINDOW)
    key = selector.register(reader, 1)
    selector.poll_while(lambda: True)
    writer.send(b"x")
    events = selector.select(1.0)
    assert [(k.fd, mask) for k, mask in events] == [(key.fd, 1)]


def test_event_loop_runs_over_the_selector(pair):
    selector = BusyPollSelector(WINDOW)
    selector.poll_while(lambda: True)

    async def read_one() -> bytes:
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        loop.add_reader(pair[0].fileno(), lambda: got.set_result(pair[0].recv(1)))
        loop.call_later(0.1, pair[1].send, b"y")
        try:
            return await got
        finally:
            loop.remove_reader(pair[0].fileno())

    with asyncio.Runner(loop_factory=event_loop_factory(selector)) as runner:
        assert runner.run(read_one()) == b"y"


def test_a_turn_with_callbacks_ready_does_not_ask_whether_replies_are_due(pair):
    """The loop passes timeout 0 when it has callbacks to run: that turn must stay cheap."""
    def asked():
        raise AssertionError("asked whether replies are due on a turn that cannot wait")

    selector = BusyPollSelector(WINDOW)
    selector.register(pair[0], 1)
    selector.poll_while(asked)
    assert selector.select(0) == []
