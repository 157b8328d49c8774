"""Entry point for a CML Job: set the Job's script to `scripts/cml_job.py` and its arguments to a textsql command,
e.g. `cluster train --backend cml --workers 2 --nvidia_gpu 1 -- --model_id t5-small --deepspeed zero2 --epochs 3`.
A Job runs without a browser, so CML's idle timeout of sessions does not end a long training (or its worker pods,
each running torchrun with the launch's command, fixed when the Job creates it; the Job's own pod trains too)."""

import sys

from textsql.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
