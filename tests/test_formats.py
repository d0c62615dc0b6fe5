"""Each model format end to end, on the bundled examples (scripts/make_examples.py).

Per format: loadModel, V2 inference compared with the framework called
directly on the same input, unload, memory back; the reported size against
the memory the runtime grew by; predictModelSize against the size. A format
whose framework is not installed is skipped with the extra to install (CI
installs the `all` extra, torch included: its CPU wheel installs in about
30 s). A missing framework is refused with FAILED_PRECONDITION naming the
extra, tested both through a runtime that cannot see the frameworks and on
modelspec.resolve directly.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import grpc
import numpy as np
import psutil
import pytest
from harness import REPO, MiB, Runtime, expect_status, mesh_headers, tree

from protos import grpc_predict_v2_pb2 as v2
from protos import model_runtime_pb2 as mm
from runtime import heaptrim, modelspec, status
from runtime import memory as meter
from runtime.settings import Settings
from workers import formats
from workers import v2 as v2_worker
from workers.formats import common

# The shared runtime preloads the frameworks, as in production: these tests measure them.
PRELOAD_FRAMEWORKS = True
# Importing every framework into the fork server, then loading and measuring each example,
# takes about 20 s of the suite.
pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_examples  # noqa: E402  (scripts/make_examples.py)

EXAMPLES = {example.format: example for example in make_examples.EXAMPLES}
FORMAT_NAMES = [example.format for example in make_examples.EXAMPLES]


@pytest.fixture(scope="module")
def examples(runtime):
    """format -> folder of its example inside the shared runtime's ROOT_MODEL_DIR."""
    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("the examples need scikit-learn's iris data: pip install 'mesh-runtime[sklearn]'")
    written = make_examples.make(runtime.models, log=lambda line: None)
    return {example.format: os.path.join(runtime.models, example.name) for example in written}


def example_path(examples, fmt: str) -> str:
    if fmt not in examples:
        missing = ", ".join(EXAMPLES[fmt].missing())
        pytest.skip(f"{missing} not installed: pip install 'mesh-runtime[{EXAMPLES[fmt].extra}]'")
    return examples[fmt]


# -- talking V2 ----------------------------------------------------------------------------


def infer(
    rt, model_id: str, array: np.ndarray, outputs=(), name=make_examples.INPUT_NAME, datatype="FP32"
) -> v2.ModelInferResponse:
    """ModelInfer with the input as raw bytes (as tritonclient sends it): the worker sees read-only views."""
    request = v2.ModelInferRequest(model_name=model_id)
    request.inputs.add(name=name, datatype=datatype, shape=array.shape)
    request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for output in outputs:
        request.outputs.add(name=output)
    return rt.infer.ModelInfer(request, metadata=mesh_headers(model_id), timeout=30)


NUMPY_OF = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


def outputs_of(response: v2.ModelInferResponse) -> dict[str, np.ndarray]:
    """The response's tensors as arrays; a raw request gets a raw response."""
    arrays = {}
    for index, tensor in enumerate(response.outputs):
        raw = response.raw_output_contents[index]
        arrays[tensor.name] = np.frombuffer(raw, dtype=NUMPY_OF[tensor.datatype]).reshape(tensor.shape)
    return arrays


def metadata(rt, model_id: str) -> v2.ModelMetadataResponse:
    return rt.infer.ModelMetadata(
        v2.ModelMetadataRequest(name=model_id), metadata=mesh_headers(model_id), timeout=10
    )


# -- the frameworks called directly ------------------------------------------------------


