"""Configuration: typed, validated at start, one-line errors, --help and README in step."""

import importlib.util
import os
import subprocess
import sys

import pytest
from harness import REPO

from runtime import memory
from runtime import settings as config


def test_defaults_match_the_design():
    s = config.Settings.from_env({})
    assert s.runtime_port == 8085
    assert s.root_model_dir == "/models"
    assert s.pvc_mounts_dir == "/pvc_mounts"
    assert s.mem_buffer_bytes == 134217728
    assert s.modelsize_multiplier == 1.25
    assert s.default_modelsize == 1000000
    assert s.loadtime_timeout == 90000
    assert s.max_loading_concurrency == 2
    assert s.workers_warm == 2
    # model-mesh's own 16 MiB limit plus 1 MiB for the id it injects
    assert s.grpc_max_message_bytes == 17 * 1024 * 1024
    assert s.container_mem_req_bytes is None
    assert s.worker_preload[0] == "numpy"
    assert s.runtime_dir.endswith(f"mesh-runtime-{os.getuid()}-8085")


def test_values_are_typed():
    s = config.Settings.from_env(
        {
            "RUNTIME_PORT": "9000",
            "MODELSIZE_MULTIPLIER": "2.5",
            "WORKER_PRELOAD": "numpy, json",
            "LOG_FORMAT": "JSON",
            "CONTAINER_MEM_REQ_BYTES": "1_000_000_000",
        }
    )
    assert s.runtime_port == 9000
    assert s.modelsize_multiplier == 2.5
    assert s.worker_preload == ("numpy", "json")
    assert s.log_format == "json"
    assert s.container_mem_req_bytes == 1_000_000_000
    assert s.runtime_dir.endswith("-9000")


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("RUNTIME_PORT", "eighty", "whole number"),
        ("RUNTIME_PORT", "8090", "reserved"),
        ("RUNTIME_PORT", "70000", "TCP port"),
        ("LOADTIME_TIMEOUT", "50", "between 100 and"),
        ("LOADTIME_TIMEOUT", str(2**32), "between 100 and 4294967295"),  # runtimeStatus's uint32
        ("MAX_LOADING_CONCURRENCY", "0", "between 1 and"),
        ("MAX_LOADING_CONCURRENCY", str(2**32), "between 1 and 4294967295"),
        ("MODELSIZE_MULTIPLIER", "0", "greater than 0"),
        ("MODELSIZE_MULTIPLIER", "nan", "finite number"),
        ("MODELSIZE_MULTIPLIER", "inf", "finite number"),
        ("MODELSIZE_MULTIPLIER", "1e400", "finite number"),
        ("ROOT_MODEL_DIR", "models", "absolute path"),
        ("CONTAINER_MEM_REQ_BYTES", str(2**63), "between 0 and 9223372036854775807"),  # a Java long
        ("LOG_LEVEL", "loud", "one of"),
        ("WORKER_PRELOAD", "numpy,sklern", "no module named 'sklern' is installed"),
        ("WORKER_PRELOAD", "numpy;os", "not a module name: 'numpy;os'"),
        ("WORKER_PRELOAD", "numpy,.relative", "not a module name: '.relative'"),
        ("GRPC_MAX_MESSAGE_BYTES", "1024", "between 4194304 and"),
        ("GRPC_MAX_MESSAGE_BYTES", str(2**31), "between 4194304 and 2147483647"),  # grpc's C int
        ("MODEL_BYTES_MAX", "4194304", "at least GRPC_MAX_MESSAGE_BYTES"),
        ("FRONT_BYTES_MAX", "1000", "at least 2 x GRPC_MAX_MESSAGE_BYTES"),
        ("FRONT_BYTES_MAX", "17825792", "at least 2 x GRPC_MAX_MESSAGE_BYTES (35651584)"),
    ],
)
def test_bad_value_names_the_variable(name, value, words):
    with pytest.raises(config.SettingsError) as error:
        config.Settings.from_env({name: value})
    message = str(error.value)
    assert message.startswith(f"{name}: ") and words in message and "\n" not in message


@pytest.mark.parametrize(
    "environ, words",
    [
        (
            {"RUNTIME_PORT": "9000", "METRICS_PORT": "9000"},
            "METRICS_PORT: must differ from RUNTIME_PORT (9000)",
        ),
        ({"METRICS_PORT": "8085"}, "METRICS_PORT: must differ from RUNTIME_PORT (8085)"),
        (
            {"WORKERS_MAX": "2", "MODEL_REPLICAS": "3"},
            "MODEL_REPLICAS: must be at most WORKERS_MAX (2), got 3",
        ),
    ],
)
def test_settings_that_contradict_each_other_are_refused(environ, words):
    with pytest.raises(config.SettingsError) as error:
        config.Settings.from_env(environ)
    assert str(error.value) == words


def test_no_memory_request_falls_back_to_the_cgroup_limit_or_ram():
    settings = config.Settings.from_env({"CONTAINER_MEM_REQ_BYTES": "0"})
    assert memory.container_memory(settings.container_mem_req_bytes) == memory.container_memory(None)


def test_settings_that_agree_are_taken():
    config.Settings.from_env({"WORKERS_MAX": "3", "MODEL_REPLICAS": "3", "METRICS_PORT": "0"})
    config.Settings.from_env({"WORKERS_MAX": "0", "MODEL_REPLICAS": "3"})  # 0: no cap


def test_bad_value_stops_the_runtime_with_one_line():
    env = {**os.environ, "MAX_LOADING_CONCURRENCY": "none"}
    done = subprocess.run(
        [sys.executable, "-m", "runtime"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "mesh-runtime: MAX_LOADING_CONCURRENCY: expected a whole number, got 'none'"
    ]


def test_help_lists_every_variable():
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for var in config.VARIABLES:
        assert var.name in done.stdout


def test_readme_table_is_generated_from_settings():
    with open(os.path.join(REPO, "README.md")) as readme:
        assert config.markdown_table() in readme.read(), (
            "README's environment table is out of date: paste runtime.settings.markdown_table()"
        )


def test_uvloop_chosen_but_not_installed_names_the_way_out_and_the_default_falls_back(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "uvloop" else real_find_spec(name, *rest),
    )
    with pytest.raises(config.SettingsError) as error:
        config.Settings.from_env({"EVENT_LOOP": "uvloop"})
    assert str(error.value).startswith("EVENT_LOOP: ") and "EVENT_LOOP=asyncio" in str(error.value)
    assert config.Settings.from_env({}).event_loop == "asyncio"  # the default falls back


def test_uvloop_is_the_default_where_installed():
    assert config.Settings.from_env({}).event_loop == "uvloop"


def test_byte_budgets_follow_the_message_limit_and_the_container():
    s = config.Settings.from_env(
        {"GRPC_MAX_MESSAGE_BYTES": str(8 * 2**20), "CONTAINER_MEM_REQ_BYTES": str(2**30)}
    )
    assert s.model_bytes_max == 32 * 2**20
    assert s.front_bytes_max == 2**30 // 16
    small_pod = config.Settings.from_env({"CONTAINER_MEM_REQ_BYTES": str(64 * 2**20)})
    # Never below a whole request and a whole response at once
    assert small_pod.front_bytes_max == 2 * small_pod.grpc_max_message_bytes


def test_the_typed_fields_are_exactly_the_variables_in_order():
    import dataclasses

    assert [f.name for f in dataclasses.fields(config.Settings)] == [v.field for v in config.VARIABLES]
