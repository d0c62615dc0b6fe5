"""What a loadModel / predictModelSize request asks for, checked before any worker is touched.

`resolve()` turns the request's modelId, modelType, modelPath and modelKey into
a ModelSpec, or raises INVALID_ARGUMENT / FAILED_PRECONDITION (which promise
model-mesh that nothing was loaded):

- the path, after normalising `..`, lies inside ROOT_MODEL_DIR, and every
  symlink on it or under it leads into ROOT_MODEL_DIR or PVC_MOUNTS_DIR
  (where ModelMesh Serving's puller links PVC storage);
- the format comes from modelKey `model_type.name`, else modelType
  (`mt:<format>[:<version>]`), else the files, and is one we know;
- the format's framework is installed and its files are there.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import os
import re
from typing import Any

from runtime import status
from runtime.settings import Settings
from workers import formats

MAX_MODEL_ID_BYTES = 1024
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL_CHARACTER = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# A model folder with more entries than this is refused rather than walked.
MAX_MODEL_FILES = 10000
# The endings of what an import loads: .py, .pyc, and extension modules.
_MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_id: str
    path: str  # absolute, symlinks resolved
    format: formats.Format
    disk_bytes: int  # bytes of the model's files, following symlinks
    # Python modules of its own beside its model.py (a helpers.py, a package): such a model needs a
    # worker of its own. A pack holds many models' folders on sys.path, and a module a model
    # imports after its load (inside predict, say) would come from whichever folder is first.
    brings_modules: bool = False


def resolve(
    model_id: str,
    model_type: str,
    model_path: str,
    model_key: str,
    settings: Settings,
    known_formats: tuple[formats.Format, ...] = formats.FORMATS,
) -> ModelSpec:
    check_loadable_id(model_id)
    key = parse_key(model_key)
    try:
        return _resolved(model_id, model_type, model_path, key, settings, known_formats)
    except OSError as error:  # an unreadable folder, a symlink loop: the files' fault, told as such
        raise status.failed_precondition(
            f"modelPath {model_path}: cannot read {error.filename or model_path}: {error.strerror}"
        ) from None


def _resolved(
    model_id: str,
    model_type: str,
    model_path: str,
    key: dict[str, Any],
    settings: Settings,
    known_formats: tuple[formats.Format, ...],
) -> ModelSpec:
    path, disk_bytes = checked_path(model_path, settings)
    if not _is_text(path):  # the worker is told the path in msgpack, as UTF-8 text
        raise status.failed_precondition(
            f"modelPath {model_path} leads to {path!r}, a name that is not UTF-8: rename it"
        )
    fmt = detect_format(key, model_type, path, known_formats)
    if fmt.framework and importlib.util.find_spec(fmt.framework) is None:
        raise status.failed_precondition(
            f"format {fmt.name!r} needs {fmt.framework}, which is not installed: "
            f"pip install 'mesh-runtime[{fmt.extra}]'"
        )
    if os.path.isdir(path) and not any(fmt.matches(name) for name in os.listdir(path)):
        raise status.failed_precondition(
            f"{model_path} holds no file of format {fmt.name!r} ({', '.join(fmt.file_names + fmt.suffixes)})"
        )
    brings_modules = fmt.imports_from_its_folder and _holds_modules(path)
    return ModelSpec(model_id, path, fmt, disk_bytes, brings_modules)


def _is_text(path: str) -> bool:
    """Whether `path` is UTF-8 on disk: a name that is not holds surrogate escapes here."""
    try:
        path.encode()
    except UnicodeEncodeError:
        return False
    return True


def _holds_modules(path: str) -> bool:
    """Whether the folder of the model at `path` (model.py, or the folder holding it) holds Python
    code besides it that an import could find: a module (source, compiled or extension), or a
    folder named like a package with such a module anywhere under it (namespace packages too)."""
    source = os.path.join(path, "model.py") if os.path.isdir(path) else path
    for entry in os.scandir(os.path.dirname(source)):
        if entry.path == source or entry.name == "__pycache__":
            continue
        if entry.is_file() and entry.name.endswith(_MODULE_SUFFIXES):
            return True
        if entry.is_dir() and entry.name.isidentifier() and _holds_code(entry.path):
            return True
    return False


def _holds_code(folder: str) -> bool:
    for _, _, files in _folders(folder):  # unreadable folders are skipped, as in _walk
        if any(name.endswith(_MODULE_SUFFIXES) for name in files):
            return True
    return False


def _folders(path: str):
    """os.walk(path) following symlinks, each real folder once: a link back up the tree
    ("current -> .") would otherwise be walked ever deeper until the kernel refuses the path."""
    seen = set()
    for folder, dirs, files in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs.clear()
            continue
        seen.add(real)
        yield folder, dirs, files


def check_model_id(model_id: str) -> None:
    if not model_id:
        raise status.invalid_argument("modelId is empty")
    if len(model_id.encode()) > MAX_MODEL_ID_BYTES:
        raise status.invalid_argument(f"modelId is longer than {MAX_MODEL_ID_BYTES} bytes")


def check_loadable_id(model_id: str) -> None:
    """A model id fit to load: bounded, and free of control characters.

    The id goes into log lines and process titles: a newline would forge a
    log line, a NUL cannot be in a title. Checked at load only: an id that
    cannot be loaded is simply not found by inference calls.
    """
    check_model_id(model_id)
    control = _CONTROL_CHARACTER.search(model_id)
    if control is not None:
        raise status.invalid_argument(
            f"modelId {model_id!r} holds the control character {control.group()!r} at {control.start()}"
        )


def parse_key(model_key: str) -> dict[str, Any]:
    """modelKey JSON as a dict ({} when empty); unknown fields are kept and ignored."""
    if not model_key.strip():
        return {}
    try:
        key = json.loads(model_key)
    except json.JSONDecodeError as error:
        raise status.invalid_argument(f"modelKey is not valid JSON: {error}") from None
    except RecursionError:  # the decoder recurses per level of nesting
        raise status.invalid_argument("modelKey nests deeper than its JSON decoder reads") from None
    if not isinstance(key, dict):
        raise status.invalid_argument("modelKey must be a JSON object")
    return key


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def checked_path(model_path: str, settings: Settings) -> tuple[str, int]:
    """-> (the real path, bytes on disk); raises when the path is missing or escapes the roots."""
    path = _in_root(model_path, settings)
    if not os.path.lexists(path):
        raise status.failed_precondition(f"modelPath {model_path} does not exist")
    allowed = _roots(settings)
    real = _checked_target(path, model_path, allowed)
    disk_bytes = 0
    for name in _walk(real, model_path):
        _checked_target(name, model_path, allowed)
        disk_bytes += os.stat(name).st_size
    return real, disk_bytes


def _in_root(model_path: str, settings: Settings) -> str:
    """modelPath joined to ROOT_MODEL_DIR and normalised; raises when it is empty or leaves the root."""
    if not model_path:
        raise status.invalid_argument("modelPath is empty")
    if "\0" in model_path:
        raise status.invalid_argument("modelPath contains a NUL byte")
    root = settings.root_model_dir
    path = os.path.normpath(os.path.join(root, model_path))
    if not _inside(path, root):
        raise status.invalid_argument(f"modelPath {model_path} lies outside ROOT_MODEL_DIR ({root})")
    return path


def _roots(settings: Settings) -> tuple[str, ...]:
    """Where a model's files and the links on its path may lead: ROOT_MODEL_DIR and PVC_MOUNTS_DIR."""
    return (os.path.realpath(settings.root_model_dir), os.path.realpath(settings.pvc_mounts_dir))


