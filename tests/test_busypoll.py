"""runtime/busypoll.py: the front polls without sleeping only after a request, while its reply is due.

Judged by the CPU time the event loop burns (time.process_time), not by how
fast anything is: a spinning window costs CPU, a sleeping one does not. Each
test runs on both event loops the front can use (EVENT_LOOP).
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvloop

from runtime import busypoll
from runtime.busypoll import BusyPoller

WINDOW = 0.05


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Runs a coroutine function on a fresh loop of each kind; returns (CPU seconds, its result)."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def run_and_measure(coroutine_function):
        with asyncio.Runner(loop_factory=factory) as runner:
            started = time.process_time()
            result = runner.run(coroutine_function())
            return time.process_time() - started, result

    return run_and_measure


def test_an_idle_loop_sleeps(run):
    poller = BusyPoller(WINDOW, lambda: True)

    async def idle():
        await asyncio.sleep(0.2)
        return poller.spinning

    cpu, spinning = run(idle)
    assert not spinning and cpu < 0.02, f"burnt {cpu:.3f} s of CPU with nothing sent"


def test_polls_through_the_window_after_a_request_then_sleeps(run):
    poller = BusyPoller(WINDOW, lambda: True)

    async def armed():
        poller.arm()
        await asyncio.sleep(0.3)
        return poller.spinning

    cpu, spinning = run(armed)
    assert cpu >= 0.005, f"only {cpu:.4f} s of CPU: the window was slept through"
    assert cpu < 0.2 and not spinning, f"{cpu:.3f} s of CPU: kept polling past the {WINDOW} s window"


def test_zero_window_never_polls(run):
    poller = BusyPoller(0, lambda: True)

    async def armed():
        poller.arm()
        spinning = poller.spinning
        await asyncio.sleep(0.2)
        return spinning

    cpu, spinning = run(armed)
    assert not spinning and cpu < 0.02


def test_stops_polling_once_no_reply_is_due(run):
    due = iter([True, True, False])
    poller = BusyPoller(10.0, lambda: next(due, False))  # a window far longer than the test

    async def armed():
        poller.arm()
        await asyncio.sleep(0.2)
        return poller.spinning

    cpu, spinning = run(armed)
    assert not spinning and cpu < 0.05, "kept polling after replies stopped being due"


def test_arming_again_extends_the_window_without_a_second_poller(run):
    turns = 0

    def due() -> bool:
        nonlocal turns
        turns += 1
        return True

    poller = BusyPoller(WINDOW, due)

    async def armed_twice():
        poller.arm()
        await asyncio.sleep(0)
        poller.arm()
        await asyncio.sleep(0)  # one turn of the loop: one poller asks once
        before = turns
        await asyncio.sleep(0)
        return turns - before

    _, turns_in_one_loop_turn = run(armed_twice)
    assert turns_in_one_loop_turn == 1


def burn_cpu(seconds: float) -> None:
    """Uses `seconds` of this thread's CPU, as a callback serving another call would."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


@pytest.fixture
def yields(monkeypatch):
    """Counts the poller's sched_yield calls instead of making them."""
    counted = [0]

    def sched_yield() -> None:
        counted[0] += 1

    monkeypatch.setattr(busypoll.os, "sched_yield", sched_yield)
    return counted


def test_turns_of_an_otherwise_idle_loop_yield_the_cpu(run, yields):
    # The worker owing the reply may be waiting for this very CPU.
    poller = BusyPoller(0.02, lambda: True)

    async def armed():
        poller.arm()
        await asyncio.sleep(0.05)

    run(armed)
    assert yields[0] > 0, "polled an idle loop without ever giving the CPU up"


def test_turns_of_a_loop_busy_with_other_calls_keep_the_cpu(run, yields):
    poller = BusyPoller(0.02, lambda: True)

    async def busy():
        loop = asyncio.get_running_loop()
        stop = time.perf_counter() + 0.05

        def other_call():  # 200 µs of CPU on every turn of the loop, past the window
            burn_cpu(200e-6)
            if time.perf_counter() < stop:
                loop.call_soon(other_call)

        loop.call_soon(other_call)
        poller.arm()
        await asyncio.sleep(0.08)

    run(busy)
    assert yields[0] == 0, f"yielded {yields[0]} times while the loop had other calls to serve"


def test_descriptors_are_served_while_polling(run):
    reader, writer = socket.socketpair()
    poller = BusyPoller(1.0, lambda: True)

    async def read_one() -> bytes:
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        loop.add_reader(reader.fileno(), lambda: got.set_result(reader.recv(1)))
        poller.arm()
        loop.call_later(0.05, writer.send, b"y")
        try:
            return await asyncio.wait_for(got, 5)
        finally:
            loop.remove_reader(reader.fileno())

    try:
        _, got = run(read_one)
        assert got == b"y"
    finally:
        reader.close()
        writer.close()
