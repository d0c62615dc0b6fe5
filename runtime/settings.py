"""The one place for configuration: typed settings read from the environment.

Every variable is declared once in VARIABLES (name, parser, default, meaning).
`Settings.from_env()` reads and validates them all at start; a bad value raises
SettingsError with a one-line message that names the variable. The README's
environment table and `python -m runtime --help` are generated from the same
list (tests/test_settings.py checks the README is in step).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

# Ports model-mesh itself listens on inside the pod; a runtime must avoid them.
RESERVED_PORTS = {8080, 8089, 8090, *range(11881, 11900)}

# Frameworks the fork server imports up front when they are installed, so a
# load does not pay their import time.
OPTIONAL_FRAMEWORKS = ("sklearn", "xgboost", "lightgbm", "onnxruntime", "torch")


class SettingsError(ValueError):
    """A bad environment value; the message names the variable."""


def _int(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _str(text: str) -> str:
    return text


def _path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError(f"expected an absolute path, got {text!r}")
    return os.path.normpath(text)


def _modules(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return value

    return parse


def _at_least(minimum: float) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")

    return check


def _positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def _port(value: int) -> None:
    if not 1 <= value <= 65535:
        raise ValueError(f"must be a TCP port (1-65535), got {value}")
    if value in RESERVED_PORTS:
        raise ValueError(f"port {value} is reserved by model-mesh (8080, 8089, 8090, 11881-11899)")


def _uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def _installed_loop(name: str) -> None:
    if name == "uvloop" and not _uvloop_installed():
        raise ValueError("uvloop is not installed (pip install uvloop, or set EVENT_LOOP=asyncio)")


def default_preload() -> tuple[str, ...]:
    """numpy plus whichever optional frameworks are installed."""
    found = [m for m in OPTIONAL_FRAMEWORKS if importlib.util.find_spec(m) is not None]
    return ("numpy", *found)


def _front_bytes_default(so_far: dict[str, Any]) -> int:
    """A sixteenth of the container's memory: the front holds about twice what its calls hold."""
    from runtime import memory  # reads the cgroup; only needed when the default is used

    container = memory.container_memory(so_far["container_mem_req_bytes"])
    return max(so_far["grpc_max_message_bytes"], container // 16)


# Settings that must each admit a request of GRPC_MAX_MESSAGE_BYTES, or such a request could never run.
_ADMIT_A_WHOLE_MESSAGE = ("MODEL_BYTES_MAX", "FRONT_BYTES_MAX")


def _check_together(values: dict[str, Any]) -> None:
    largest = values["grpc_max_message_bytes"]
    for name in _ADMIT_A_WHOLE_MESSAGE:
        if values[name.lower()] < largest:
            raise SettingsError(
                f"{name}: must be at least GRPC_MAX_MESSAGE_BYTES ({largest}), got {values[name.lower()]}"
            )


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], Any]
    default: Any  # a value, or a callable computing it from the partial settings
    meaning: str
    check: Callable[[Any], None] | None = None
    default_text: str | None = None  # how the default reads in docs when it is computed

    @property
    def field(self) -> str:
        return self.name.lower()

    def describe_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        if isinstance(self.default, tuple):
            return ",".join(self.default)
        return str(self.default)


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "RUNTIME_PORT",
        _int,
        8085,
        "gRPC port for every service (use `port:8085` for grpcEndpoint and grpcDataEndpoint)",
        _port,
    ),
    Variable("RUNTIME_SOCKET_PATH", _path, None, "also listen on this unix socket (for `unix:` endpoints)"),
    Variable(
        "RUNTIME_DIR",
        _path,
        lambda s: os.path.join(tempfile.gettempdir(), f"mesh-runtime-{os.getuid()}-{s['runtime_port']}"),
        "private folder (mode 0700) for the worker sockets and the process registry",
        default_text="$TMPDIR/mesh-runtime-UID-PORT",
    ),
    Variable(
        "ROOT_MODEL_DIR", _path, "/models", "every modelPath must lie inside it (after normalising `..`)"
    ),
    Variable(
        "PVC_MOUNTS_DIR",
        _path,
        "/pvc_mounts",
        "symlinks under ROOT_MODEL_DIR may lead here (ModelMesh Serving's PVC storage) or into "
        "ROOT_MODEL_DIR, nowhere else",
    ),
    Variable(
        "CONTAINER_MEM_REQ_BYTES",
        _int,
        None,
        "memory the runtime may use; unset: the cgroup limit, else the machine's RAM",
        _positive,
        default_text="cgroup limit, else RAM",
    ),
    Variable("MEM_BUFFER_BYTES", _int, 134217728, "headroom kept out of capacityInBytes", _at_least(0)),
    Variable(
        "MODELSIZE_MULTIPLIER",
        _float,
        1.25,
        "predictModelSize = bytes on disk x this (never below the format's floor)",
        _positive,
    ),
    Variable(
        "DEFAULT_MODELSIZE", _int, 1000000, "defaultModelSizeInBytes reported to model-mesh", _at_least(1)
    ),
    Variable(
        "LOADTIME_TIMEOUT",
        _int,
        90000,
        "modelLoadingTimeoutMs; the runtime kills a load that takes longer",
        _at_least(100),
    ),
    Variable(
        "MAX_LOADING_CONCURRENCY",
        _int,
        2,
        "maxLoadingConcurrency; further loads wait their turn",
        _at_least(1),
    ),
    Variable("WORKERS_WARM", _int, 2, "idle pre-forked workers kept ready for the next load", _at_least(0)),
    Variable(
        "WORKERS_MAX", _int, 0, "hard cap on worker processes, spares included (0: no cap)", _at_least(0)
    ),
    Variable(
        "MODEL_REPLICAS",
        _int,
        1,
        "worker processes per loaded model; a request goes to the least busy one",
        _at_least(1),
    ),
    Variable("WORKER_THREADS", _int, 1, "requests one worker runs at the same time", _at_least(1)),
    Variable(
        "WORKER_BATCH_MAX",
        _int,
        16,
        "with WORKER_THREADS=1, a worker of a row-wise model (sklearn, xgboost, lightgbm) predicts up to "
        "this many calls that queued up together at once, each call getting its own rows back "
        "(1: one predict per call)",
        _at_least(1),
    ),
    Variable(
        "MODEL_QUEUE_MAX",
        _int,
        128,
        "requests a model may hold waiting for a free worker; more get RESOURCE_EXHAUSTED",
        _at_least(0),
    ),
    Variable(
        "LIMIT_MODEL_CONCURRENCY",
        _bool,
        False,
        "report limitModelConcurrency, with maxConcurrency = MODEL_REPLICAS x WORKER_THREADS per model",
    ),
    Variable(
        "ALLOW_ANY_METHOD",
        _bool,
        False,
        "report allowAnyMethod and forward any other unary method to the model's handle()",
    ),
    Variable(
        "MODEL_CRASH_LIMIT",
        _int,
        3,
        "a model whose workers die this often within MODEL_CRASH_WINDOW_MS is dropped (NOT_FOUND)",
        _at_least(1),
    ),
    Variable(
        "MODEL_CRASH_WINDOW_MS", _int, 60000, "the window MODEL_CRASH_LIMIT counts crashes in", _at_least(1)
    ),
    Variable(
        "WORKER_REQUEST_TIMEOUT_MS",
        _int,
        0,
        "a worker running one request longer than this is killed and healed (0: off)",
        _at_least(0),
    ),
    Variable(
        "WORKER_HEARTBEAT_TIMEOUT_MS",
        _int,
        10000,
        "an idle worker that answers no heartbeat for this long is killed and healed",
        _at_least(100),
    ),
    Variable(
        "WORKER_MEMORY_LIMIT_BYTES",
        _int,
        0,
        "a worker whose USS grows past this is killed, its requests get RESOURCE_EXHAUSTED, "
        "the model heals (0: off)",
        _at_least(0),
    ),
    Variable(
        "SHUTDOWN_GRACE_MS",
        _int,
        10000,
        "on SIGTERM or SIGINT, how long calls under way may take to finish",
        _at_least(0),
    ),
    Variable(
        "WORKER_SCHED_BATCH",
        _bool,
        True,
        "workers run under the kernel's SCHED_BATCH policy: a worker woken by a message does not "
        "preempt the front's event loop, and keeps its full share of the CPU",
    ),
    Variable(
        "GRPC_THREADS_SCHED_BATCH",
        _bool,
        True,
        "the front's grpc threads (poller, event engine, timer) run under SCHED_BATCH: woken on "
        "each call, they do not preempt the front's event loop; the loop itself is unchanged",
    ),
    Variable(
        "EVENT_LOOP",
        _choice("uvloop", "asyncio"),
        lambda s: "uvloop" if _uvloop_installed() else "asyncio",
        "the front's event loop: uvloop runs each turn of the loop in C (scripts/bench: about 10 % "
        "more calls per second at 16 clients); asyncio is the standard library's",
        _installed_loop,
        default_text="uvloop (asyncio where uvloop is not installed)",
    ),
    Variable(
        "BUSY_POLL_US",
        _int,
        1000,
        "after a request goes to a worker, the front's event loop polls up to this long while the "
        "reply is due, instead of sleeping: waking a halted CPU costs more than a small call "
        "(0: always sleep)",
        _at_least(0),
    ),
    Variable(
        "WORKER_PRELOAD",
        _modules,
        lambda s: default_preload(),
        "modules the fork server imports once, before forking workers; keep the frameworks you "
        "serve in it (a worker importing one itself pays 25-140 MiB and 1-2 s per load)",
        default_text="numpy and the installed frameworks",
    ),
    Variable(
        "GRPC_MAX_MESSAGE_BYTES",
        _int,
        17825792,
        "gRPC send and receive limit: model-mesh's own 16 MiB plus 1 MiB for the id it injects. grpc "
        "copies each request on the front's event loop, so a higher limit lets one huge request "
        "hold every other call for as long as that copy takes",
        _at_least(4194304),
    ),
    Variable(
        "MODEL_BYTES_MAX",
        _int,
        lambda s: 4 * s["grpc_max_message_bytes"],
        "bytes of requests one model's calls may hold in the front, waiting or in flight; a call "
        "that would pass it gets RESOURCE_EXHAUSTED at once (at least GRPC_MAX_MESSAGE_BYTES)",
        _at_least(1),
        default_text="4 x GRPC_MAX_MESSAGE_BYTES",
    ),
    Variable(
        "FRONT_BYTES_MAX",
        _int,
        lambda s: _front_bytes_default(s),
        "bytes of requests all calls together may hold in the front; a call that would pass it gets "
        "RESOURCE_EXHAUSTED at once (at least GRPC_MAX_MESSAGE_BYTES)",
        _at_least(1),
        default_text="container memory / 16, at least GRPC_MAX_MESSAGE_BYTES",
    ),
    Variable(
        "METRICS_PORT",
        _int,
        2113,
        "Prometheus /metrics port (0: off)",
        lambda v: None if v == 0 else _port(v),
    ),
    Variable("LOG_LEVEL", _choice("debug", "info", "warning", "error"), "info", "log level"),
    Variable("LOG_FORMAT", _choice("text", "json"), "text", "`json` prints one JSON object per line"),
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
    worker_threads: int
    worker_batch_max: int
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
