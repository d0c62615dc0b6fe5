"""inference.GRPCInferenceService in the front: find the model id, forward bytes, map errors.

ModelInfer and ModelMetadata go to the model's worker as raw request bytes
(no deserialiser is registered for them, so grpc hands us bytes and sends the
worker's bytes back as they are). ServerLive, ServerReady, ServerMetadata and
ModelReady carry no tensors and are answered here.

The model id comes from the `mm-model-id-bin` header (UTF-8), else
`mm-model-id`, else field 1 of the request (where model-mesh injects it).

With ALLOW_ANY_METHOD, any other unary method is forwarded as bytes too; the
worker hands it to the model's handle(method, request_bytes).
"""
from __future__ import annotations

import time

import grpc

from protos import grpc_predict_v2_pb2 as pb
from protos import wire
from runtime import __version__, modelspec, status
from runtime.supervisor import Supervisor
from workers import protocol

SERVICE = "inference.GRPCInferenceService"
# Services of our own that ALLOW_ANY_METHOD never hands to a model.
NEVER_FORWARDED = ("/mmesh.", "/grpc.")


def model_id_of(metadata, request: bytes) -> str:
    """The model a request is for: from model-mesh's headers, else the request's field 1."""
    headers = dict(metadata or ())
    binary = headers.get("mm-model-id-bin")
    if binary:
        try:
            return binary.decode() if isinstance(binary, bytes) else binary
        except UnicodeDecodeError:
            raise status.invalid_argument("mm-model-id-bin is not UTF-8") from None
    if headers.get("mm-model-id"):
        return headers["mm-model-id"]
    try:
        model_id = wire.string_field(request, 1)
    except wire.WireError as error:
        raise status.invalid_argument(f"request is not a valid protobuf message: {error}") from None
    if not model_id:
        raise status.invalid_argument("no model id: send the mm-model-id header or set the request's model name")
    return model_id


class InferenceService(grpc.GenericRpcHandler):
    def __init__(self, supervisor: Supervisor, allow_any_method: bool):
        self.supervisor = supervisor
        self.metrics = supervisor.metrics
        self.allow_any_method = allow_any_method
        forwarded = {name: self._forwarder(name) for name in (protocol.METHOD_INFER, protocol.METHOD_METADATA)}
        local = {
            f"{SERVICE}/ServerLive": (self.server_live, pb.ServerLiveRequest),
            f"{SERVICE}/ServerReady": (self.server_ready, pb.ServerReadyRequest),
            f"{SERVICE}/ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            f"{SERVICE}/ModelReady": (self.model_ready, pb.ModelReadyRequest),
        }
        self._handlers = {f"/{name}": grpc.unary_unary_rpc_method_handler(handler)
                          for name, handler in forwarded.items()}
        for name, (handler, request_type) in local.items():
            self._handlers[f"/{name}"] = grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=request_type.FromString,
                response_serializer=lambda message: message.SerializeToString())

    def service(self, handler_call_details):
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None and self.allow_any_method and not method.startswith(NEVER_FORWARDED):
            # Built per call, not cached: method names come from clients.
            handler = grpc.unary_unary_rpc_method_handler(self._forwarder(method.lstrip("/")))
        return handler

    def _forwarder(self, method: str):
        # Metric labels: our own method names, "other" for custom ones (clients choose those).
        label = method.rsplit("/", 1)[-1] if method.startswith(SERVICE) else "other"

        async def forward(request: bytes, context) -> bytes:
            started = time.perf_counter()
            model_id, code = "", "OK"
            try:
                model_id = model_id_of(context.invocation_metadata(), request)
                modelspec.check_model_id(model_id)  # a 1 MiB id is refused, not looked up
                return await self.supervisor.call(model_id, method, request, context.time_remaining())
            except status.RpcError as error:
                code = error.code.name
                await status.abort(context, error)
            finally:
                if self.supervisor.is_known(model_id):
                    self.metrics.observe_call(model_id, label, code, time.perf_counter() - started)
        return forward

    async def server_live(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, context):
        return pb.ServerReadyResponse(ready=self.supervisor.ready)

    async def server_metadata(self, request, context):
        return pb.ServerMetadataResponse(name="mesh-runtime", version=__version__)

    async def model_ready(self, request, context):
        headers = dict(context.invocation_metadata() or ())
        model_id = request.name
        try:
            if headers.get("mm-model-id-bin") or headers.get("mm-model-id"):
                model_id = model_id_of(headers.items(), b"")
            if not self.supervisor.is_ready(model_id):
                raise status.model_not_found(model_id)
        except status.RpcError as error:
            await status.abort(context, error)
        return pb.ModelReadyResponse(ready=True)
