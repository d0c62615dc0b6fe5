"""PyTorch models saved as TorchScript (torch.jit.save, a .pt file), run on the CPU.

modelPath is the .pt file or the folder holding it. The first input tensor
is passed to forward(); what forward() returns is named the way Triton names
it: a tensor is `output__0`, a tuple or list gives `output__0`, `output__1`...,
and a dict keeps its keys.
"""

from __future__ import annotations

import io

import numpy as np

from workers import v2
from workers.formats import common

INPUT_NAME = "input__0"


def load(path: str) -> TorchScriptModel:
    import torch

    module = torch.jit.load(common.model_file(path, "pytorch"), map_location="cpu")
    module.eval()
    return TorchScriptModel(torch, module)


def warm() -> None:
    """Fork server: saves, loads and runs a TorchScript module that computes on ints only.

    TorchScript sets its interpreter up at the first run of any module (tens
    of ms, and memory each worker would keep its own copy of); adding two
    ints runs no tensor op, so torch's thread pool stays unstarted.
    """
    import torch

    class AddOne(torch.nn.Module):
        def forward(self, number: int) -> int:
            return number + 1

    saved = io.BytesIO()
    torch.jit.save(torch.jit.script(AddOne()), saved)
    saved.seek(0)
    with torch.jit.optimized_execution(False):  # the executor the calls run (TorchScriptModel)
        torch.jit.load(saved, map_location="cpu")(1)


def touch_compute_code() -> None:
    """A throwaway child of the fork server (warming.py): the tensor ops of a small model's first calls.

    Runs a scripted module of the commonest layers once, on the executor the
    calls run, so that the code of their CPU kernels is in the page cache
    before the first model loads.
    """
    import torch

    class SmallNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = torch.nn.Linear(4, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            scores = self.out(torch.relu(self.hidden(features)))
            return torch.cat([torch.softmax(scores, dim=1), torch.sigmoid(scores)], dim=1).argmax(dim=1)

    module = torch.jit.script(SmallNet().eval())
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        module(torch.zeros((2, 4)))


class TorchScriptModel:
    handles_methods = False

    def __init__(self, torch, module):
        self.torch = torch
        self.module = module

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        array = common.first_input(inputs)
        if array.dtype.kind not in "biuf":
            raise v2.InvalidInput(
                f"input is {common.datatype_of(array.dtype)}; TorchScript models take numbers"
            )
        # A copy: received tensors are read-only views of the request, and a
        # module may write into its input.
        tensor = self.torch.from_numpy(np.array(array))
        # Without the graph executor's optimizing pass: on the CPU it fuses nothing by default,
        # and it would compile each module's graph again at its second call, memory that a packed
        # model's size, measured at load, does not hold. The flag is per thread, so set per call.
        with self.torch.inference_mode(), self.torch.jit.optimized_execution(False):
            result = self.module(tensor)
        return _named(result)

    def metadata(self) -> dict:
        # TorchScript keeps argument names but neither datatypes nor shapes: those stay unknown.
        inputs = [common.tensor(name, "", []) for name in self._argument_names()]
        return {
            "platform": "pytorch_libtorch",
            "inputs": inputs,
            "outputs": [common.tensor("output__0", "", [])],
        }

    def _argument_names(self) -> list[str]:
        try:
            arguments = self.module.forward.schema.arguments[1:]  # [0] is self
            return [argument.name for argument in arguments][:1] or [INPUT_NAME]
        except (AttributeError, RuntimeError):
            return [INPUT_NAME]

    def close(self) -> None:
        pass


def _named(result) -> dict:
    if isinstance(result, dict):
        return {str(name): _array(value) for name, value in result.items()}
    if isinstance(result, (tuple, list)):
        return {f"output__{index}": _array(value) for index, value in enumerate(result)}
    return {"output__0": _array(result)}


def _array(value) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # numpy has none: widened, as BF16 inputs are
            value = value.float()
        return value.numpy()
    return np.asarray(value)
