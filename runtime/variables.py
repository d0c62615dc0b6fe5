"""Every environment variable the runtime reads: name, parser, default, meaning, check.

Declared once here; runtime/settings.py reads them into a typed Settings, and
the README's environment table and `python -m runtime --help` are generated
from the same list.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import tempfile
from collections.abc import Callable
from typing import Any

from runtime import envparse as parse

# Frameworks the fork server imports up front when they are installed, so a
# load does not pay their import time.
OPTIONAL_FRAMEWORKS = ("sklearn", "xgboost", "lightgbm", "onnxruntime", "torch")


def default_preload() -> tuple[str, ...]:
    """numpy plus whichever optional frameworks are installed."""
    found = [m for m in OPTIONAL_FRAMEWORKS if importlib.util.find_spec(m) is not None]
    return ("numpy", *found)


def _front_bytes_default(so_far: dict[str, Any]) -> int:
    """A sixteenth of the container's memory: the front holds about twice what its calls hold. At
    least room for the largest request and the largest response at once: a response held until its
    client reads it would otherwise leave no room to read any request, or be refused."""
    from runtime import memory  # reads the cgroup; only needed when the default is used

    container = memory.container_memory(so_far["container_mem_req_bytes"])
    return max(2 * so_far["grpc_max_message_bytes"], container // 16)


# runtimeStatus carries some settings in uint32 fields: a value past this could not be sent.
UINT32_MAX = 2**32 - 1
# model-mesh reads runtimeStatus's uint64 sizes into a Java long: a value past this reads negative.
INT64_MAX = 2**63 - 1
# grpc takes its message limits as a C int: a larger one stops the server being built.
GRPC_INT_MAX = 2**31 - 1


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
        parse.whole_number,
        8085,
        "gRPC port for every service (use `port:8085` for grpcEndpoint and grpcDataEndpoint)",
        parse.port,
    ),
    Variable(
        "RUNTIME_SOCKET_PATH",
        parse.absolute_path,
        None,
        "also listen on this unix socket (for `unix:` endpoints), mode 0666: model-mesh connects "
        "under its own uid",
    ),
    Variable(
        "RUNTIME_DIR",
        parse.absolute_path,
        lambda s: os.path.join(tempfile.gettempdir(), f"mesh-runtime-{os.getuid()}-{s['runtime_port']}"),
        "private folder (mode 0700) for the worker sockets and the process registry",
        default_text="$TMPDIR/mesh-runtime-UID-PORT",
    ),
    Variable(
        "ROOT_MODEL_DIR",
        parse.absolute_path,
        "/models",
        "every modelPath must lie inside it (after normalising `..`)",
    ),
    Variable(
        "PVC_MOUNTS_DIR",
        parse.absolute_path,
        "/pvc_mounts",
        "symlinks under ROOT_MODEL_DIR may lead here (ModelMesh Serving's PVC storage) or into "
        "ROOT_MODEL_DIR, nowhere else",
    ),
    Variable(
        "CONTAINER_MEM_REQ_BYTES",
        parse.whole_number,
        None,
        "memory the runtime may use; unset or 0 (no memory request): the cgroup limit, else the "
        "machine's RAM",
        parse.between(0, INT64_MAX),
        default_text="cgroup limit, else RAM",
    ),
    Variable(
        "MEM_BUFFER_BYTES",
        parse.whole_number,
        134217728,
        "headroom kept out of capacityInBytes",
        parse.at_least(0),
    ),
    Variable(
        "MODELSIZE_MULTIPLIER",
        parse.number,
        1.25,
        "predictModelSize = bytes on disk x this (never below the format's floor)",
        parse.positive,
    ),
    Variable(
        "DEFAULT_MODELSIZE",
        parse.whole_number,
        1000000,
        "defaultModelSizeInBytes reported to model-mesh",
        parse.at_least(1),
    ),
    Variable(
        "LOADTIME_TIMEOUT",
        parse.whole_number,
        90000,
        "modelLoadingTimeoutMs; the runtime kills a load that takes longer",
        parse.between(100, UINT32_MAX),
    ),
    Variable(
        "MAX_LOADING_CONCURRENCY",
        parse.whole_number,
        2,
        "maxLoadingConcurrency; further loads wait their turn",
        parse.between(1, UINT32_MAX),
    ),
    Variable(
        "WORKERS_WARM",
        parse.whole_number,
        2,
        "idle pre-forked workers kept ready for the next load, per fork server (one per framework "
        "in WORKER_PRELOAD, and a base one)",
        parse.at_least(0),
    ),
    Variable(
        "WORKERS_MAX",
        parse.whole_number,
        0,
        "hard cap on worker processes, spares included (0: no cap); under a cap each model is charged "
        "at least capacityInBytes / WORKERS_MAX (/ MODELS_PER_WORKER in a pack), so that model-mesh "
        "sees the pod full as its workers run out",
        parse.at_least(0),
    ),
    Variable(
        "MODEL_REPLICAS",
        parse.whole_number,
        1,
        "worker processes per loaded model; a request goes to the least busy one",
        parse.at_least(1),
    ),
    Variable(
        "MODELS_PER_WORKER",
        parse.whole_number,
        32,
        "small models one worker process (a pack) may hold; 1: every model has workers of its own",
        parse.at_least(1),
    ),
    Variable(
        "MODEL_PACK_MAX_BYTES",
        parse.whole_number,
        4 * 2**20,
        "a model goes into a pack when its predicted size without the format's floor (bytes on disk x "
        "MODELSIZE_MULTIPLIER) is below this, and leaves it for a worker of its own when its load "
        "adds more (or leaves processes running)",
        parse.at_least(1),
    ),
    Variable(
        "WORKER_THREADS",
        parse.whole_number,
        1,
        "requests one worker runs at the same time",
        parse.at_least(1),
    ),
    Variable(
        "WORKER_BATCH_MAX",
        parse.whole_number,
        16,
        "with WORKER_THREADS=1, a worker of a row-wise model (sklearn, xgboost, lightgbm) predicts up to "
        "this many calls that queued up together at once, each call getting its own rows back "
        "(1: one predict per call)",
        parse.at_least(1),
    ),
    Variable(
        "WORKER_BATCH_WAIT_US",
        parse.whole_number,
        300,
        "such a worker whose calls came queued together waits this long for another before it predicts, "
        "when none is queued and the front is busy with more of the model's calls (0: never)",
        parse.at_least(0),
    ),
    Variable(
        "MODEL_QUEUE_MAX",
        parse.whole_number,
        128,
        "requests a model may hold waiting for a free worker; more get RESOURCE_EXHAUSTED",
        parse.at_least(0),
    ),
    Variable(
        "LIMIT_MODEL_CONCURRENCY",
        parse.boolean,
        False,
        "report limitModelConcurrency, with maxConcurrency = MODEL_REPLICAS x WORKER_THREADS per model",
    ),
    Variable(
        "ALLOW_ANY_METHOD",
        parse.boolean,
        False,
        "report allowAnyMethod and forward any other unary method to the model's handle()",
    ),
    Variable(
        "MODEL_CRASH_LIMIT",
        parse.whole_number,
        3,
        "a model whose workers die this often within MODEL_CRASH_WINDOW_MS is dropped (NOT_FOUND)",
        parse.at_least(1),
    ),
    Variable(
        "MODEL_CRASH_WINDOW_MS",
        parse.whole_number,
        60000,
        "the window MODEL_CRASH_LIMIT counts crashes in",
        parse.at_least(1),
    ),
    Variable(
        "WORKER_REQUEST_TIMEOUT_MS",
        parse.whole_number,
        0,
        "a worker running one request longer than this is killed and healed (0: off)",
        parse.at_least(0),
    ),
    Variable(
        "WORKER_HEARTBEAT_TIMEOUT_MS",
        parse.whole_number,
        10000,
        "an idle worker that stamps no heartbeat for this long (its main thread is stuck) "
        "is killed and healed",
        parse.at_least(100),
    ),
    Variable(
        "WORKER_MEMORY_LIMIT_BYTES",
        parse.whole_number,
        0,
        "a worker whose USS grows past this is killed, its requests get RESOURCE_EXHAUSTED, "
        "the model heals (0: off)",
        parse.at_least(0),
    ),
    Variable(
        "SHUTDOWN_GRACE_MS",
        parse.whole_number,
        10000,
        "on SIGTERM or SIGINT, how long calls under way may take to finish",
        parse.at_least(0),
    ),
    Variable(
        "WORKER_SCHED_BATCH",
        parse.boolean,
        True,
        "workers run under the kernel's SCHED_BATCH policy: a worker woken by a message does not "
        "preempt the front's event loop, and keeps its full share of the CPU",
    ),
    Variable(
        "GRPC_THREADS_SCHED_BATCH",
        parse.boolean,
        True,
        "the front's grpc threads (poller, event engine, timer) run under SCHED_BATCH: woken on "
        "each call, they do not preempt the front's event loop; the loop itself is unchanged",
    ),
    Variable(
        "EVENT_LOOP",
        parse.one_of("uvloop", "asyncio"),
        lambda s: "uvloop" if parse.uvloop_installed() else "asyncio",
        "the front's event loop: uvloop runs each turn of the loop in C (scripts/bench: about 10 % "
        "more calls per second at 16 clients); asyncio is the standard library's",
        parse.installed_loop,
        default_text="uvloop (asyncio where uvloop is not installed)",
    ),
    Variable(
        "BUSY_POLL_US",
        parse.whole_number,
        0,
        "after a call goes to a worker, the front's event loop polls up to this long while the "
        "reply is due, instead of sleeping: worth it only where waking an idle CPU costs more than "
        "the spin (scripts/bench shows which; under a CPU quota the spin takes the workers' CPU time)",
        parse.at_least(0),
    ),
    Variable(
        "SHARED_RING_BYTES",
        parse.whole_number,
        8 * 2**20,
        "payload frames of 64 KiB or more go between the front and a worker through a shared-memory "
        "ring of this size each way, made for a worker when it first gets one, and its pages are "
        "given back 1 s after such frames stop (0: through the worker socket, as smaller ones go)",
        parse.zero_or_at_least(65536),
    ),
    Variable(
        "WORKER_PRELOAD",
        parse.module_names,
        lambda s: default_preload(),
        "modules the fork servers import once, before forking workers: each framework in it gets a "
        "fork server of its own, the rest go to all; keep the frameworks you serve in it (a worker "
        "importing one itself pays 25-140 MiB and 1-2 s per load)",
        parse.findable_modules,
        default_text="numpy and the installed frameworks",
    ),
    Variable(
        "GRPC_MAX_MESSAGE_BYTES",
        parse.whole_number,
        17825792,
        "gRPC send and receive limit: model-mesh's own 16 MiB plus 1 MiB for the id it injects (raise "
        "it with model-mesh's MM_SVC_GRPC_MAX_MSG_SIZE, grpcMaxMessageSizeBytes in ModelMesh Serving). grpc "
        "copies each request on the front's event loop, so a higher limit lets one huge request "
        "hold every other call for as long as that copy takes",
        parse.between(4194304, GRPC_INT_MAX),
    ),
    Variable(
        "MODEL_BYTES_MAX",
        parse.whole_number,
        lambda s: 4 * s["grpc_max_message_bytes"],
        "bytes of requests one model's calls may hold in the front, waiting or in flight (and of their "
        "responses of 64 KiB or more, until sent); a call that would pass it gets RESOURCE_EXHAUSTED at "
        "once (at least GRPC_MAX_MESSAGE_BYTES)",
        parse.at_least(1),
        default_text="4 x GRPC_MAX_MESSAGE_BYTES",
    ),
    Variable(
        "FRONT_BYTES_MAX",
        parse.whole_number,
        lambda s: _front_bytes_default(s),
        "bytes of requests (and of responses of 64 KiB or more, until sent: at most half of it, and "
        "never so much that a GRPC_MAX_MESSAGE_BYTES request cannot be read) all calls together may "
        "hold in the front; a call that would pass it gets RESOURCE_EXHAUSTED at once (at least "
        "2 x GRPC_MAX_MESSAGE_BYTES)",
        parse.at_least(1),
        default_text="container memory / 16, at least 2 x GRPC_MAX_MESSAGE_BYTES",
    ),
    Variable(
        "METRICS_PORT",
        parse.whole_number,
        2113,
        "Prometheus /metrics port (0: off)",
        lambda v: None if v == 0 else parse.port(v),
    ),
    Variable("LOG_LEVEL", parse.one_of("debug", "info", "warning", "error"), "info", "log level"),
    Variable("LOG_FORMAT", parse.one_of("text", "json"), "text", "`json` prints one JSON object per line"),
)
