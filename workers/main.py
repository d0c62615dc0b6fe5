"""Process entry of a worker, called by multiprocessing in the freshly forked child.

Kept free of heavy imports: the front imports this module to name the entry
point, and must not pull numpy or model code in with it. The fork server has
already imported workers.loop (workers/preload.py), so the import below
costs nothing in a worker.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from plumbing import lifeline, logsetup, priority, shmblocks, stacks, titles


def run(config: dict[str, Any]) -> None:
    lifeline.die_with_parent(lifeline.forkserver_pid())
    # Its own process group, which the front kills whole (runtime/worker.py kill_now()): with
    # whatever its model started.
    os.setpgid(0, 0)
    lifeline.children_die_with_this_process()
    priority.set_oom_score_adj(priority.WORKER_OOM_SCORE_ADJ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's to handle
    titles.set_title("worker spare", config["runtime_dir"])
    logsetup.setup("worker", config["log_level"], config["log_format"])
    stacks.dump_stacks_on_sigusr1(config["runtime_dir"])
    blocks = shmblocks.note_blocks(
        config["runtime_dir"], config["front"][0]
    )  # so that they go with their model
    # Before ZeroMQ starts its I/O thread, which inherits the policy.
    if config["sched_batch"] and not priority.schedule_as_batch_work():
        logging.getLogger("mesh.worker").warning(
            "the kernel refused SCHED_BATCH (WORKER_SCHED_BATCH); this worker may preempt the front"
        )
    from workers.loop import Worker

    worker = Worker(config, blocks)
    signal.signal(signal.SIGTERM, worker.on_sigterm)
    try:
        worker.serve()
    finally:
        lifeline.kill_children()