def direct(fmt: str, path: str, features: np.ndarray) -> dict[str, np.ndarray]:
    """What the framework itself answers for the example at path (all outputs)."""
    model_file = common.model_file(path, fmt)
    if fmt == "sklearn":
        import joblib

        estimator = joblib.load(model_file)
        return {"predict": estimator.predict(features), "predict_proba": estimator.predict_proba(features)}
    if fmt == "xgboost":
        import xgboost

        booster = xgboost.Booster(model_file=model_file)
        return {"predict": booster.predict(xgboost.DMatrix(features))}
    if fmt == "lightgbm":
        import lightgbm

        return {"predict": lightgbm.Booster(model_file=model_file).predict(features)}
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(model_file, providers=["CPUExecutionProvider"])
        names = [output.name for output in session.get_outputs()]
        return dict(zip(names, session.run(names, {make_examples.INPUT_NAME: features}), strict=True))
    if fmt == "pytorch":
        import torch

        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript, deprecated in torch 2.13
            return {"output__0": torch.jit.load(model_file)(torch.from_numpy(features.copy())).numpy()}
    spec = importlib.util.spec_from_file_location("iris_custom_model", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Model(path).predict({make_examples.INPUT_NAME: features})


def assert_same(served: dict, expected: dict) -> None:
    assert set(served) <= set(expected), f"outputs {sorted(served)}, framework gives {sorted(expected)}"
    for name, array in served.items():
        assert array.shape == np.shape(expected[name]), name
        np.testing.assert_allclose(array, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


# -- memory, measured from outside --------------------------------------------------------


def memory(rt) -> int:
    """The runtime tree's USS plus the kernel's share of each process (page tables, stacks: what
    a reported size counts too), leaving out the fork server's clean file pages.

    Those are library code the fork server read while importing the
    frameworks; they count as its unique memory only until some other
    process maps the same code, so they flip in and out of the total when a
    worker first runs that code (6-11 MiB for onnxruntime) or when any other
    process on the machine imports the same framework. What a model costs is
    the rest: anonymous memory and the code only its worker maps.
    """
    rt.settled_uss()  # waits until exactly one idle spare runs and nothing moves
    return sum(_unique(process) for process in tree(rt.pid))


def _unique(process: psutil.Process) -> int:
    try:
        if "forkserver" in " ".join(process.cmdline()):
            with open(f"/proc/{process.pid}/smaps_rollup") as rollup:
                fields = dict(line.split(":", 1) for line in rollup.read().splitlines()[1:])
            return int(fields["Private_Dirty"].split()[0]) * 1024
        return meter.cost(process.pid)
    except (psutil.NoSuchProcess, FileNotFoundError):
        return 0


# -- one test per format --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_format_end_to_end(rt, examples, fmt):
    path = example_path(examples, fmt)
    model_id = f"e2e-{fmt}"
    example = EXAMPLES[fmt]
    expected = direct(fmt, path, make_examples.SAMPLE)  # imports the framework here before measuring
    rt.load(f"warm-{fmt}", path, fmt=fmt)  # the front's first load of a format allocates a little
    rt.unload(f"warm-{fmt}")
    # The front gives its free heap back QUIET_SECONDS after a load or an exit (a few hundred
    # KiB): both readings wait for it, else the model's growth would be off by as much.
    time.sleep(heaptrim.QUIET_SECONDS + 0.5)

    before = memory(rt)
    size = rt.load(model_id, path, fmt=fmt).sizeInBytes
    try:
        time.sleep(heaptrim.QUIET_SECONDS + 0.5)
        # The size also covers what the worker's first calls will add; none has run yet.
        growth = memory(rt) - before + formats.by_name(fmt).first_calls_bytes
        assert abs(size - growth) <= 0.10 * growth, (
            f"reported {size / MiB:.2f} MiB, grew {growth / MiB:.2f} MiB"
        )

        served = outputs_of(infer(rt, model_id, make_examples.SAMPLE, outputs=example.outputs))
        assert served and set(served) == set(example.outputs or served)
        assert_same(served, expected)
        first = next(iter(served.values()))  # labels, or one probability per class
        assert list(first.argmax(axis=1) if first.ndim == 2 else first) == [0, 2], "a setosa and a virginica"

        predicted = rt.mesh.predictModelSize(
            mm.PredictModelSizeRequest(
                modelId="p", modelPath=path, modelKey=json.dumps({"model_type": {"name": fmt}})
            ),
            timeout=5,
        ).sizeInBytes
        serving_size = rt.mesh.modelSize(mm.ModelSizeRequest(modelId=model_id), timeout=5).sizeInBytes
        assert predicted >= serving_size, (
            f"size_floor {predicted / MiB:.1f} MiB < {serving_size / MiB:.1f} MiB serving"
        )
    except BaseException:
        rt.unload(model_id)  # the tests after this one need the runtime empty
        raise

    worker = rt.worker_for(model_id)
    rt.unload(model_id)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    after = memory(rt)
    assert abs(after - before) <= 2 * MiB, f"before {before / MiB:.2f} MiB, after {after / MiB:.2f} MiB"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_format_detected_from_files(rt, examples, fmt):
    path = example_path(examples, fmt)
    rt.load(f"detect-{fmt}", path, fmt=None)
    try:
        expected_platform = {"onnx": "onnxruntime_onnx", "pytorch": "pytorch_libtorch"}.get(fmt, fmt)
        assert metadata(rt, f"detect-{fmt}").platform == expected_platform
    finally:
        rt.unload(f"detect-{fmt}")


# -- what each format promises beyond the common path ----------------------------------------


@pytest.fixture
def loaded(rt, examples):
    """Loads the example of a format (by file, not folder) for one test: loaded(fmt) -> model id."""
    ids = []

    def load(fmt):
        folder = example_path(examples, fmt)
        model_file = common.model_file(folder, fmt)
        model_id = f"one-{fmt}"
        rt.load(model_id, model_file, fmt=fmt)
        ids.append(model_id)
        return model_id

    yield load
    for model_id in ids:
        rt.unload(model_id)


def test_sklearn_predict_proba_only_when_asked(rt, loaded):
    model_id = loaded("sklearn")
    assert list(outputs_of(infer(rt, model_id, make_examples.SAMPLE))) == ["predict"]
    only_proba = outputs_of(infer(rt, model_id, make_examples.SAMPLE, outputs=["predict_proba"]))
    assert list(only_proba) == ["predict_proba"] and only_proba["predict_proba"].shape == (2, 3)
    error = expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        infer,
        rt,
        model_id,
        make_examples.SAMPLE,
        outputs=["decision_function"],
    )
    assert "decision_function" in error.details()
    assert "(outputs: predict, predict_proba)" in error.details(), "the outputs it has, not those it ran"


def test_sklearn_metadata(rt, loaded):
    answer = metadata(rt, loaded("sklearn"))
    assert answer.platform == "sklearn"
    assert [(t.name, t.datatype, list(t.shape)) for t in answer.inputs] == [("input-0", "FP64", [-1, 4])]
    assert [(t.name, t.datatype, list(t.shape)) for t in answer.outputs] == [
        ("predict", "INT64", [-1]),
        ("predict_proba", "FP64", [-1, 3]),
    ]


@pytest.mark.parametrize("fmt", ["sklearn", "xgboost", "lightgbm"])
def test_tabular_input_of_the_wrong_shape_is_invalid_argument(rt, loaded, fmt):
    model_id = loaded(fmt)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    one_row = expect_status(invalid, infer, rt, model_id, make_examples.SAMPLE[0])
    assert "2-D" in one_row.details()
    five = expect_status(invalid, infer, rt, model_id, np.ones((1, 5), dtype=np.float32))
    assert "takes 4" in five.details()


@pytest.mark.parametrize("fmt", ["xgboost", "lightgbm"])
def test_tree_metadata(rt, loaded, fmt):
    answer = metadata(rt, loaded(fmt))
    assert answer.platform == fmt
    assert [(t.name, list(t.shape)) for t in answer.inputs] == [("input-0", [-1, 4])]
    assert [(t.name, list(t.shape)) for t in answer.outputs] == [("predict", [-1, 3])]


def test_onnx_uses_the_graph_names_and_types(rt, loaded):
    model_id = loaded("onnx")
    answer = metadata(rt, model_id)
    assert answer.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in answer.inputs] == [("features", "FP32", [-1, 4])]
    assert [(t.name, t.datatype, list(t.shape)) for t in answer.outputs] == [
        ("label", "INT64", [-1]),
        ("probabilities", "FP32", [-1, 3]),
    ]
    only_label = outputs_of(infer(rt, model_id, make_examples.SAMPLE, outputs=["label"]))
    assert list(only_label) == ["label"] and list(only_label["label"]) == [0, 2]
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    unknown = expect_status(invalid, infer, rt, model_id, make_examples.SAMPLE, outputs=["label", "nope"])
    assert "'nope'" in unknown.details() and "(outputs: label, probabilities)" in unknown.details()
    wrong_name = expect_status(invalid, infer, rt, model_id, make_examples.SAMPLE, name="x")
    assert "'features'" in wrong_name.details()
    wrong_type = expect_status(
        invalid, infer, rt, model_id, make_examples.SAMPLE.astype(np.float64), datatype="FP64"
    )
    assert "FP32" in wrong_type.details()
    wrong_shape = expect_status(invalid, infer, rt, model_id, np.ones((2, 5), dtype=np.float32))
    assert "[-1, 4]" in wrong_shape.details()


