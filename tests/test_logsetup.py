"""plumbing/logsetup.py: the fork server sets the workers' log level once, for all of them."""

import json
import logging
import sys
import threading
import warnings

import pytest

from plumbing import logsetup


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    streams = sys.stdout, sys.stderr
    hooks = threading.excepthook, sys.excepthook
    yield root
    sys.stdout, sys.stderr = streams
    threading.excepthook, sys.excepthook = hooks
    logging.captureWarnings(False)
    root.handlers[:] = handlers
    root.setLevel(level)


def test_setting_the_level_a_logger_already_has_touches_no_logger(root_logger, monkeypatch):
    logsetup.setup("worker", "warning", "text")
    # setLevel clears every logger's cache: in a forked worker, a copy of each one's page.
    monkeypatch.setattr(logging.Logger, "setLevel", lambda self, level: pytest.fail("setLevel called"))
    logsetup.setup("worker", "warning", "json")
    assert isinstance(root_logger.handlers[0].formatter, logsetup.JsonFormatter)


def test_a_new_level_is_still_set(root_logger):
    logsetup.setup("worker", "warning", "text")
    logsetup.setup("worker", "debug", "text")
    assert root_logger.level == logging.DEBUG


def test_the_fork_server_takes_the_level_and_format_the_front_put_in_its_env(root_logger, monkeypatch):
    monkeypatch.setenv(logsetup.LOG_ENV, "error json")
    logsetup.setup_from_env("worker")
    assert root_logger.level == logging.ERROR
    assert isinstance(root_logger.handlers[0].formatter, logsetup.JsonFormatter)


def test_without_the_front_s_word_the_fork_server_leaves_logging_alone(root_logger, monkeypatch):
    monkeypatch.delenv(logsetup.LOG_ENV, raising=False)
    before = root_logger.handlers[:]
    logsetup.setup_from_env("worker")
    assert root_logger.handlers == before


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_traceback_carrying_megabytes_is_cut_to_its_ends(root_logger, capsys, fmt):
    logsetup.setup("worker", "info", fmt)
    try:
        raise ValueError("row " * 1_000_000)  # model code raising with a data frame in its message
    except ValueError:
        logging.getLogger("mesh.worker").exception("model m raised")
    written = capsys.readouterr().err
    assert len(written) < 20_000
    assert "Traceback (most recent call last)" in written and "ValueError: row row" in written
    assert "characters left out" in written


def test_under_json_what_python_prints_comes_out_as_json_objects(root_logger, capsys):
    logsetup.setup("worker", "warning", "json")
    print("a model's print")
    print("no end yet", end="")
    print(" and its end")
    sys.stderr.write("two lines\nat once\n")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a framework's warning", stacklevel=1)
    written = capsys.readouterr()
    assert written.out == ""
    entries = [json.loads(line) for line in written.err.splitlines()]
    said = [(e["logger"], e["level"], e["message"]) for e in entries]
    assert said[:4] == [
        ("stdout", "info", "a model's print"),  # not dropped under LOG_LEVEL=warning: printed as in text
        ("stdout", "info", "no end yet and its end"),
        ("stderr", "warning", "two lines"),
        ("stderr", "warning", "at once"),
    ]
    assert said[4][0] == "py.warnings" and "a framework's warning" in said[4][2]


def test_a_line_never_ended_comes_out_in_pieces(root_logger, capsys):
    logsetup.setup("worker", "info", "json")
    for _ in range(3):
        sys.stdout.write("x" * logsetup.PRINTED_PIECE_CHARS)
    entries = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [len(e["message"]) for e in entries] == [logsetup.PRINTED_PIECE_CHARS] * 2


def test_setting_up_again_does_not_wrap_the_streams_twice(root_logger, capsys):
    logsetup.setup("worker", "info", "json")  # the fork server's
    logsetup.setup("worker", "info", "json")  # its worker's
    print("once")
    assert [json.loads(line)["message"] for line in capsys.readouterr().err.splitlines()] == ["once"]


def test_records_that_name_no_model_name_the_one_this_thread_runs(root_logger, capsys):
    logsetup.setup("worker", "info", "json")
    logsetup.running.model_id = "m"
    try:
        logging.getLogger("a_model_s_own").info("from its code")
        print("printed by it")
        logging.getLogger("mesh.worker").info("about another", extra={"model_id": "other"})
    finally:
        logsetup.running.model_id = None
    logging.getLogger("mesh.worker").info("between calls")
    entries = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [e.get("model_id") for e in entries] == ["m", "m", "other", None]


def test_printed_streams_answer_what_a_real_stream_answers(root_logger, capsys):
    logsetup.setup("worker", "info", "json")
    sys.stdout.reconfigure(line_buffering=True)  # as some libraries do at import
    assert sys.stdout.line_buffering and not sys.stdout.isatty()


def test_what_is_printed_still_comes_out_once_a_model_configured_logging_its_way(root_logger, capsys):
    logsetup.setup("worker", "info", "json")
    # As a model's logging.config.dictConfig() leaves it (disable_existing_loggers, the default):
    # the loggers it does not name disabled, the root's handler its own, on sys.stdout.
    disabled = logging.getLogger("stdout")
    disabled.disabled = True
    try:
        root_logger.handlers[:] = [logging.StreamHandler(sys.stdout)]
        print("printed after it")
    finally:
        disabled.disabled = False
    assert capsys.readouterr().out == "printed after it\n"


def test_flushing_a_printed_stream_flushes_the_stream_it_stands_for(tmp_path):
    path = tmp_path / "stdout"
    with open(path, "w") as real:  # a pipe or a file: block-buffered, unless PYTHONUNBUFFERED
        printed = logsetup.Printed("stdout", logging.INFO, real)
        printed.buffer.write(b"bytes written raw\n")
        printed.flush()
        assert path.read_bytes() == b"bytes written raw\n"


def test_a_threads_uncaught_exception_is_one_error_record_with_its_traceback(root_logger, capsys):
    logsetup.setup("worker", "info", "json")

    def fails() -> None:
        raise ValueError("in a model's thread")

    thread = threading.Thread(target=fails, name="model-thread")
    thread.start()
    thread.join()
    quiet = threading.Thread(target=sys.exit)  # a thread's sys.exit() is no error, as in Python
    quiet.start()
    quiet.join()
    (record,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert record["level"] == "error" and record["message"] == "uncaught exception in model-thread"
    assert "ValueError: in a model's thread" in record["error"]
