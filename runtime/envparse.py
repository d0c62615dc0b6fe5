"""How an environment variable's text becomes a typed value, and the checks on that value.

Parsers take the text and return the value; checks take the value and raise
ValueError with a short reason. runtime/settings.py names the variable in
front of the reason.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any

# Ports model-mesh itself listens on inside the pod; a runtime must avoid them.
RESERVED_PORTS = {8080, 8089, 8090, *range(11881, 11900)}


def whole_number(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    # float() also reads "nan", "inf" and "1e400": no size can be computed from those.
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def text(text: str) -> str:
    return text


def absolute_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError(f"expected an absolute path, got {text!r}")
    return os.path.normpath(text)


def module_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def findable_modules(names: tuple[str, ...]) -> None:
    """Each module a fork server is to preload can be found: a fork server only prints the import
    error of one that cannot. Only a top-level name is looked up, which imports nothing: finding
    a submodule would import its package into the front."""
    bad = [n for n in names if not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise ValueError(f"not a module name: {bad[0]!r}")
    missing = [n for n in names if importlib.util.find_spec(n.partition(".")[0]) is None]
    if missing:
        raise ValueError(f"no module named {', '.join(map(repr, missing))} is installed")


def one_of(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return value

    return parse


def at_least(minimum: float) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value < minimum:
            raise ValueError(f"must be at least {minimum}, got {value}")

    return check


def between(minimum: float, maximum: float) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not minimum <= value <= maximum:
            raise ValueError(f"must be between {minimum} and {maximum}, got {value}")

    return check


def zero_or_at_least(minimum: float) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value != 0 and value < minimum:
            raise ValueError(f"must be 0 or at least {minimum}, got {value}")

    return check


def positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def port(value: int) -> None:
    if not 1 <= value <= 65535:
        raise ValueError(f"must be a TCP port (1-65535), got {value}")
    if value in RESERVED_PORTS:
        raise ValueError(f"port {value} is reserved by model-mesh (8080, 8089, 8090, 11881-11899)")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def installed_loop(name: str) -> None:
    if name == "uvloop" and not uvloop_installed():
        raise ValueError("uvloop is not installed (pip install uvloop, or set EVENT_LOOP=asyncio)")
