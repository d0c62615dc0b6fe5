"""ONNX models, run by onnxruntime on the CPU.

modelPath is the .onnx file or the folder holding it. Inputs and outputs keep
the graph's own names, types and shapes, and metadata() reports them. The
session runs WORKER_THREADS threads per operator (1 when unset): the front
sends a worker that many requests at once, and a pod runs many workers, so
more threads would only fight over the same cores.
"""

from __future__ import annotations

import numpy as np

from workers import formats, v2
from workers.formats import common

# onnx tensor type -> V2 datatype; the numpy dtype comes from v2.DATATYPES.
DATATYPE_OF_ONNX: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def _types(onnx_type: str) -> tuple[str, np.dtype | None]:
    """(V2 datatype, numpy dtype onnxruntime takes) for an onnx tensor type; ("", None) if V2 has none."""
    datatype = DATATYPE_OF_ONNX.get(onnx_type, "")
    return datatype, (v2.DATATYPES[datatype][0] if datatype else None)


def load(path: str) -> OnnxModel:
    import onnxruntime

    session = onnxruntime.InferenceSession(
        common.model_file(path, "onnx"), _session_options(), providers=["CPUExecutionProvider"]
    )
    model = OnnxModel(session)
    model.rehearse()
    return model


def warm() -> None:
    """Fork server: what a load does before it creates the session, which is not fork-safe."""
    import onnxruntime

    _session_options()
    onnxruntime.get_available_providers()  # InferenceSession checks the providers it is given against these


def touch_compute_code() -> None:
    """A throwaway child of the fork server (warming.py): a session's set-up and its first run.

    Creating a session runs onnxruntime's graph optimizers, and its first run
    the CPU kernels of the commonest small-model operators: code that no
    import touched, which the kernel would otherwise read into the page cache
    on the first model's load and calls. The graph is written here byte by
    byte, since the onnx package that builds graphs is not needed to serve.
    """
    import onnxruntime

    session = onnxruntime.InferenceSession(
        _small_graph(), _session_options(), providers=["CPUExecutionProvider"]
    )
    session.run(None, {"features": np.zeros((2, 4), dtype=np.float32)})


def _small_graph() -> bytes:
    """An ONNX model (opset 13): features [batch, 4] -> MatMul, Add, Relu, Sigmoid, Softmax, ArgMax."""
    nodes = [
        _node("MatMul", ["features", "W"], "scores"),
        _node("Add", ["scores", "b"], "logits"),
        _node("Relu", ["logits"], "rectified"),
        _node("Sigmoid", ["rectified"], "squashed"),
        _node("Softmax", ["squashed"], "probabilities", _int_attribute("axis", 1)),
        _node("ArgMax", ["probabilities"], "label", _int_attribute("axis", 1), _int_attribute("keepdims", 0)),
    ]
    graph = b"".join(
        [
            *(_bytes_field(1, node) for node in nodes),
            _bytes_field(2, b"touch"),
            _bytes_field(5, _float_tensor("W", np.ones((4, 3), dtype=np.float32))),
            _bytes_field(5, _float_tensor("b", np.zeros(3, dtype=np.float32))),
            _bytes_field(11, _tensor_info("features", _FLOAT, ["batch", 4])),
            _bytes_field(12, _tensor_info("probabilities", _FLOAT, ["batch", 3])),
            _bytes_field(12, _tensor_info("label", _INT64, ["batch"])),
        ]
    )
    opset = _bytes_field(1, b"") + _int_field(2, 13)
    return _int_field(1, 8) + _bytes_field(7, graph) + _bytes_field(8, opset)  # IR version 8


# onnx.proto's TensorProto.DataType and AttributeProto.AttributeType values.
_FLOAT, _INT64, _ATTRIBUTE_INT = 1, 7, 2


def _node(op_type: str, inputs: list[str], output: str, *attributes: bytes) -> bytes:
    fields = [*(_bytes_field(1, name.encode()) for name in inputs), _bytes_field(2, output.encode())]
    return b"".join([*fields, _bytes_field(4, op_type.encode()), *(_bytes_field(5, a) for a in attributes)])


def _int_attribute(name: str, value: int) -> bytes:
    return _bytes_field(1, name.encode()) + _int_field(3, value) + _int_field(20, _ATTRIBUTE_INT)


