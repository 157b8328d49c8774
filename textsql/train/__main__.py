"""The training process's entry point: `python -m textsql.train ARGS`, `deepspeed --module textsql.train ARGS` (a rank
under a launcher), the same command line as `textsql train`."""

import sys

from textsql.cli.train import train_command  # the process entry point is the command itself (import-linter: ignored)
from textsql.extras import quiet_lifecycle_logs
from textsql.train.distributed import end_distributed

if __name__ == "__main__":
    quiet_lifecycle_logs()  # before transformers imports torchao (textsql.extras)
    status = train_command(sys.argv[1:])
    end_distributed(status == 0)
    sys.exit(status)
