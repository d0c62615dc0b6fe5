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


@pytest.mark.parametrize("yields", [False, True])
def test_turns_yield_the_cpu_only_when_asked_to(run, monkeypatch, yields):
    yielded = 0

    def sched_yield() -> None:
        nonlocal yielded
        yielded += 1

    monkeypatch.setattr(busypoll.os, "sched_yield", sched_yield)
    poller = BusyPoller(0.02, lambda: True, yield_each_turn=yields)

    async def armed():
        poller.arm()
        await asyncio.sleep(0.05)

    run(armed)
    assert (yielded > 0) == yields, f"{yielded} yields with yield_each_turn={yields}"


@pytest.mark.parametrize("cpus, yields", [({3}, True), ({0, 1}, False)])
def test_yields_by_default_only_where_the_front_has_one_cpu(monkeypatch, cpus, yields):
    # On one CPU the worker owing the reply can only run after the loop gives the CPU up.
    monkeypatch.setattr(busypoll.os, "sched_getaffinity", lambda pid: cpus)
    assert BusyPoller(WINDOW, lambda: True).yield_each_turn is yields


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
