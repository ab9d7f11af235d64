"""The `tokcomp` console entry, apart from the package so that it runs before torch is imported: Ctrl-C from the
first instant (the package's imports take seconds) ends in one line and exit code 130, and `tokcomp --version`
answers from the installed metadata without importing torch."""
import sys


def main() -> int:
    try:
        argv = sys.argv[1:]
        if argv == ["--version"]:
            from importlib.metadata import version

            print(f"tokcomp (timm_tokcomp) {version('timm-tokcomp')}")
            return 0
        from timm_tokcomp.cli import main as run  # torch, timm, huggingface_hub: seconds

        return run(argv)
    except KeyboardInterrupt:  # the command's own handler says what a run kept; this one, that none began
        print("tokcomp: interrupted; nothing was written (tokcomp was still starting)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
