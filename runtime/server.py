"""Builds the gRPC server and runs the front until SIGTERM or SIGINT.

One grpc.aio server on RUNTIME_PORT (and RUNTIME_SOCKET_PATH) carries
mmesh.ModelRuntime, inference.GRPCInferenceService, grpc.health.v1 and
reflection. The server answers at once; the worker pool starts behind it, and
until it is ready runtimeStatus says STARTING and health says NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from plumbing import heap, logsetup, priority, titles
from protos import grpc_predict_v2_pb2, model_runtime_pb2, model_runtime_pb2_grpc
from runtime import __version__, busypoll, filelimit, heaptrim, reading, rundir, status, tasklimit
from runtime.admin import AdminServer
from runtime.budget import ByteBudget
from runtime.dataplane import InferenceService
from runtime.dispatch import Dispatcher
from runtime.management import ModelRuntimeServicer
from runtime.metrics import Metrics
from runtime.settings import Settings
from runtime.supervisor import Supervisor

log = logging.getLogger("mesh.server")

STREAM_WINDOW_BYTES = 4 * 2**20
# The control methods (model-mesh's management API, health, reflection, the V2 server and model
# checks) read their requests under budgets of their own, each with room for this many at once:
# calls waiting for room in FRONT_BYTES_MAX do not hold up an unload or a health check. The
# management API has one to itself: streams any client leaves silent on a health or server check
# do not hold up model-mesh's loads and unloads.
CONTROL_READS_AT_ONCE = 2
HEALTH_SERVICE_NAME_MAX = 256

SERVICE_NAMES = (
    model_runtime_pb2.DESCRIPTOR.services_by_name["ModelRuntime"].full_name,
    grpc_predict_v2_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


def run(settings: Settings) -> int:
    stop_signals = StopSignals()
    stop_signals.note_early()
    keeps_buffers = heap.keep_big_buffers()  # before grpc and ZeroMQ start their threads
    logsetup.setup("front", settings.log_level, settings.log_format)
    if not keeps_buffers:
        log.info("this libc takes no malloc thresholds: big tensors are mapped afresh for each call")
    titles.set_title(f"front port={settings.runtime_port}", settings.runtime_dir)
    filelimit.check_open_file_limit(settings)  # before any worker holds a descriptor
    log.info("busy polling %s", busypoll.describe(settings.busy_poll_us))
    if not priority.set_oom_score_adj(priority.FRONT_OOM_SCORE_ADJ):
        log.info(
            "cannot lower the front's oom_score_adj (needs CAP_SYS_RESOURCE); workers still rank above it"
        )
    try:
        # Held for the front's whole life: the purge of leftovers and all the rest run under it.
        lock = rundir.prepare(settings.runtime_dir, own_entries(settings))
    except rundir.RuntimeDirError as error:
        log.error("%s", error)
        return 2
    with lock, asyncio.Runner(loop_factory=event_loop_factory(settings.event_loop)) as runner:
        return runner.run(serve(settings, stop_signals))


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM or SIGINT stops the front once; later ones are logged once and ignored.

    From the start of run() a plain handler notes a signal that comes before
    the event loop listens. Before the loop ends, both signals are ignored for
    the rest of the exit: asyncio and uvloop put the default handlers back
    when they let go of theirs, and a SIGINT then would kill a front that had
    shut down cleanly.
    """

    def __init__(self):
        self.requested = asyncio.Event()
        self._early: int | None = None
        self._told = False

    def note_early(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_early_signal)
        # Held back by runtime/__main__.py through the imports: one sent meanwhile comes now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_early_signal(self, signum: int, frame) -> None:
        self._early = self._early or signum

    def listen(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self._on_signal, signum)
        if self._early is not None:
            log.info("%s came during startup: stopping once started", signal.Signals(self._early).name)
            self.requested.set()
        return self.requested

    def _on_signal(self, signum: int) -> None:
        if not self.requested.is_set():
            self.requested.set()
        elif not self._told:
            self._told = True
            log.info(
                "already stopping: ignoring %s and any later SIGTERM or SIGINT", signal.Signals(signum).name
            )

    def ignore_from_now_on(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
            signal.signal(signum, signal.SIG_IGN)


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """For asyncio.Runner: uvloop's loop, or None for asyncio's own (EVENT_LOOP)."""
    if name == "uvloop":
        import uvloop  # settings checked that it is installed

        return uvloop.new_event_loop
    return None


class GenericHandlersOnly:
    """Lets generated add_*_to_server code add a service as a generic handler only.

    grpc.aio (1.85) accepts each call by waiting on one future per registered
    method plus one for every other method, and walks all of them on every
    call: the dozen methods that generated code registers cost each inference
    call more than looking the method up among four generic handlers does.
    Each unary method is served so that its request is read under the control
    methods' byte budget (runtime/reading.py, CONTROL_READS_AT_ONCE).
    """

    def __init__(self, server: grpc.aio.Server, budget: ByteBudget):
        self._server = server
        self._budget = budget

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers([_Budgeted(handler, self._budget) for handler in handlers])

    def add_registered_method_handlers(self, service_name: str, handlers) -> None:
        pass  # the generic handler added just before serves the same methods


class _Budgeted(grpc.GenericRpcHandler):
    """A generic handler whose unary methods read their requests under a byte budget."""

    def __init__(self, handler: grpc.GenericRpcHandler, budget: ByteBudget):
        self._handler = handler
        self._budget = budget
        self._served: dict[str, grpc.RpcMethodHandler | None] = {}  # the methods are a fixed few

    def service(self, handler_call_details):
        method = handler_call_details.method
        if method not in self._served:
            found = self._handler.service(handler_call_details)
            if found is None:
                return None  # an unknown name is not kept: clients choose those
            self._served[method] = reading.budgeted(found, self._budget)
        return self._served[method]


class HealthService(health.aio.HealthServicer):
    """grpc's health service, refusing a Watch of a service name longer than any service's: a Watch
    keeps its request for as long as its stream is open."""

    async def Watch(self, request, context) -> None:
        if len(request.service) > HEALTH_SERVICE_NAME_MAX:
            await status.abort(
                context, status.service_name_too_long(len(request.service), HEALTH_SERVICE_NAME_MAX)
            )
        await super().Watch(request, context)


def build_server(
    settings: Settings, supervisor: Supervisor, dispatcher: Dispatcher, health_servicer
) -> grpc.aio.Server:
    limit = settings.grpc_max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            # Without this a second runtime on the same port would bind silently.
            ("grpc.so_reuseport", 0),
            # HTTP/2 flow control: a stream waiting for room in the byte budget
            # (runtime/reading.py) may have at most this much of its request sent
            # ahead into the front. Bandwidth-delay probing would grow that window
            # to tens of MiB per stream, so it is off; a stream being read is
            # still let send its whole message. With a window this size, calls of
            # 1 MiB go as fast as with probing (docs/hardening.md).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ]
    )
    # Inference first: grpc asks the generic handlers in order, and inference
    # calls are the many. With ALLOW_ANY_METHOD it still leaves the services
    # below alone (dataplane.NEVER_FORWARDED).
    control, management = (
        ByteBudget(
            limit,
            CONTROL_READS_AT_ONCE * limit,
            limit,
            reading.end_read,
            reading.CONTROL_READ_SECONDS,
            name=f"the {methods}' read budget ({CONTROL_READS_AT_ONCE} x GRPC_MAX_MESSAGE_BYTES)",
        )
        for methods in ("control methods", "management methods")
    )
    server.add_generic_rpc_handlers([InferenceService(dispatcher, settings.allow_any_method, control)])
    model_runtime_pb2_grpc.add_ModelRuntimeServicer_to_server(
        ModelRuntimeServicer(settings, supervisor), GenericHandlersOnly(server, management)
    )
    generic_only = GenericHandlersOnly(server, control)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, generic_only)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(SERVICE_NAMES), generic_only
    )
    return server


