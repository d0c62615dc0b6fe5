"""Process titles that name the RUNTIME_DIR they belong to.

A front can then tell the processes an earlier front on the same folder left
(its own to kill) from anything else. /proc/PID/environ cannot tell:
setproctitle writes over it.
"""

import logging

from setproctitle import setproctitle

log = logging.getLogger("mesh.titles")

TITLE_PREFIX = "mesh-runtime "
RUNTIME_DIR_ENV = "MESH_RUNTIME_DIR"  # how the fork server learns it (set by the front)
_titled_dir = ""  # the RUNTIME_DIR this process last named in its title


def title(role: str, runtime_dir: str) -> str:
    """`mesh-runtime ROLE dir=RUNTIME_DIR`, e.g. `mesh-runtime worker model=m1 dir=/run/mesh`."""
    return f"{TITLE_PREFIX}{role} dir={runtime_dir}" if runtime_dir else f"{TITLE_PREFIX}{role}"


def set_title(role: str, runtime_dir: str | None = None) -> bool:
    """Titles this process (runtime_dir None: the one it named before); never raises, False if refused."""
    global _titled_dir
    if runtime_dir is not None:
        _titled_dir = runtime_dir
    try:
        setproctitle(title(role, _titled_dir))
        return True
    except (ValueError, OSError) as error:  # a NUL in a model id, say
        log.warning("cannot set the process title to %r: %s", role, error)
        return False


def is_runtime_process_of(cmdline: list[str], runtime_dir: str) -> bool:
    """True if a command line (psutil's split of it) is the title of a mesh-runtime process of runtime_dir.

    The directory ends the title, so a model id that holds " dir=..." cannot name another folder.
    """
    text = " ".join(part for part in cmdline if part)  # setproctitle pads with NULs: empty parts
    return bool(runtime_dir) and text.startswith(TITLE_PREFIX) and text.endswith(f" dir={runtime_dir}")
