"""model-mesh's arithmetic on what the runtime reports (../shared/specs/modelmesh-contract.md 1.2).

model-mesh counts memory in units of 8 KiB, rounding each size up. Of the
capacity we report it keeps part for unloads under way, and it refuses to
start below a minimum. Both depend on the loading concurrency and the
default model size we report with the capacity.
"""

from __future__ import annotations

UNIT_BYTES = 8192


def minimum_capacity(default_size: int) -> int:
    """The smallest capacity model-mesh accepts (it refuses to start below it)."""
    return max(2 * default_size, min(512 * 2**20, 10 * default_size))


def units_for_models(capacity: int, loading_threads: int, default_size: int) -> int:
    """The units of `capacity` model-mesh fills with models: what it keeps for unloads under way
    is clamp(loading threads x default units / (2, or 4 past two threads), 1 %, 10 %) of it."""
    units = capacity // UNIT_BYTES
    default_units = -(-default_size // UNIT_BYTES)
    kept = loading_threads * default_units // (2 if loading_threads <= 2 else 4)
    kept = min(max(kept, units // 100), units // 10)
    return units - kept
