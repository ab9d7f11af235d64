"""The `tokcomp` console entry, apart from the package so that it runs before torch is imported: Ctrl-C from the
first instant (the package's imports take seconds) ends in one line and exit code 130, and `tokcomp --version`
answers from the installed metadata without importing torch."""
import os
import signal
import sys

STARTING = "tokcomp: interrupted; nothing was written (tokcomp was still starting)"


def main() -> int:
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)  # remembered even where an import swallows the KeyboardInterrupt
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        argv = sys.argv[1:]
        if argv == ["--version"]:
            from importlib.metadata import version

            print(f"tokcomp (timm_tokcomp) {version('timm-tokcomp')}")
            return 0
        from timm_tokcomp.cli import main as run  # torch, timm, huggingface_hub: seconds

        if interrupted:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here the command's own handler says what it
        # kept
    except KeyboardInterrupt:
        # half-imported modules (torch's threads among them) can hang the interpreter's teardown: leave at once
        print(STARTING, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
