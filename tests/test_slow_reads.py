"""Reads that last too long: the budget ends them (runtime/budget.py), reading.end_read() aborts their
calls from outside the handler, and the handler's read then ends the way grpc ends it."""

import asyncio

import grpc
import pytest

from runtime import budget as budget_module
from runtime import reading
from runtime.budget import ByteBudget

SLOW = 0.2  # SLOW_READ_SECONDS in these tests


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(budget_module, "SLOW_READ_SECONDS", SLOW)


class FakeCall:
    """A call's context as read_request() uses it: its request comes on arrive(); an abort sends its
    status and makes a pending read raise AbortError, as grpc.aio does."""

    def __init__(self):
        self._settled = asyncio.Event()
        self.status: tuple[grpc.StatusCode, str] | None = None

    def arrive(self) -> None:
        self._settled.set()

    def time_remaining(self):
        return None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:4242"

    async def read(self):
        await self._settled.wait()
        if self.status is not None:
            raise grpc.aio.AbortError("Locally aborted.")
        return b"request"

    async def abort(self, code, details):
        self.status = (code, details)
        self._settled.set()
        raise grpc.aio.AbortError("Locally aborted.")


def budget_for(reads: int, read_limit: float | None = None) -> ByteBudget:
    return ByteBudget(
        per_model=100, total=reads * 10, largest_request=10, end_read=reading.end_read, read_limit=read_limit
    )


def reading_task(budget: ByteBudget, call: FakeCall) -> asyncio.Task:
    return asyncio.ensure_future(reading.read_request(budget, call))


def test_a_slow_read_is_ended_once_a_call_waits_for_its_room_and_only_then():
    async def scenario():
        budget = budget_for(reads=2)
        older, newer, late = FakeCall(), FakeCall(), FakeCall()
        older_read = reading_task(budget, older)
        await asyncio.sleep(0.01)
        newer_read = reading_task(budget, newer)
        await asyncio.sleep(SLOW + 0.1)
        assert older.status is None and newer.status is None, "slow reads ended with nobody waiting"
        late_read = reading_task(budget, late)
        await asyncio.sleep(0.05)
        assert older.status is not None and older.status[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "had not come whole" in older.status[1]
        with pytest.raises(grpc.aio.AbortError):
            await older_read
        assert newer.status is None, "more reads were ended than calls waited"
        late.arrive()
        assert await late_read == b"request"
        newer.arrive()
        assert await newer_read == b"request"
        return budget.reading

    assert asyncio.run(scenario()) == 0


def test_a_call_that_comes_while_the_reads_are_young_waits_until_one_is_slow():
    async def scenario():
        budget = budget_for(reads=1)
        first, second = FakeCall(), FakeCall()
        first_read = reading_task(budget, first)
        await asyncio.sleep(0)
        second_read = reading_task(budget, second)
        await asyncio.sleep(SLOW / 2)
        assert first.status is None, "a read was ended before it had lasted SLOW_READ_SECONDS"
        await asyncio.sleep(SLOW)
        assert first.status is not None
        with pytest.raises(grpc.aio.AbortError):
            await first_read
        second.arrive()
        assert await second_read == b"request"

    asyncio.run(scenario())


def test_reads_that_begin_as_held_bytes_are_released_are_watched_too():
    async def scenario():
        budget = budget_for(reads=2)
        budget.reserve("m", 20)  # requests being served hold all the room: no read under way to end
        calls = [FakeCall() for _ in range(3)]
        reads = [reading_task(budget, call) for call in calls]
        await asyncio.sleep(SLOW + 0.1)
        assert all(call.status is None for call in calls)
        budget.release("m", 20)  # the first two begin; the third still waits, and nobody else comes
        await asyncio.sleep(SLOW + 0.1)
        assert calls[0].status is not None and calls[1].status is None
        calls[2].arrive()
        calls[1].arrive()
        assert [await reads[1], await reads[2]] == [b"request", b"request"]
        with pytest.raises(grpc.aio.AbortError):
            await reads[0]
        return budget.reading

    assert asyncio.run(scenario()) == 0


def test_a_read_past_the_budgets_limit_is_ended_with_nobody_waiting():
    async def scenario():
        budget = budget_for(reads=2, read_limit=0.1)
        call = FakeCall()
        read = reading_task(budget, call)
        await asyncio.sleep(0.2)
        assert call.status == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "the call's request did not come within 0.1 s of its start",
        )
        with pytest.raises(grpc.aio.AbortError):
            await read
        return budget.reading

    assert asyncio.run(scenario()) == 0


def test_a_call_whose_request_came_before_its_abort_could_run_goes_on(caplog):
    async def scenario():
        call = FakeCall()
        # the budget's timer, as the read ended
        reading.end_read((call, None, ()), lambda: False, SLOW, False)
        await asyncio.sleep(0.01)
        return call.status

    assert asyncio.run(scenario()) is None
    assert not caplog.records, "a call that needed no abort was logged"


def test_slow_reads_are_ended_one_after_another_as_calls_come_and_the_timer_does_not_spin(
    monkeypatch,
):
    fired = []
    end_slow_reads = ByteBudget._end_slow_reads

    def counted(budget):
        fired.append(budget)
        end_slow_reads(budget)

    monkeypatch.setattr(ByteBudget, "_end_slow_reads", counted)

    async def scenario():
        budget = budget_for(reads=2)
        first, second, third, fourth = (FakeCall() for _ in range(4))
        reads = [reading_task(budget, first)]
        await asyncio.sleep(0.05)
        reads.append(reading_task(budget, second))
        await asyncio.sleep(0)
        reads.append(reading_task(budget, third))  # in line: the first is ended at SLOW
        await asyncio.sleep(SLOW)
        assert first.status is not None and second.status is None
        reads.append(reading_task(budget, fourth))  # in line: the second is ended at its SLOW
        await asyncio.sleep(0.1)
        assert second.status is not None, "a second slow read was not ended for a second call"
        for call in (third, fourth):
            call.arrive()
        assert [await reads[2], await reads[3]] == [b"request", b"request"]
        for ended in reads[:2]:
            with pytest.raises(grpc.aio.AbortError):
                await ended
        return budget.reading

    assert asyncio.run(scenario()) == 0
    assert len(fired) <= 4, f"the slow-read timer fired {len(fired)} times for two reads ended"


def test_a_call_in_line_does_not_wait_for_a_longer_read_limit(monkeypatch):
    async def scenario():
        budget = budget_for(reads=1, read_limit=10 * SLOW)  # its timer is set for read_limit
        first, second = FakeCall(), FakeCall()
        first_read = reading_task(budget, first)
        await asyncio.sleep(0.01)
        second_read = reading_task(budget, second)  # wants the first ended at SLOW
        await asyncio.sleep(SLOW + 0.1)
        assert first.status is not None and first.status[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AbortError):
            await first_read
        second.arrive()
        assert await second_read == b"request"

    asyncio.run(scenario())


def test_a_read_its_caller_gives_up_on_gives_its_room_back_and_ends_nothing():
    async def scenario():
        budget = budget_for(reads=1)
        call = FakeCall()
        read = reading_task(budget, call)
        await asyncio.sleep(0.01)
        read.cancel()  # grpc cancels the handler when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await read
        await asyncio.sleep(SLOW + 0.1)
        return budget.reading, call.status

    assert asyncio.run(scenario()) == (0, None)
