"""inference.GRPCInferenceService in the front: find the model id, forward bytes, map errors.

ModelInfer and ModelMetadata go to the model's worker as raw request bytes
(no deserialiser is registered for them, so grpc hands us bytes and sends the
worker's bytes back as they are). ServerLive, ServerReady, ServerMetadata and
ModelReady carry no tensors and are answered here. Every method is served as
stream-unary, so that its request is read under a byte budget
(runtime/reading.py): the calls' budget for the forwarded methods, the
control methods' own for the others (runtime/server.py).

The model id comes from the `mm-model-id-bin` header (UTF-8), else
`mm-model-id`, else field 1 of the request (where model-mesh injects it).
Looking for field 1 walks the request's top-level fields on the event loop,
so it stops after ID_SEARCH_MAX_FIELDS of them. Model-mesh appends field 1
at the end when a client left it out, but then it also sends the headers;
any other client's protobuf library writes field 1 first.
The headers are read in `service()`, from the metadata grpc builds once to
look the method up: `context.invocation_metadata()` builds it again, and
that cost about 4 % of the front's instructions per echo call (callgrind).

With ALLOW_ANY_METHOD, any other unary method is forwarded as bytes too; the
worker hands it to the model's handle(method, request_bytes).
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc

from plumbing import heap
from protos import grpc_predict_v2_pb2 as pb
from protos import wire
from runtime import __version__, modelspec, reading, status
from runtime.budget import ByteBudget
from runtime.dispatch import Dispatcher
from runtime.heaptrim import QuietTrimmer
from workers import protocol

SERVICE = "inference.GRPCInferenceService"
# A response this big counts against the byte budget until its call ends: a client that reads none
# of its responses would otherwise pile them up in the front, its calls ending in time all the same.
HELD_RESPONSE_BYTES = 64 * 1024
# Services of our own that ALLOW_ANY_METHOD never hands to a model.
NEVER_FORWARDED = ("/mmesh.", "/grpc.")


# service() keeps the handlers it built for (method, header id): the same few
# models are called over and over. Emptied when full: ids come from clients.
ROUTED_HANDLERS_MAX = 4096
# Fields walked looking for the model id of a request without headers: a
# fraction of a millisecond of the event loop at most.
ID_SEARCH_MAX_FIELDS = 1024
# grpc cancels a call's handler as its deadline passes, by its own clock: up to a few milliseconds
# before context.time_remaining() reaches 0. A call cancelled this close to its deadline timed out.
DEADLINE_SLACK_SECONDS = 0.05


def model_id_in_headers(metadata) -> str:
    """The id in model-mesh's headers: mm-model-id-bin (UTF-8) first, then mm-model-id; "" if neither."""
    model_id = _unchecked_id_in_headers(metadata)
    if model_id:
        modelspec.check_model_id(model_id)  # a 1 MiB id is refused, not looked up
    return model_id


def _unchecked_id_in_headers(metadata) -> str:
    """model_id_in_headers() before the id's check (service() checks only ids it has not kept)."""
    plain = ""
    for key, value in metadata or ():
        if key == "mm-model-id-bin" and value:
            try:
                return value.decode() if isinstance(value, bytes) else value
            except UnicodeDecodeError:
                raise status.invalid_argument("mm-model-id-bin is not UTF-8") from None
        if key == "mm-model-id" and value and not plain:
            plain = value
    return plain


def model_id_in_request(request: bytes) -> str:
    """The id in the request's field 1, where model-mesh injects it when there are no headers."""
    try:
        model_id = wire.string_field(request, 1, ID_SEARCH_MAX_FIELDS)
    except wire.TooManyFields:
        raise status.invalid_argument(
            f"no model id in the request's first {ID_SEARCH_MAX_FIELDS} fields: send the mm-model-id "
            "header, or put the model name first"
        ) from None
    except wire.WireError as error:
        raise status.invalid_argument(f"request is not a valid protobuf message: {error}") from None
    if not model_id:
        raise status.invalid_argument(
            "no model id: send the mm-model-id header or set the request's model name"
        )
    modelspec.check_model_id(model_id)
    return model_id


async def _refuse(error: status.RpcError, request_iterator, context) -> None:
    await status.abort(context, error)  # without reading the request: it may be big


def _refusing(error: status.RpcError) -> grpc.RpcMethodHandler:
    return grpc.stream_unary_rpc_method_handler(functools.partial(_refuse, error))