def test_pytorch_names_its_output_like_triton(rt, loaded):
    model_id = loaded("pytorch")
    assert list(outputs_of(infer(rt, model_id, make_examples.SAMPLE, name="anything"))) == ["output__0"]
    answer = metadata(rt, model_id)
    assert answer.platform == "pytorch_libtorch"
    assert [t.name for t in answer.inputs] == ["features"] and [t.name for t in answer.outputs] == [
        "output__0"
    ]


def test_framework_threads_come_from_worker_threads(monkeypatch):
    monkeypatch.delenv("WORKER_THREADS", raising=False)
    assert formats.worker_threads() == 1
    monkeypatch.setenv("WORKER_THREADS", "3")
    assert formats.worker_threads() == 3
    monkeypatch.setenv("WORKER_THREADS", "many")
    assert formats.worker_threads() == 1


# -- adapters called in this process, for what the examples do not cover -----------------------


def test_sklearn_reads_plain_pickles_and_text_pipelines(tmp_path):
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    import pickle

    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    from workers.formats import sklearn as adapter

    texts = ["great product", "terrible service", "great service", "terrible product"]
    pipeline = make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, [1, 0, 1, 0])
    with open(tmp_path / "model.pkl", "wb") as f:
        pickle.dump(pipeline, f)
    model = adapter.load(str(tmp_path))
    words = np.empty(2, dtype=object)
    words[:] = [b"great", "terrible"]  # BYTES arrive as bytes; str works too
    assert list(model.predict({"text": words}, {}, [])["predict"]) == [1, 0]
    assert model.metadata()["inputs"][0]["datatype"] == ""  # a text pipeline's input is not known


