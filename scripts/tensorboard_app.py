"""The script a CML Application runs for TensorBoard (Applications run a script with no arguments): `textsql tensorboard`
on the runs root ($TEXTSQL_RUNS_ROOT, else runs), bound to 127.0.0.1 on $CDSW_APP_PORT."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a file: import the package from this checkout (the project folder), whether or not it is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from textsql.cli import main

    sys.exit(main(["tensorboard", *sys.argv[1:]]))