class InferenceService(grpc.GenericRpcHandler):
    def __init__(self, dispatcher: Dispatcher, allow_any_method: bool, control: ByteBudget | None = None):
        """control: the budget the server's and models' checks (ServerLive and the like) read under,
        apart from the calls' (runtime/server.py); the calls' own where None."""
        self.dispatcher = dispatcher
        self.supervisor = dispatcher.supervisor
        self.budget = dispatcher.budget
        self.metrics = dispatcher.supervisor.metrics
        self.allow_any_method = allow_any_method
        # Big calls leave free heap that glibc keeps for the next ones: given back once they stop.
        self.heap = QuietTrimmer(trim=heap.trim)
        # Method path -> (method, metric label), for the methods every worker serves.
        self._forwarded = {
            f"/{name}": self._forwarded_as(name) for name in (protocol.METHOD_INFER, protocol.METHOD_METADATA)
        }
        self._routed: dict[tuple[str, str], grpc.RpcMethodHandler] = {}
        # Deserialisers rather than classes: protobuf ships no stubs, so the classes would join to object.
        local = {
            f"{SERVICE}/ServerLive": (self.server_live, pb.ServerLiveRequest.FromString),
            f"{SERVICE}/ServerReady": (self.server_ready, pb.ServerReadyRequest.FromString),
            f"{SERVICE}/ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest.FromString),
            f"{SERVICE}/ModelReady": (self.model_ready, pb.ModelReadyRequest.FromString),
        }
        self._handlers = {}
        for name, (handler, deserialize) in local.items():
            self._handlers[f"/{name}"] = reading.budgeted(
                grpc.unary_unary_rpc_method_handler(
                    handler,
                    request_deserializer=deserialize,
                    response_serializer=lambda message: message.SerializeToString(),
                ),
                control or self.budget,
            )

    def service(self, handler_call_details):
        method = handler_call_details.method
        forwarded = self._forwarded.get(method)
        kept = forwarded is not None  # handlers for custom methods are not kept: clients choose those names
        if forwarded is None:
            handler = self._handlers.get(method)
            if handler is not None or not self.allow_any_method or method.startswith(NEVER_FORWARDED):
                return handler
            forwarded = self._forwarded_as(method.lstrip("/"))
        try:
            header_id = _unchecked_id_in_headers(handler_call_details.invocation_metadata)
        except status.RpcError as error:
            return _refusing(error)
        key = (method, header_id)
        handler = self._routed.get(key)
        if handler is None:
            try:  # only here: the id of a kept handler passed it as the handler was kept
                if header_id:
                    modelspec.check_model_id(header_id)
            except status.RpcError as error:
                return _refusing(error)
            method_name, label = forwarded
            forward = functools.partial(InferenceService._forward, self, method_name, label, header_id)
            handler = grpc.stream_unary_rpc_method_handler(forward)  # read under the budget
            if kept:
                if len(self._routed) >= ROUTED_HANDLERS_MAX:
                    self._routed.clear()
                self._routed[key] = handler
        return handler

    @staticmethod
    def _forwarded_as(method: str) -> tuple[str, str]:
        """(method, metric label): the V2 method's name for those every worker serves, "other" for any
        other (clients choose those names, under our service's prefix too: one series each)."""
        known = method in (protocol.METHOD_INFER, protocol.METHOD_METADATA)
        return method, method.rsplit("/", 1)[-1] if known else "other"

    async def _forward(self, method: str, label: str, header_id: str, request_iterator, context) -> bytes:
        started = time.perf_counter()
        model_id, request = header_id, b""
        try:
            about = (model_id, label, started)  # for _read_ended()
            request = await reading.read_request(self.budget, context, self._read_ended, about)
            if not model_id:
                model_id = model_id_in_request(request)
            response = await self.dispatcher.call(model_id, method, request, context.time_remaining())
            if len(response) >= HELD_RESPONSE_BYTES:
                self._hold_until_sent(model_id, len(response), context)
        except status.RpcError as error:
            del request  # the abort's traceback holds this frame: not the request with it
            # Counted first: abort() sends the status before it returns, and a
            # client may read the metrics the moment it has its answer.
            self._observe(model_id, label, error.code.name, started)
            await status.abort(context, error)
        except asyncio.CancelledError:
            # Most often grpc's deadline beat the dispatcher's own timer: the client sees
            # DEADLINE_EXCEEDED all the same. A call its client cancelled was never answered.
            remaining = context.time_remaining()
            if remaining is not None and remaining < DEADLINE_SLACK_SECONDS:
                self._observe(model_id, label, "DEADLINE_EXCEEDED", started)
            raise
        self._observe(model_id, label, "OK", started)
        if len(request) >= heap.TRIM_AFTER_BYTES or len(response) >= heap.TRIM_AFTER_BYTES:
            self.heap.note()
        return response

    def _hold_until_sent(self, model_id: str, size: int, context) -> None:
        """Counts a big response against the byte budget until its call ends (RESOURCE_EXHAUSTED
        when it would pass a limit): grpc keeps it until the client has read it all."""
        self.budget.hold_response(model_id, size)
        context.add_done_callback(lambda _: self.budget.release_response(model_id, size))

    def _read_ended(self, error: status.RpcError, model_id: str, label: str, started: float) -> None:
        """The budget ended the call's read: its handler ends with grpc's abort, past any tally."""
        self._observe(model_id, label, error.code.name, started)

    def _observe(self, model_id: str, label: str, code: str, started: float) -> None:
        if self.supervisor.is_known(model_id):  # ids of unknown models come from clients: not a label
            self.metrics.observe_call(model_id, label, code, time.perf_counter() - started)

    async def server_live(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, context):
        return pb.ServerReadyResponse(ready=self.supervisor.ready)

    async def server_metadata(self, request, context):
        return pb.ServerMetadataResponse(name="mesh-runtime", version=__version__)

    async def model_ready(self, request, context):
        try:
            model_id = model_id_in_headers(context.invocation_metadata()) or request.name
            modelspec.check_model_id(model_id)  # as ModelInfer's: an empty or a 1 MiB name is refused
            if not self.supervisor.is_ready(model_id):
                raise status.model_not_found(model_id)
        except status.RpcError as error:
            await status.abort(context, error)
        return pb.ModelReadyResponse(ready=True)