def _checked_target(path: str, shown: str, allowed: tuple[str, ...]) -> str:
    real = os.path.realpath(path)
    if not any(_inside(real, folder) for folder in allowed):
        raise status.invalid_argument(
            f"modelPath {shown} leads through a symlink to {real}, outside ROOT_MODEL_DIR and PVC_MOUNTS_DIR"
        )
    try:
        os.stat(real)
    except FileNotFoundError:  # else (a loop, no permission) resolve() says what the OSError says
        raise status.failed_precondition(f"modelPath {shown}: {path} is a broken symlink") from None
    return real


def _walk(path: str, shown: str):
    """Every file under path (or path itself), symlinks followed; bounded."""
    if not os.path.isdir(path):
        yield path
        return
    count = 0
    for folder, dirs, files in _folders(path):
        count += len(dirs) + len(files)
        if count > MAX_MODEL_FILES:
            raise status.failed_precondition(f"modelPath {shown} holds more than {MAX_MODEL_FILES} files")
        for name in files:
            yield os.path.join(folder, name)


def format_name_from(key: dict[str, Any], model_type: str) -> str | None:
    """The format the request names: modelKey model_type(.name), else modelType mt:<format>."""
    model_type_field = key.get("model_type")
    if isinstance(model_type_field, dict) and model_type_field.get("name"):
        return str(model_type_field["name"])
    if isinstance(model_type_field, str) and model_type_field:
        return model_type_field
    if model_type.startswith("mt:"):
        return model_type[3:].split("|")[0].split(":")[0]
    return None


