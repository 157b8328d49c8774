"""`python -m textsql COMMAND ...`: the same as the `textsql` command."""

import sys

from textsql.cli import main

if __name__ == "__main__":
    sys.exit(main())
