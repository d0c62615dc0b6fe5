"""plumbing/logsetup.py: the fork server sets the workers' log level once, for all of them."""

import logging

import pytest

from plumbing import logsetup


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
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
