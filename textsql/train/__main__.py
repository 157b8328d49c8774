"""The training process's entry point: `python -m textsql.train ARGS`, `deepspeed --module textsql.train ARGS` (a rank
under a launcher), the same command line as `textsql train`."""

import sys

from textsql.cli.train import train_command  # the process entry point is the command itself (import-linter: ignored)
from textsql.train.distributed import end_distributed

if __name__ == "__main__":
    status = train_command(sys.argv[1:])
    end_distributed(status == 0)
    sys.exit(status)
