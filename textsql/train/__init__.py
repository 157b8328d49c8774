"""Fine-tune a T5 or causal LM on prepared WikiSQL with the Trainer, with or without a DeepSpeed ZeRO config.

Run it as `textsql train ...` (one rank per visible GPU), `textsql train recipe.yaml`, `python -m textsql.train ...`,
or under a launcher: `deepspeed --num_gpus 2 --module textsql.train --model_id t5-small --deepspeed zero2`. From Python:
    train(ModelArguments(model_id="t5-small"), DataArguments(), TextsqlTrainingArguments(deepspeed="zero2"))

Its arguments are the run spec's (textsql.arguments.training). Modules, lowest first: speed (the speed levers, FLOPs),
distributed (ranks), logs, collate (a causal LM's batches), dstools (DeepSpeed's tools), fsdp (FSDP2 around the Trainer), estimate (how long a run
takes, from its first steps), watch (what the training is doing now: a step, an evaluation, a save), trainer (what every objective's trainer shares: SQL scoring, saving, peak memory),
objective (what an objective builds from and loads), one module per objective: sft (supervised fine-tuning, the
default) and grpo (--stage grpo), run (one run: set up, the objective by --stage, train, save, summary), local_launch
(child processes on this pod), __main__ (a rank).
"""

from importlib import import_module

# The public names, loaded on first use: `python -m textsql.train` imports this package before its __main__, which
# first quiets the lifecycle packages' log noise (textsql.extras) and only then needs torch and transformers.
_WHERE = {
    "DataArguments": "textsql.arguments.training",  # the run spec (textsql/arguments/)
    "ModelArguments": "textsql.arguments.training",
    "TextsqlTrainingArguments": "textsql.arguments.training",
    "run_training": "textsql.train.local_launch",
    "train": "textsql.train.run",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'textsql.train' has no attribute '{name}'")
