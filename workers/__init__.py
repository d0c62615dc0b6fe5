"""Worker processes: each holds one model and serves it over ZeroMQ.

Nothing here imports runtime/. The front imports three modules of this
package and nothing else: workers.main (the process entry it names to
multiprocessing), workers.protocol (the message schema) and workers.formats
(the table of formats, which is data and imports no framework). What both
sides need from the OS lives in plumbing/.
"""