def detect_format(
    key: dict[str, Any], model_type: str, path: str, known_formats: tuple[formats.Format, ...]
) -> formats.Format:
    name = format_name_from(key, model_type)
    known = ", ".join(f.name for f in known_formats)
    if name is not None:
        fmt = formats.by_name(name, known_formats)
        if fmt is None:
            raise status.invalid_argument(f"unknown model format {name!r} (known: {known})")
        return fmt
    names = os.listdir(path) if os.path.isdir(path) else [os.path.basename(path)]
    for fmt in known_formats:
        if any(fmt.matches(n) for n in names):
            return fmt
    raise status.invalid_argument(
        f"cannot tell the model format from the files in {path}; name it in modelKey "
        f"model_type.name (known: {known})"
    )


def predicted_size(spec: ModelSpec, settings: Settings) -> int:
    """A conservative size for a model not loaded yet: bytes on disk x multiplier, never below
    the format's floor, for each of the MODEL_REPLICAS workers that will hold it."""
    one_copy = max(int(spec.disk_bytes * settings.modelsize_multiplier), size_floor(spec.format, settings), 1)
    return one_copy * settings.model_replicas


def predicted_before_the_pull(
    model_id: str, model_type: str, model_path: str, model_key: str, settings: Settings
) -> int | None:
    """predictModelSize's answer for a model whose files are not here yet, or None.

    Behind ModelMesh Serving's storage helper, predictModelSize carries the path in storage: the
    files are pulled only for loadModel. With the format named, each replica is predicted at the
    format's floor (or DEFAULT_MODELSIZE, if higher); loadModel answers the size measured.
    """
    check_loadable_id(model_id)
    try:
        path = _in_root(model_path, settings)
    except status.RpcError:
        return None  # resolve() says what is wrong with it
    if os.path.lexists(path):
        return None  # here after all: likewise
    # Answering for a path under a link that leads out of the roots would tell what is there.
    here = os.path.dirname(path)
    while not os.path.lexists(here):
        here = os.path.dirname(here)
    if not any(_inside(os.path.realpath(here), folder) for folder in _roots(settings)):
        return None
    fmt = formats.by_name(format_name_from(parse_key(model_key), model_type) or "")
    if fmt is None or (fmt.framework and importlib.util.find_spec(fmt.framework) is None):
        return None
    return max(size_floor(fmt, settings), settings.default_modelsize) * settings.model_replicas


def size_floor(fmt: formats.Format, settings: Settings) -> int:
    """The least a loaded model of `fmt` costs: its floor, plus its framework's import where the fork
    servers do not preload it (its worker imports it, and holds all that import allocates)."""
    if fmt.framework and fmt.framework not in settings.worker_preload:
        return fmt.size_floor + fmt.import_bytes
    return fmt.size_floor
