"""The script a CML Application runs for `textsql compare` (Applications run a script with no arguments): the models
in $TEXTSQL_COMPARE_MODELS (label=folder, comma- or space-separated) on $TEXTSQL_DATASET_DIR, bound to 127.0.0.1 on
$CDSW_APP_PORT."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a file: import the package from this checkout (the project folder), whether or not it is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from textsql.cli import main

    sys.exit(main(["compare", *sys.argv[1:]]))