async def start_grpc_server(
    settings: Settings, supervisor: Supervisor, dispatcher: Dispatcher, health_servicer
) -> grpc.aio.Server | None:
    """Builds, binds and starts the server; None, logged, if it cannot listen."""
    with grpc_threads_as_batch_work(settings):
        server = build_server(settings, supervisor, dispatcher, health_servicer)
        path = settings.runtime_socket_path
        if path and answers_on(path):
            log.error("cannot listen on unix:%s (RUNTIME_SOCKET_PATH): another server listens there", path)
            return None
        try:
            server.add_insecure_port(f"[::]:{settings.runtime_port}")
            if path:
                server.add_insecure_port(f"unix:{path}")
                open_to_other_users(path)
        except RuntimeError as error:
            where = f" or unix:{path}" if path else ""
            log.error("cannot listen on port %d%s: %s", settings.runtime_port, where, error)
            return None
        await server.start()
    return server


def open_to_other_users(path: str) -> None:
    """Lets every user connect to the socket at path. grpc makes it as the umask says (0755 under
    the usual 022), and connecting needs write permission: model-mesh, in a container of its own
    that runs under another uid (its image's is 2000), was refused and waited out its 180 s start.
    The port it stands for is open to every user of the pod's network already."""
    os.chmod(path, 0o666)


def own_entries(settings: Settings) -> tuple[str, ...]:
    """RUNTIME_SOCKET_PATH's name when it is in RUNTIME_DIR: judged, removed and made as its entries."""
    return rundir.names_in(settings.runtime_dir, settings.runtime_socket_path)


