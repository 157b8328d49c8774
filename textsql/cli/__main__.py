"""`python -m textsql.cli COMMAND ...`: the same as the `textsql` command (and `python -m textsql`)."""

import sys

from textsql.cli import main

if __name__ == "__main__":
    sys.exit(main())
