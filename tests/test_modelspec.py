"""Load-request checks in the front, without a runtime: format table, missing frameworks, sizes."""

import dataclasses
import json
import os

import pytest

from runtime import modelspec, status
from runtime.settings import Settings
from workers import formats


@pytest.fixture
def settings(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "pvc").mkdir()
    return Settings.from_env(
        {"ROOT_MODEL_DIR": str(tmp_path / "models"), "PVC_MOUNTS_DIR": str(tmp_path / "pvc")}
    )


def model_folder(settings, name, files):
    folder = f"{settings.root_model_dir}/{name}"
    os.makedirs(folder)
    for file_name, size in files.items():
        os.makedirs(os.path.dirname(f"{folder}/{file_name}"), exist_ok=True)
        with open(f"{folder}/{file_name}", "wb") as f:
            f.write(b"\0" * size)
    return folder


def test_missing_framework_is_failed_precondition_naming_the_extra(settings):
    absent = formats.Format(
        "fancy",
        "workers.formats.fancy",
        framework="no_such_framework_xyz",
        extra="fancy",
        suffixes=(".fancy",),
    )
    folder = model_folder(settings, "m", {"model.fancy": 10})
    with pytest.raises(status.RpcError) as error:
        modelspec.resolve(
            "m",
            "",
            folder,
            json.dumps({"model_type": {"name": "fancy"}}),
            settings,
            known_formats=(*formats.FORMATS, absent),
        )
    assert error.value.code.name == "FAILED_PRECONDITION"
    assert "pip install 'mesh-runtime[fancy]'" in error.value.message


@pytest.mark.parametrize(
    "files, brings",
    [
        ({"model.py": 10, "weights.npy": 10, "model-settings.json": 10}, False),
        ({"model.py": 10, "helpers.py": 10}, True),
        ({"model.py": 10, "native.cpython-311-x86_64-linux-gnu.so": 10}, True),
        ({"model.py": 10, "lib/__init__.py": 10}, True),
        ({"model.py": 10, "lib/util.py": 10}, True),  # a namespace package
        ({"model.py": 10, "data/table.csv": 10, "__pycache__/model.cpython-311.pyc": 10}, False),
        ({"model.py": 10, "ns/sub/__init__.py": 10}, True),  # a namespace package holding a package
        ({"model.py": 10, "native/fast.abi3.so": 10}, True),
        ({"model.py": 10, "compiled/__init__.pyc": 10}, True),
        ({"model.py": 10, "my-data/notes.py": 10}, False),  # no import can name that folder
    ],
)
def test_a_custom_model_with_python_modules_beside_its_model_py_is_told_apart(settings, files, brings):
    folder = model_folder(settings, "m", files)
    assert modelspec.resolve("m", "mt:python", folder, "", settings).brings_modules is brings
    # A model named by its file: its folder is the one that goes on sys.path.
    assert modelspec.resolve("f", "mt:python", f"{folder}/model.py", "", settings).brings_modules is brings


def test_only_custom_models_are_told_apart_by_their_modules(settings):
    folder = model_folder(settings, "m", {"model.joblib": 10, "helpers.py": 10})
    assert not modelspec.resolve("m", "mt:sklearn", folder, "", settings).brings_modules


def test_predicted_size_is_disk_times_multiplier_per_replica(settings):
    folder = model_folder(settings, "big", {"model.py": 40 * 2**20})
    spec = modelspec.resolve("big", "mt:python", folder, "", settings)
    assert modelspec.predicted_size(spec, settings) == int(40 * 2**20 * 1.25)
    two = dataclasses.replace(settings, model_replicas=2)
    assert modelspec.predicted_size(spec, two) == 2 * int(40 * 2**20 * 1.25)


def test_predicted_size_never_below_the_floor(settings):
    folder = model_folder(settings, "tiny", {"model.py": 10})
    spec = modelspec.resolve("tiny", "", folder, "", settings)
    assert modelspec.predicted_size(spec, settings) == spec.format.size_floor > 0


@pytest.mark.parametrize(
    "model_type, key, expected",
    [
        ("", '{"model_type": {"name": "sklearn", "version": "1"}}', "sklearn"),
        ("", '{"model_type": "xgboost"}', "xgboost"),
        ("mt:lightgbm:3|pv:grpc-v2", "", "lightgbm"),
        ("rt:mesh-runtime", "", None),
        ("mt:onnx", '{"model_type": {"name": "pytorch"}}', "pytorch"),  # the key wins over modelType
    ],
)
def test_format_name_sources(model_type, key, expected):
    assert modelspec.format_name_from(modelspec.parse_key(key), model_type) == expected


def sklearn_key() -> str:
    return json.dumps({"model_type": {"name": "sklearn"}})


