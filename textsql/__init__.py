"""textsql: fine-tune T5 to translate English questions into SQL on WikiSQL, with or without DeepSpeed ZeRO."""

__version__ = "0.1.0"
