"""`python -m ouroboros_local`: the same as the `ouroboros-local` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
