"""GPTQ for causal LMs, run by llmcompressor in an environment of its own (textsql.gptq.environment)."""