def _float_tensor(name: str, values: np.ndarray) -> bytes:
    dims = b"".join(_int_field(1, dim) for dim in values.shape)
    return dims + _int_field(2, _FLOAT) + _bytes_field(8, name.encode()) + _bytes_field(9, values.tobytes())


def _tensor_info(name: str, element_type: int, shape: list) -> bytes:
    dims = b"".join(
        _bytes_field(1, _int_field(1, dim) if isinstance(dim, int) else _bytes_field(2, dim.encode()))
        for dim in shape
    )
    tensor_type = _int_field(1, element_type) + _bytes_field(2, dims)
    return _bytes_field(1, name.encode()) + _bytes_field(2, _bytes_field(1, tensor_type))


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _session_options():
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = formats.worker_threads()
    options.inter_op_num_threads = 1
    # Idle pool threads would otherwise spin on the cores other workers need.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OnnxModel:
    handles_methods = False

    def __init__(self, session):
        self.session = session
        self.inputs = session.get_inputs()
        outputs = session.get_outputs()
        self.output_names = [o.name for o in outputs]
        # Outputs V2 cannot carry (skl2onnx's ZipMap: a sequence of maps) are left out of the
        # default, so that a call that names no output gets the others instead of an error.
        self.carried = [o.name for o in outputs if _types(o.type)[0]] or self.output_names
        self.types = {o.name: o.type for o in outputs}

    def rehearse(self) -> None:
        """Runs the graph once on zeros, so that the first call does not pay for the first run.

        onnxruntime sets itself up at the first run in a process, which the fork
        server cannot do for the workers: it holds no session.
        """
        feed = {}
        for graph_input in self.inputs:
            dtype = _types(graph_input.type)[1]
            if dtype is None or dtype.kind == "O":
                return  # no zeros to make up for this input
            shape = [dim if isinstance(dim, int) and dim > 0 else 1 for dim in graph_input.shape or []]
            feed[graph_input.name] = np.zeros(shape, dtype=dtype)
        try:
            self.session.run(self.output_names, feed)
        except Exception:
            pass  # made-up sizes may not fit the graph: then the first call pays

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        common.check_requested(requested_outputs, self.output_names)
        for name in requested_outputs:
            if name not in self.carried:
                raise v2.InvalidInput(f"output {name!r} is {self.types[name]}, which V2 cannot carry")
        feed = {graph_input.name: _fed(graph_input, inputs) for graph_input in self.inputs}
        wanted = list(dict.fromkeys(requested_outputs)) or self.carried  # run only what was asked for
        return dict(zip(wanted, self.session.run(wanted, feed), strict=True))

    def metadata(self) -> dict:
        return {
            "platform": "onnxruntime_onnx",
            "inputs": [_described(node) for node in self.inputs],
            "outputs": [_described(node) for node in self.session.get_outputs()],
        }

    def close(self) -> None:
        pass


def _fed(graph_input, inputs: dict) -> np.ndarray:
    """The request's tensor for one graph input, checked against the graph's type."""
    array = inputs.get(graph_input.name)
    datatype, dtype = _types(graph_input.type)
    if array is None:
        raise v2.InvalidInput(
            f"the model needs input {graph_input.name!r} ({datatype or graph_input.type}); "
            f"the request has {', '.join(map(repr, inputs)) or 'no input'}"
        )
    if dtype is None:  # a type V2 has no name for: onnxruntime judges
        return array
    if array.dtype != dtype:
        raise v2.InvalidInput(
            f"input {graph_input.name!r} is {common.datatype_of(array.dtype)}; the model takes {datatype}"
        )
    if not _fits(array.shape, graph_input.shape):
        raise v2.InvalidInput(
            f"input {graph_input.name!r} has shape {list(array.shape)}; "
            f"the model takes {_described(graph_input)['shape']}"
        )
    return common.as_text(array) if dtype is object else array


def _fits(shape: tuple[int, ...], graph_shape) -> bool:
    """Same rank, and equal wherever the graph fixes a dimension (unknown shapes fit anything)."""
    if graph_shape is None:
        return True
    return len(shape) == len(graph_shape) and all(
        not isinstance(fixed, int) or fixed == size for fixed, size in zip(graph_shape, shape, strict=True)
    )


def _described(node) -> dict:
    datatype = _types(node.type)[0]
    # Symbolic or unknown dimensions (None, "batch") vary: -1.
    shape = [dim if isinstance(dim, int) else -1 for dim in (node.shape or [])]
    return common.tensor(node.name, datatype, shape)
