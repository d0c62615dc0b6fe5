"""The models one worker holds (workers/holding.py): one of its own, or several in a pack."""

from __future__ import annotations

import os
import signal
import types

import msgpack
import pytest
from harness import ECHO_MODEL, write_model

from plumbing import yielding
from workers import formats, holding, protocol
from workers.holding import Holdings


def load(holdings: Holdings, model_id: str, path: str, pack: bool) -> dict:
    header = {"id": 1, "model_id": model_id, "format": "python", "path": path, "pack": pack}
    return msgpack.unpackb(holdings.load(header, [])[0])


@pytest.fixture
def echo(tmp_path):
    return write_model(str(tmp_path / "echo"), ECHO_MODEL)


def test_a_worker_of_its_own_refuses_a_second_model(echo):
    holdings = Holdings(batch_max=1)
    assert load(holdings, "a", echo, pack=False)["ok"]
    refused = load(holdings, "b", echo, pack=True)
    assert refused["error"] == protocol.ERROR_LOAD and "not a pack" in refused["message"]
    assert list(holdings.by_id) == ["a"]


def test_a_pack_holds_several_finds_each_by_id_and_drops_one(echo):
    holdings = Holdings(batch_max=1)
    assert all(load(holdings, model_id, echo, pack=True)["ok"] for model_id in ("a", "b"))
    assert load(holdings, "a", echo, pack=True)["error"] == protocol.ERROR_LOAD  # loaded already
    assert holdings.find("a").model_id == "a" and holdings.find("b").model_id == "b"
    assert holdings.find(None) is None, "a call that names no model is for the one model held"
    assert msgpack.unpackb(holdings.drop({"id": 2, "model_id": "a"}, [])[0])["ok"]
    assert holdings.find("a") is None and holdings.find(None).model_id == "b"


def test_a_failed_load_leaves_the_pack_as_it_was(tmp_path, echo, monkeypatch):
    titles: list[str] = []
    monkeypatch.setattr(holding.titles, "set_title", lambda title, runtime_dir=None: titles.append(title))
    holdings = Holdings(batch_max=1)
    load(holdings, "a", echo, pack=True)
    broken = write_model(str(tmp_path / "broken"), "raise RuntimeError('no')\n")
    failed = load(holdings, "b", broken, pack=True)
    assert failed["error"] == protocol.ERROR_LOAD and "no" in failed["message"]
    assert list(holdings.by_id) == ["a"]
    assert titles[-1] == "pack models=1"  # its title counts what it holds, not the load that failed


def test_a_failed_load_is_told_in_a_bounded_message(tmp_path, caplog):
    # The message goes into the worker's log, the front's, and the reply: a model that puts
    # megabytes in its exception (a data frame, a config) must not put them in every log line.
    holdings = Holdings(batch_max=1)
    broken = write_model(str(tmp_path / "broken"), "raise ValueError('x' * 5_000_000)\n")
    with caplog.at_level("WARNING"):
        failed = load(holdings, "b", broken, pack=False)
    assert failed["message"].startswith("ValueError: xxx") and len(failed["message"]) < 5000
    assert failed["message"].endswith(
        f"... ({5_000_000 + len('ValueError: ') - protocol.ERROR_MESSAGE_MAX_CHARS} more characters)"
    )
    assert max(len(record.getMessage()) for record in caplog.records) < 5000


def test_a_failed_load_of_an_exception_without_a_message_names_its_type_alone(tmp_path):
    holdings = Holdings(batch_max=1)
    broken = write_model(str(tmp_path / "broken"), "raise EOFError()\n")
    assert load(holdings, "b", broken, pack=False)["message"] == "EOFError"


@pytest.mark.parametrize("body", ["raise RuntimeError('str broke')", "return 5"])
def test_a_load_failing_with_an_exception_that_cannot_be_told_fails_alone(tmp_path, body):
    # Formatting the failure ran the model's __str__: what it raised took the worker, and in a
    # pack every model it held, down.
    holdings = Holdings(batch_max=1)
    source = f"class Bad(Exception):\n    def __str__(self):\n        {body}\n\nraise Bad()\n"
    failed = load(holdings, "b", write_model(str(tmp_path / "broken"), source), pack=True)
    assert failed["error"] == protocol.ERROR_LOAD and failed["message"] == "Bad: <exception str() failed>"


def test_a_pack_loads_framework_models_on_a_thread_of_idle_priority_and_nothing_else(monkeypatch):
    policies: list[int] = []
    shares: list[bool] = []

    def recording_load(format_name: str, path: str, shared: bool = False):
        policies.append(os.sched_getscheduler(0))  # of the calling thread alone
        shares.append(shared)
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(formats, "load", recording_load)

    def policy_of(model_id: str, fmt: str, pack: bool, threads: int = 1) -> int:
        holdings = Holdings(batch_max=1, threads=threads)
        header = {"id": 1, "model_id": model_id, "format": fmt, "path": "/models/x", "pack": pack}
        assert msgpack.unpackb(holdings.load(header, [])[0])["ok"]
        return policies[-1]

    assert policy_of("a", "sklearn", pack=True) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE, "the calling thread keeps its policy"
    assert policy_of("b", "sklearn", pack=False) != os.SCHED_IDLE, "a worker of its own"
    assert policy_of("c", "sklearn", pack=True, threads=2) != os.SCHED_IDLE, "pools would inherit it"
    assert policy_of("d", "python", pack=True) != os.SCHED_IDLE, "a custom model's own thread"
    assert shares == [True, False, True, True], "a pack's loads are told the process is shared"


def test_a_pack_loads_custom_models_giving_way_and_a_worker_of_its_own_does_not(monkeypatch):
    giving_way: list[bool] = []
    handler_before = signal.getsignal(yielding.GIVE_WAY_SIGNAL)

    def recording_load(format_name: str, path: str, shared: bool = False):
        giving_way.append(signal.getsignal(yielding.GIVE_WAY_SIGNAL) is not handler_before)
        return types.SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(formats, "load", recording_load)

    def gave_way(fmt: str, pack: bool) -> bool:
        header = {"id": 1, "model_id": "a", "format": fmt, "path": "/models/x", "pack": pack}
        assert msgpack.unpackb(Holdings(batch_max=1).load(header, [])[0])["ok"]
        return giving_way[-1]

    assert gave_way("python", pack=True)
    assert signal.getsignal(yielding.GIVE_WAY_SIGNAL) is handler_before, "it stops with the load"
    assert not gave_way("python", pack=False), "a worker of its own has no neighbours to give way to"
    assert not gave_way("sklearn", pack=True), "a framework pack loads at idle priority instead"


def test_a_failed_load_is_logged_with_where_in_the_model_s_code_it_failed(tmp_path, caplog):
    source = (
        "def read_config(path):\n    return open(path + '/config.json').read()\n\n\nread_config('/nowhere')\n"
    )
    with caplog.at_level("WARNING"):
        load(Holdings(batch_max=1), "b", write_model(str(tmp_path / "broken"), source), pack=False)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("load of b failed")]
    assert record.exc_info is not None and "in read_config" in caplog.text
