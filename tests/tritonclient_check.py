"""Drives a running mesh-runtime with the official client, tritonclient[grpc].

Run as a script (python tritonclient_check.py PORT MODEL): tritonclient
registers its own copy of the `inference` protobuf package, which clashes
with ours in one process, so tests/test_inference.py runs this in a child.
Exits 0 when every check passes; an AssertionError otherwise.
"""

import sys

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def main(port: str, model: str) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready(model)
    metadata = client.get_model_metadata(model)
    assert metadata.name == model and metadata.inputs[0].name == "x", metadata

    floats = np.arange(8, dtype=np.float32).reshape(2, 4)
    words = np.array([b"hello", "wörld".encode(), b""], dtype=np.object_)
    inputs = [
        triton.InferInput("x", list(floats.shape), "FP32"),
        triton.InferInput("w", list(words.shape), "BYTES"),
    ]
    inputs[0].set_data_from_numpy(floats)
    inputs[1].set_data_from_numpy(words)
    result = client.infer(model, inputs)
    np.testing.assert_array_equal(result.as_numpy("x"), floats)
    assert list(result.as_numpy("w")) == list(words), result.as_numpy("w")
    try:
        client.is_model_ready("no-such-model")
        raise AssertionError("ModelReady for an unknown model answered")
    except InferenceServerException as error:  # NOT_FOUND, so that model-mesh reloads it
        assert error.status() == "StatusCode.NOT_FOUND", error.status()
    client.close()
    print("tritonclient checks passed")


if __name__ == "__main__":
    main(*sys.argv[1:])
