"""Worker processes: each holds one model and serves it over ZeroMQ.

Nothing here imports runtime/; the front imports workers.main (the process
entry), workers.protocol (the message schema) and workers.formats (the table
of formats, which is data and imports no framework).
"""
