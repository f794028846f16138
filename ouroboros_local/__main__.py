"""The `ouroboros-local` command and `python -m ouroboros_local`."""

import sys


def main() -> int:
    try:   # the command line's modules take a few hundred ms to import: a Ctrl-C then ends as one later does
        from .cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