def answers_on(path: str) -> bool:
    """Whether a server listens on the unix socket at path: grpc would unlink it and bind its own,
    taking the socket from a front that runs (and removing it when it stops)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (BlockingIOError, TimeoutError):  # a listener too busy to take one more
            return True
        except OSError:  # nothing there, a front gone, or no socket: grpc's bind says why
            return False
    return True


@contextlib.contextmanager
def grpc_threads_as_batch_work(settings: Settings):
    """grpc's own threads, started inside this block, run under SCHED_BATCH.

    The timer, the completion-queue poller and the event engine's threads wake
    on every call. As SCHED_OTHER each wake-up may preempt the event loop in
    the middle of a turn (at c=16 most of the loop's context switches); as
    SCHED_BATCH they wait for its time slice to end, or take an idle CPU.
    The event loop's own thread and ZeroMQ's keep their policy.
    """
    if not settings.grpc_threads_sched_batch:
        yield
        return
    with priority.threads_started_here_run_as_batch_work() as batch:
        if not batch:
            log.warning(
                "the kernel refused SCHED_BATCH (GRPC_THREADS_SCHED_BATCH); grpc's threads may "
                "preempt the event loop"
            )
        yield


async def serve(settings: Settings, stop_signals: StopSignals | None = None) -> int:
    """Serves until SIGTERM or SIGINT, then shuts down; returns the exit code."""
    stop_signals = stop_signals or StopSignals()
    loop = asyncio.get_running_loop()
    stop = stop_signals.listen(loop)
    try:
        return await serve_until(stop, settings)
    finally:
        stop_signals.ignore_from_now_on(loop)


async def serve_until(stop: asyncio.Event, settings: Settings) -> int:
    """Starts everything, serves until `stop` is set, stops everything; returns the exit code."""
    supervisor = Supervisor(settings, Metrics())
    budget = ByteBudget(
        settings.model_bytes_max, settings.front_bytes_max, settings.grpc_max_message_bytes, reading.end_read
    )
    dispatcher = Dispatcher(settings, supervisor, supervisor.pool, budget)
    health_servicer = HealthService()
    if settings.metrics_port:
        try:
            supervisor.metrics.serve(settings.metrics_port, supervisor)
        except OSError as error:
            log.error("cannot serve metrics on METRICS_PORT=%d: %s", settings.metrics_port, error)
            rundir.remove(settings.runtime_dir, own_entries(settings))  # nothing started yet
            return 2
    server = await start_grpc_server(settings, supervisor, dispatcher, health_servicer)
    if server is None:
        rundir.remove(settings.runtime_dir, own_entries(settings))
        return 2
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    log.info(
        "mesh-runtime %s listening on port %d%s (event loop: %s)",
        __version__,
        settings.runtime_port,
        f" and unix:{settings.runtime_socket_path}" if settings.runtime_socket_path else "",
        type(asyncio.get_running_loop()).__module__.split(".")[0],
    )

    exit_code = 0
    admin = AdminServer(supervisor, settings)
    frozen = heaptrim.freeze_what_start_up_made()
    log.info("%d objects of the start-up left out of garbage collections", frozen)
    try:
        if await _started_before_stop(supervisor, stop):
            admin.start()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await stop.wait()
        log.info("stopping: no new calls, %.1f s for those under way", settings.shutdown_grace_ms / 1000)
    except Exception as error:
        if (shortage := tasklimit.shortage()) is not None:  # the traceback would only hint at it
            log.error("the worker pool failed (%s: %s): %s; stopping", type(error).__name__, error, shortage)
        else:
            log.exception("the worker pool failed; stopping")
        exit_code = 1
    await health_servicer.enter_graceful_shutdown()
    await server.stop(settings.shutdown_grace_ms / 1000)
    await admin.close()
    if unreaped := await supervisor.close():
        # Their records stay in RUNTIME_DIR: the next front on it kills any that still runs.
        log.error("stopped; %d workers not seen to exit: %s", len(unreaped), unreaped)
        return 1
    rundir.remove(settings.runtime_dir, own_entries(settings))
    log.info("stopped; every worker reaped")
    return exit_code


async def _started_before_stop(supervisor: Supervisor, stop: asyncio.Event) -> bool:
    """Starts the supervisor; False if `stop` is set first (a pool whose workers cannot start
    would otherwise keep a SIGTERM waiting). Raises what starting raised."""
    starting = asyncio.create_task(supervisor.start(), name="start")
    stopping = asyncio.create_task(stop.wait(), name="stop")
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if starting.done():
        starting.result()
        return True
    log.warning("stopped before the worker pool was ready")
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    return False
