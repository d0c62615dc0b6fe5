"""Entry point: `python -m runtime` (or the `mesh-runtime` console script).

Kept to light imports: multiprocessing may import the main module of the
front in places, and it should cost nothing there.
"""

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    # A SIGTERM during the imports below would kill the front with nothing yet to stop: held back
    # until run() has its handler (StopSignals.note_early), then delivered. Threads started meanwhile
    # keep them blocked, which is harmless: Python handles signals on the main thread.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))
    try:
        return _main(argv)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _main(argv: list[str] | None) -> int:
    from runtime.settings import Settings, SettingsError, help_text

    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if args:
        print(f"mesh-runtime: unexpected arguments {' '.join(args)}; see --help", file=sys.stderr)
        return 2
    try:
        settings = Settings.from_env()
    except SettingsError as error:
        print(f"mesh-runtime: {error}", file=sys.stderr)
        return 2
    from runtime.server import run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