def test_a_symlink_loop_in_the_model_folder_is_walked_once(settings):
    # A link back up the tree ("current -> .") is harmless to the load; walked, its files would
    # be met ever deeper until the kernel refuses the path (ELOOP), and counted each time.
    folder = model_folder(settings, "m", {"model.joblib": 1000, "data/extra.bin": 500})
    os.symlink(".", f"{folder}/current")
    os.symlink("..", f"{folder}/data/up")
    spec = modelspec.resolve("m", "", folder, sklearn_key(), settings)
    assert spec.disk_bytes == 1500


def test_a_custom_model_folder_with_symlink_loops_is_walked_once(settings):
    folder = model_folder(settings, "m", {"model.py": 10})
    os.makedirs(f"{folder}/assets")
    os.symlink(".", f"{folder}/assets/loop_a")
    os.symlink(".", f"{folder}/assets/loop_b")  # 2^40 paths to walk, if each were followed to ELOOP
    spec = modelspec.resolve("m", "", folder, json.dumps({"model_type": {"name": "python"}}), settings)
    assert not spec.brings_modules and spec.disk_bytes == 10


def test_a_modelpath_that_loops_is_failed_precondition_naming_the_loop(settings):
    folder = model_folder(settings, "m", {})
    os.symlink(f"{folder}/b", f"{folder}/a")
    os.symlink(f"{folder}/a", f"{folder}/b")
    with pytest.raises(status.RpcError) as error:
        modelspec.resolve("m", "", f"{folder}/a", sklearn_key(), settings)
    assert error.value.code.name == "FAILED_PRECONDITION"
    assert "symbolic links" in error.value.message


@pytest.mark.parametrize("name_key", ["", "sklearn"])
def test_an_unreadable_model_folder_is_failed_precondition_naming_it(settings, monkeypatch, name_key):
    # As root the test cannot make a folder unreadable: os.listdir fails as it would for another user.
    folder = model_folder(settings, "m", {"model.joblib": 10})
    listdir = os.listdir

    def refused(path="."):
        if os.path.realpath(path) == os.path.realpath(folder):
            raise PermissionError(13, "Permission denied", path)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refused)
    key = json.dumps({"model_type": {"name": name_key}}) if name_key else ""
    with pytest.raises(status.RpcError) as error:
        modelspec.resolve("m", "", folder, key, settings)
    assert error.value.code.name == "FAILED_PRECONDITION"
    assert error.value.message == f"modelPath {folder}: cannot read {folder}: Permission denied"


def test_a_file_that_cannot_be_reached_is_not_called_a_broken_symlink(settings, monkeypatch):
    folder = model_folder(settings, "m", {"model.joblib": 10})
    stat = os.stat

    def refused(path, *args, **kwargs):
        if str(path).endswith("model.joblib"):
            raise PermissionError(13, "Permission denied", path)
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", refused)
    with pytest.raises(status.RpcError) as error:
        modelspec.resolve("m", "", folder, sklearn_key(), settings)
    assert error.value.code.name == "FAILED_PRECONDITION"
    assert "symlink" not in error.value.message and "Permission denied" in error.value.message


def test_a_modelpath_leading_to_a_name_that_is_not_utf8_is_refused_before_a_worker(settings):
    # The worker is sent the real path as text (msgpack): such a name failed the load with
    # INTERNAL after a worker was taken, leaving a request pending for it.
    root = settings.root_model_dir.encode()
    os.makedirs(root + b"/d\xfeir")
    with open(root + b"/d\xfeir/model.joblib", "wb") as f:
        f.write(b"\0" * 10)
    os.symlink(root + b"/d\xfeir", root + b"/link")
    with pytest.raises(status.RpcError) as error:
        modelspec.resolve("m", "", "link", sklearn_key(), settings)
    assert error.value.code.name == "FAILED_PRECONDITION"
    assert "not UTF-8" in error.value.message


def test_a_modelkey_nested_too_deep_is_invalid_argument():
    with pytest.raises(status.RpcError) as error:
        modelspec.parse_key("[" * 100_000 + "]" * 100_000)
    assert error.value.code.name == "INVALID_ARGUMENT"
    assert error.value.message == "modelKey nests deeper than its JSON decoder reads"


@pytest.mark.parametrize("format_name", [f.name for f in formats.FORMATS if f.framework])
def test_predicted_size_holds_the_frameworks_import_where_the_fork_servers_do_not_preload_it(
    settings, format_name
):
    # Its worker then imports the framework itself: it measured 72-140 MiB for the examples of
    # scikit-learn, xgboost, lightgbm and torch, 26 MiB for onnx, each above its format's floor.
    fmt = formats.by_name(format_name)
    spec = modelspec.ModelSpec("m", f"{settings.root_model_dir}/m", fmt, disk_bytes=10)
    preloaded = dataclasses.replace(settings, worker_preload=("numpy", fmt.framework))
    not_preloaded = dataclasses.replace(settings, worker_preload=("numpy",))
    assert modelspec.predicted_size(spec, preloaded) == fmt.size_floor
    assert modelspec.predicted_size(spec, not_preloaded) >= fmt.size_floor + 25 * 2**20
