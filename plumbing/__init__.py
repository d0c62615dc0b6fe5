"""OS plumbing the front and the workers both use.

- lifeline: the parent-death signal, and naming a process for good (pid and start time);
- priority: OOM score and scheduling policy;
- titles: process titles that name their RUNTIME_DIR;
- stacks: Python stacks on SIGUSR1;
- logsetup: log lines (text or JSON) on stderr.

Nothing here imports runtime/ or workers/.
"""
