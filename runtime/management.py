"""The mmesh.ModelRuntime servicer: model-mesh's management calls, answered by the supervisor.

Thin on purpose: validate the request (runtime/modelspec.py), ask the
supervisor, build the response. Status codes come from runtime/status.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protos import model_runtime_pb2 as pb
from protos import model_runtime_pb2_grpc as pb_grpc
from runtime import __version__, modelspec, status
from runtime.meshunits import minimum_capacity
from runtime.settings import Settings
from runtime.supervisor import Supervisor

log = logging.getLogger("mesh.management")

# Methods model-mesh may forward, each with the path of the request field that
# holds the model id (field 1: model_name / name), where mesh injects the id.
METHOD_INFOS = {
    "inference.GRPCInferenceService/ModelInfer": [1],
    "inference.GRPCInferenceService/ModelMetadata": [1],
    "inference.GRPCInferenceService/ModelReady": [1],
}


# How long runtimeStatus waits for a fork server that died, or a warm spare, to be back before it
# answers STARTING instead: model-mesh asks again 2 s later, and reads the capacity only once.
SETTLE_SECONDS = 5.0
SETTLE_CHECK_SECONDS = 0.02


class ModelRuntimeServicer(pb_grpc.ModelRuntimeServicer):
    def __init__(self, settings: Settings, supervisor: Supervisor):
        self.settings = settings
        self.supervisor = supervisor

    def _resolve(self, request) -> modelspec.ModelSpec:
        return modelspec.resolve(
            request.modelId, request.modelType, request.modelPath, request.modelKey, self.settings
        )

    @status.translated
    async def loadModel(self, request, context):
        started = time.monotonic()
        try:
            # The path checks walk the model's files: off the event loop.
            spec = await asyncio.to_thread(self._resolve, request)
        except status.RpcError:
            # Refused before any worker is touched (a bad path, format or key): a failed load all the same.
            self.supervisor.metrics.observe_load("failed", time.monotonic() - started)
            raise
        size = await self.supervisor.load(spec)
        if self.settings.limit_model_concurrency:
            concurrency = self.settings.model_replicas * self.settings.worker_threads
            return pb.LoadModelResponse(sizeInBytes=size, maxConcurrency=concurrency)
        return pb.LoadModelResponse(sizeInBytes=size)

    @status.translated
    async def unloadModel(self, request, context):
        await self.supervisor.unload(request.modelId)
        return pb.UnloadModelResponse()

    @status.translated
    async def predictModelSize(self, request, context):
        try:
            spec = await asyncio.to_thread(self._resolve, request)
        except status.RpcError:
            size = modelspec.predicted_before_the_pull(
                request.modelId, request.modelType, request.modelPath, request.modelKey, self.settings
            )
            if size is None:
                raise
            return pb.PredictModelSizeResponse(sizeInBytes=size)
        return pb.PredictModelSizeResponse(sizeInBytes=self.supervisor.predicted_size(spec))

    @status.translated
    async def modelSize(self, request, context):
        return pb.ModelSizeResponse(sizeInBytes=await self.supervisor.model_size(request.modelId))

    @status.translated
    async def runtimeStatus(self, request, context):
        if not self.supervisor.ready:
            return pb.RuntimeStatusResponse(status=pb.RuntimeStatusResponse.STARTING)
        await self.supervisor.purge()
        if not await self._settled():
            log.warning(
                "answering STARTING: a fork server or a warm spare is not back after %.0f s, and the "
                "capacity model-mesh reads once would count without it",
                SETTLE_SECONDS,
            )
            return pb.RuntimeStatusResponse(status=pb.RuntimeStatusResponse.STARTING)
        capacity = await asyncio.to_thread(self.supervisor.report_capacity)
        if capacity < minimum_capacity(self.settings.default_modelsize):
            log.error(
                "capacity %d bytes is below what model-mesh accepts (%d); answering FAILING",
                capacity,
                minimum_capacity(self.settings.default_modelsize),
            )
            return pb.RuntimeStatusResponse(status=pb.RuntimeStatusResponse.FAILING)
        return pb.RuntimeStatusResponse(
            status=pb.RuntimeStatusResponse.READY,
            capacityInBytes=capacity,
            maxLoadingConcurrency=self.settings.max_loading_concurrency,
            modelLoadingTimeoutMs=self.settings.loadtime_timeout,
            defaultModelSizeInBytes=self.settings.default_modelsize,
            runtimeVersion=__version__,
            methodInfos={
                name: pb.RuntimeStatusResponse.MethodInfo(idInjectionPath=path)
                for name, path in METHOD_INFOS.items()
            },
            limitModelConcurrency=self.settings.limit_model_concurrency,
            allowAnyMethod=self.settings.allow_any_method,
        )

    async def _settled(self) -> bool:
        """Whether the pool is settled (WorkerPool.settled), waiting up to SETTLE_SECONDS for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_SECONDS
        while not self.supervisor.pool.settled():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(SETTLE_CHECK_SECONDS)
        return True
