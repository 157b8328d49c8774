"""textsql: fine-tune T5 and decoder-only causal LMs to write SQL for WikiSQL questions, with DeepSpeed ZeRO or FSDP."""

__version__ = "0.1.0"
