"""The committed generated code is fresh, and our model-runtime.proto is wire-identical to the seed."""

import filecmp
import os
import subprocess
import sys
import tempfile

import pytest
from google.protobuf import descriptor_pb2
from harness import REPO

GENERATED = [
    "model_runtime_pb2.py",
    "model_runtime_pb2.pyi",
    "model_runtime_pb2_grpc.py",
    "grpc_predict_v2_pb2.py",
    "grpc_predict_v2_pb2.pyi",
    "grpc_predict_v2_pb2_grpc.py",
]
SEED = os.path.join(REPO, "..", "shared", "seeds", "model-runtime.proto")


def test_committed_code_matches_gen_protos(tmp_path):
    subprocess.run([os.path.join(REPO, "scripts", "gen-protos"), str(tmp_path)], check=True)
    stale = [
        name
        for name in GENERATED
        if not filecmp.cmp(os.path.join(REPO, "protos", name), tmp_path / "protos" / name, shallow=False)
    ]
    assert not stale, f"run scripts/gen-protos: stale {stale}"


def _descriptor(include: str, proto: str) -> descriptor_pb2.FileDescriptorProto:
    with tempfile.TemporaryDirectory() as out:
        target = os.path.join(out, "set.pb")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{include}",
                f"--descriptor_set_out={target}",
                proto,
            ],
            check=True,
            cwd=include,
        )
        with open(target, "rb") as f:
            (file,) = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
    file.ClearField("name")  # where the file lives is not on the wire
    return file


@pytest.mark.skipif(
    not os.path.exists(SEED), reason="../shared/seeds/model-runtime.proto is not beside this checkout"
)
def test_model_runtime_proto_is_wire_identical_to_the_seed():
    ours = _descriptor(os.path.join(REPO, "protos"), "model-runtime.proto")
    seed = _descriptor(os.path.dirname(os.path.abspath(SEED)), "model-runtime.proto")
    assert ours == seed
