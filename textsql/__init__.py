"""textsql: fine-tune T5 to translate English questions into SQL on WikiSQL, with or without DeepSpeed ZeRO."""

__version__ = "0.1.0"

from textsql.extras import quiet_lifecycle_logs  # noqa: E402 (after the version: a logging filter, nothing heavy)

quiet_lifecycle_logs()
