"""The one place for configuration: typed settings read from the environment.

Every variable is declared once in VARIABLES (runtime/variables.py).
`Settings.from_env()` reads and validates them all at start; a bad value raises
SettingsError with a one-line message that names the variable. The README's
environment table and `python -m runtime --help` are generated from the same
list (tests/test_settings.py checks the README is in step).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from runtime.variables import VARIABLES, Variable

__all__ = ["VARIABLES", "Settings", "SettingsError", "help_text", "markdown_table"]


class SettingsError(ValueError):
    """A bad environment value; the message names the variable."""


# Settings that must each admit so many messages of GRPC_MAX_MESSAGE_BYTES: a request, or such a
# request could never run; the front's, a request being read beside an answer held until its
# client reads it (runtime/budget.py), or one unread answer would stop every read, or be refused.
_ADMIT_WHOLE_MESSAGES = {
    "MODEL_BYTES_MAX": (1, "GRPC_MAX_MESSAGE_BYTES"),
    "FRONT_BYTES_MAX": (2, "2 x GRPC_MAX_MESSAGE_BYTES"),
}


def _check_together(values: dict[str, Any]) -> None:
    largest = values["grpc_max_message_bytes"]
    for name, (messages, least) in _ADMIT_WHOLE_MESSAGES.items():
        if values[name.lower()] < messages * largest:
            raise SettingsError(
                f"{name}: must be at least {least} ({messages * largest}), got {values[name.lower()]}"
            )
    # The metrics server binds first: the gRPC port would then fail as if another process held it.
    if values["metrics_port"] == values["runtime_port"]:
        raise SettingsError(f"METRICS_PORT: must differ from RUNTIME_PORT ({values['runtime_port']})")
    # Each replica takes a worker (or a place in another pack): fewer workers would load no model.
    if 0 < values["workers_max"] < values["model_replicas"]:
        raise SettingsError(
            f"MODEL_REPLICAS: must be at most WORKERS_MAX ({values['workers_max']}), "
            f"got {values['model_replicas']}"
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """Typed, validated settings; attribute names are the variable names in lower case.

    The fields are spelled out so that a type checker knows them; a test
    checks they are exactly VARIABLES, in order.
    """

    runtime_port: int
    runtime_socket_path: str | None
    runtime_dir: str
    root_model_dir: str
    pvc_mounts_dir: str
    container_mem_req_bytes: int | None
    mem_buffer_bytes: int
    modelsize_multiplier: float
    default_modelsize: int
    loadtime_timeout: int
    max_loading_concurrency: int
    workers_warm: int
    workers_max: int
    model_replicas: int
    models_per_worker: int
    model_pack_max_bytes: int
    worker_threads: int
    worker_batch_max: int
    worker_batch_wait_us: int
    model_queue_max: int
    limit_model_concurrency: bool
    allow_any_method: bool
    model_crash_limit: int
    model_crash_window_ms: int
    worker_request_timeout_ms: int
    worker_heartbeat_timeout_ms: int
    worker_memory_limit_bytes: int
    shutdown_grace_ms: int
    worker_sched_batch: bool
    grpc_threads_sched_batch: bool
    event_loop: str
    busy_poll_us: int
    shared_ring_bytes: int
    worker_preload: tuple[str, ...]
    grpc_max_message_bytes: int
    model_bytes_max: int
    front_bytes_max: int
    metrics_port: int
    log_level: str
    log_format: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in VARIABLES:
            values[var.field] = _read(var, environ, values)
        _check_together(values)
        return cls(**values)


def _read(var: Variable, environ: Mapping[str, str], so_far: dict[str, Any]) -> Any:
    text = environ.get(var.name)
    if text is None or text == "":
        return var.default(so_far) if callable(var.default) else var.default
    try:
        value = var.parse(text)
        if var.check is not None:
            var.check(value)
    except ValueError as error:
        raise SettingsError(f"{var.name}: {error}") from None
    return value


def help_text() -> str:
    """What `python -m runtime --help` prints."""
    lines = [
        "usage: python -m runtime   (or: mesh-runtime)",
        "",
        "mesh-runtime: a KServe ModelMesh model runtime; each model runs in its own worker process.",
        "It serves mmesh.ModelRuntime, inference.GRPCInferenceService, grpc.health.v1 and reflection",
        "on one port. Configure it with these environment variables (all optional):",
        "",
    ]
    width = max(len(v.name) for v in VARIABLES)
    for var in VARIABLES:
        lines.append(f"  {var.name:<{width}}  {var.meaning} [default: {var.describe_default()}]")
    return "\n".join(lines)


def markdown_table() -> str:
    """The README's environment table."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in VARIABLES:
        rows.append(f"| `{var.name}` | {var.describe_default()} | {var.meaning} |")
    return "\n".join(rows)
