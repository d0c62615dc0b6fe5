"""mesh-runtime's benchmark (scripts/bench, or `.venv/bin/python -m bench`): a development tool, not shipped.

__main__      the command line: the life-cycle table, then the data plane, or either alone
lifecycle     load latency, idle spare USS, memory returned, predictModelSize latency
plan          the data plane's cases, their order and rounds (also `python -m bench.plan`)
h2load        one data-plane point: h2load's run, its output parsed, the checks around it
payloads      the ModelInfer requests sent and the checks of the answers
servers       the servers measured: canned, MLServer, mesh-runtime (meshtest.harness)
canned_server the bare grpc.aio server of cases (a), (a') and (a2), run with `python -m`
installers    h2load, MLServer and valgrind, installed on first use
report        the tables: figures, targets, PASS or MISS
instructions  instructions per call under callgrind (also `python -m bench.instructions`)
common        the repository's folder, progress lines, percentiles
"""