def test_xgboost_reads_ubjson(tmp_path):
    xgboost = pytest.importorskip("xgboost", reason="pip install 'mesh-runtime[xgboost]'")
    from workers.formats import xgboost as adapter

    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    booster = xgboost.train({"nthread": 1}, xgboost.DMatrix(rows, label=rows[:, 0] * 2), num_boost_round=3)
    booster.save_model(str(tmp_path / "model.ubj"))
    model = adapter.load(str(tmp_path))
    np.testing.assert_allclose(
        model.predict({"x": rows}, {}, [])["predict"], booster.predict(xgboost.DMatrix(rows))
    )
    assert model.metadata()["outputs"][0]["shape"] == [-1]


def test_a_truncated_lightgbm_file_is_refused_before_lightgbm_aborts_on_it(tmp_path):
    # LightGBM parses the trees in an OpenMP loop, where its exception for a tree cut short
    # cannot propagate: std::terminate, SIGABRT, and a pack's every model with it. In a child.
    pytest.importorskip("lightgbm", reason="pip install 'mesh-runtime[lightgbm]'")
    import lightgbm

    rows = np.arange(40, dtype=np.float64).reshape(20, 2)
    booster = lightgbm.train({"verbose": -1}, lightgbm.Dataset(rows, label=rows[:, 0]), num_boost_round=3)
    text = booster.model_to_string()
    (tmp_path / "model.txt").write_text(text[: text.index("end of trees") // 2])
    code = f"from workers.formats import lightgbm; lightgbm.load({str(tmp_path)!r})"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert loaded.returncode == 1, loaded.stderr
    assert "ValueError: " in loaded.stderr and "cut short: it has no 'end of trees' line" in loaded.stderr


@pytest.mark.parametrize("cut", [0, 100])
def test_an_empty_or_truncated_sklearn_file_is_told_so(tmp_path, cut):
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    import joblib
    from sklearn.linear_model import LinearRegression

    from workers.formats import sklearn as adapter

    joblib.dump(LinearRegression().fit([[0.0], [1.0]], [0.0, 1.0]), tmp_path / "model.joblib")
    saved = (tmp_path / "model.joblib").read_bytes()
    (tmp_path / "model.joblib").write_bytes(saved[:cut])
    with pytest.raises(EOFError, match="ends before its pickle does: empty or cut short"):
        adapter.load(str(tmp_path))


@pytest.mark.parametrize("content", [b'{"a json": 1}', b"plain text", b"\x80\x04\x95cut", bytes(range(64))])
def test_a_sklearn_file_that_is_no_pickle_is_told_so(tmp_path, content):
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    from workers.formats import sklearn as adapter

    (tmp_path / "model.joblib").write_bytes(content)
    with pytest.raises(ValueError, match="cannot unpickle .*: is it a scikit-learn model saved with joblib"):
        adapter.load(str(tmp_path))


@pytest.mark.parametrize("content", [b"", b'{"learner": {', b"{not ubj"])
def test_an_unreadable_xgboost_file_is_told_without_the_native_stack_trace(tmp_path, content):
    # The message becomes the load's gRPC status message: the library's backtrace (addresses in
    # libxgboost.so) would take most of its 1 KiB and tell the model's owner nothing.
    xgboost = pytest.importorskip("xgboost", reason="pip install 'mesh-runtime[xgboost]'")
    from workers.formats import xgboost as adapter

    (tmp_path / "model.json").write_bytes(content)
    with pytest.raises(xgboost.core.XGBoostError) as error:
        adapter.load(str(tmp_path))
    assert str(error.value).startswith(f"cannot read {tmp_path / 'model.json'}: ")
    assert "Stack trace" not in str(error.value) and "[bt]" not in str(error.value)


# -- the model file inside modelPath (no runtime needed) ----------------------------------------


def touch(folder, *names):
    os.makedirs(folder, exist_ok=True)
    for name in names:
        open(os.path.join(folder, name), "w").close()
    return str(folder)


def test_model_file_is_the_one_file_of_the_format(tmp_path):
    folder = touch(tmp_path / "a", "booster.json", "README.md")
    assert common.model_file(folder, "xgboost") == os.path.join(folder, "booster.json")
    assert common.model_file(os.path.join(folder, "booster.json"), "xgboost").endswith("booster.json")


def test_model_file_prefers_model_dot_ending_beside_sidecars(tmp_path):
    folder = touch(tmp_path / "b", "model.json", "model-settings.json")  # MLServer's layout
    assert common.model_file(folder, "xgboost") == os.path.join(folder, "model.json")


def test_model_file_refuses_ambiguity_and_absence(tmp_path):
    with pytest.raises(ValueError, match="2 such files"):
        common.model_file(touch(tmp_path / "c", "a.onnx", "b.onnx"), "onnx")
    with pytest.raises(ValueError, match="no such file"):
        common.model_file(touch(tmp_path / "d", "weights.bin"), "pytorch")


def test_datatype_names():
    assert common.datatype_of(np.float32) == "FP32"
    assert common.datatype_of(np.dtype(">f8")) == "FP64"
    assert common.datatype_of(np.int64) == "INT64"
    assert common.datatype_of(np.bool_) == "BOOL"
    assert common.datatype_of(np.dtype(object)) == "BYTES"
    assert common.datatype_of(np.complex64) == ""


def test_every_framework_format_names_an_extra_and_a_floor():
    for fmt in formats.FORMATS:
        if fmt.framework:
            assert fmt.extra and fmt.size_floor >= 8 * MiB, fmt
            assert formats.by_name(fmt.name.upper()) is fmt


# -- a framework that is not installed ----------------------------------------------------------


def test_resolve_names_the_extra_of_a_missing_framework(tmp_path):
    fake = formats.Format(
        "fakeformat",
        "workers.formats.fakeformat",
        framework="no_such_framework_xyz",
        extra="fakeformat",
        suffixes=(".fake",),
    )
    models = touch(tmp_path / "models" / "m", "model.fake")
    settings = Settings.from_env(
        {"ROOT_MODEL_DIR": str(tmp_path / "models"), "PVC_MOUNTS_DIR": str(tmp_path / "pvc")}
    )
    for key in (json.dumps({"model_type": {"name": "fakeformat"}}), ""):  # named, and detected from the files
        with pytest.raises(status.RpcError) as error:
            modelspec.resolve("m", "", models, key, settings, known_formats=(*formats.FORMATS, fake))
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "pip install 'mesh-runtime[fakeformat]'" in error.value.message


HIDING_SITECUSTOMIZE = """
    # Test shim: makes the modules named in MESH_TEST_HIDDEN look uninstalled
    # (importlib.util.find_spec answers None, import raises ModuleNotFoundError).
    import os, sys
    for name in filter(None, os.environ.get("MESH_TEST_HIDDEN", "").split(",")):
        sys.modules[name] = None
"""
FRAMEWORKS = {fmt.name: fmt for fmt in formats.FORMATS if fmt.framework}


def test_missing_framework_is_failed_precondition_naming_the_extra(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(textwrap.dedent(HIDING_SITECUSTOMIZE))
    hidden = ",".join(fmt.framework for fmt in FRAMEWORKS.values())
    with Runtime(PYTHONPATH=str(shim), MESH_TEST_HIDDEN=hidden) as runtime:
        for fmt in FRAMEWORKS.values():
            folder = touch(os.path.join(runtime.models, fmt.name), f"model{fmt.suffixes[0]}")
            for named in (fmt.name, None):
                error = expect_status(
                    grpc.StatusCode.FAILED_PRECONDITION, runtime.load, f"m-{fmt.name}", folder, fmt=named
                )
                assert f"pip install 'mesh-runtime[{fmt.extra}]'" in error.details()
                assert runtime.model_workers() == 0, "refused before any worker was touched"
                runtime.unload(f"m-{fmt.name}")


def test_a_torchscript_model_holds_no_more_memory_after_its_second_call(tmp_path):
    """Its size is measured at load and after its first call: a later call must not compile its
    graph again (the graph executor's optimizing pass), or a pack would grow past its sizes."""
    example = EXAMPLES["pytorch"]
    if example.missing() or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs torch and scikit-learn: pip install 'mesh-runtime[pytorch,sklearn]'")
    example.build(str(tmp_path), make_examples.iris())
    script = f"""
import numpy as np
from workers.formats import pytorch

def anonymous_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))

models = [pytorch.load({str(tmp_path)!r}) for _ in range(16)]
inputs = {{"features": np.ones((2, 4), dtype=np.float32)}}
for model in models:
    model.predict(inputs, {{}}, [])
before = anonymous_kib()
for _ in range(2):
    for model in models:
        model.predict(inputs, {{}}, [])
print(anonymous_kib() - before)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    # Compiling again costs about 17 KiB per model: 270 KiB for these 16.
    assert int(run.stdout.split()[-1]) < 64, run.stdout


def test_xgboost_predicts_float_rows_through_the_c_library_as_inplace_predict_does(tmp_path):
    example = EXAMPLES["xgboost"]
    if example.missing() or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs xgboost and scikit-learn: pip install 'mesh-runtime[xgboost,sklearn]'")
    example.build(str(tmp_path), make_examples.iris())
    model = formats.load("xgboost", str(tmp_path))
    assert model.dense is not None, "the direct path agreed with inplace_predict at load"
    rows = np.random.default_rng(7).uniform(0, 8, size=(5, 4))
    for dtype in (np.float32, np.float64):
        typed = rows.astype(dtype)
        read_only = np.frombuffer(typed.tobytes(), dtype=dtype).reshape(typed.shape)  # as a request's
        expected = model.booster.inplace_predict(typed)
        assert np.array_equal(model.dense.predict(read_only), expected)
        assert np.array_equal(model.predict({"x": read_only}, {}, [])["predict"], expected)
    whole = rows.astype(np.int64)  # not a float: inplace_predict serves it
    expected = model.booster.inplace_predict(whole)
    assert np.array_equal(model.predict({"x": whole}, {}, [])["predict"], expected)
    no_rows = np.zeros((0, 4), dtype=np.float32)  # the C function would be handed no data
    one_row = model.predict({"x": rows[:1].astype(np.float32)}, {}, [])["predict"]
    answer = model.predict({"x": no_rows}, {}, [])["predict"]
    assert answer.shape == (0, *one_row.shape[1:]) and answer.dtype == one_row.dtype


def test_lightgbm_answers_no_rows_with_the_columns_of_its_rows(tmp_path):
    example = EXAMPLES["lightgbm"]
    if example.missing() or importlib.util.find_spec("sklearn") is None:
        pytest.skip("needs lightgbm and scikit-learn: pip install 'mesh-runtime[lightgbm,sklearn]'")
    example.build(str(tmp_path), make_examples.iris())
    model = formats.load("lightgbm", str(tmp_path))
    one_row = model.predict({"x": np.ones((1, 4), dtype=np.float32)}, {}, [])["predict"]
    answer = model.predict({"x": np.zeros((0, 4), dtype=np.float32)}, {}, [])["predict"]
    assert one_row.shape == (1, 3), "a multiclass model: a probability per class"
    assert answer.shape == (0, 3) and answer.dtype == one_row.dtype
    assert model.metadata()["outputs"][0]["shape"] == [-1, 3]


def test_sklearn_answers_no_rows_as_the_other_formats_do(tmp_path):
    from workers.formats import sklearn as adapter

    if importlib.util.find_spec("sklearn") is None:
        pytest.skip("pip install 'mesh-runtime[sklearn]'")
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    EXAMPLES["sklearn"].build(str(tmp_path), make_examples.iris())
    model = formats.load("sklearn", str(tmp_path))
    both = [adapter.PREDICT, adapter.PREDICT_PROBA]
    one_row = model.predict({"x": np.ones((1, 4), dtype=np.float32)}, {}, both)
    answer = model.predict({"x": np.zeros((0, 4), dtype=np.float32)}, {}, both)
    for name, array in answer.items():
        assert array.shape == (0, *one_row[name].shape[1:]) and array.dtype == one_row[name].dtype

    texts = ["great product", "terrible service", "great service", "terrible product"]
    pipeline = make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, [1, 0, 1, 0])
    model = adapter.SklearnModel(pipeline)
    assert model.predict({"text": np.empty(0, dtype=object)}, {}, [])["predict"].shape == (0,)


def test_onnx_leaves_outputs_v2_cannot_carry_to_calls_that_name_them(tmp_path):
    """skl2onnx's classifiers answer probabilities as a ZipMap, a sequence of maps: by default
    a call gets the tensors beside it; one that names the map gets INVALID_ARGUMENT saying why."""
    if EXAMPLES["onnx"].missing():
        pytest.skip("pip install 'mesh-runtime[onnx]' onnx")
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.eye(2, 3, dtype=np.float32), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["scores"]),
        helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=0),
        helper.make_node(
            "ZipMap", ["scores"], ["probability"], domain="ai.onnx.ml", classlabels_int64s=[0, 1, 2]
        ),
    ]
    float_map = helper.make_map_type_proto(
        TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])
    )
    outputs = [
        helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
        helper.make_value_info("probability", helper.make_sequence_type_proto(float_map)),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])]
    graph = helper.make_graph(nodes, "zipmap", inputs, outputs, initializer=[weights])
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=8), str(tmp_path / "model.onnx"))
    model = formats.load("onnx", str(tmp_path))
    rows = np.array([[0, 1], [1, 0]], dtype=np.float32)
    assert {name: list(a) for name, a in model.predict({"x": rows}, {}, []).items()} == {"label": [1, 0]}
    with pytest.raises(
        v2_worker.InvalidInput, match="'probability' is seq.map.int64,tensor.float.... which V2"
    ):
        model.predict({"x": rows}, {}, ["label", "probability"])


def test_pytorch_bfloat16_outputs_are_widened_to_fp32():
    """numpy has no bfloat16, so .numpy() raised and every call of such a module was INTERNAL."""
    torch = pytest.importorskip("torch", reason="pip install 'mesh-runtime[pytorch]'")
    from workers.formats import pytorch as adapter

    outputs = adapter._named((torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.ones(1)))
    assert outputs["output__0"].dtype == np.float32 and list(outputs["output__0"]) == [1.5, -2.0]
    assert outputs["output__1"].dtype == np.float32
