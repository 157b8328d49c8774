"""Fine-tune a seq2seq model on prepared WikiSQL with the Seq2SeqTrainer, with or without a DeepSpeed ZeRO config.

Run it as `textsql train ...` (one rank per visible GPU), `textsql train recipe.yaml`, `python -m textsql.train ...`,
or under a launcher: `deepspeed --num_gpus 2 --module textsql.train --model_id t5-small --deepspeed zero2`. From Python:
    train(ModelArguments(model_id="t5-small"), DataArguments(), TextsqlTrainingArguments(deepspeed="zero2"))

Modules, lowest first: arguments (the dataclasses, recipes), distributed (ranks), logs, trainer (the Trainer subclass,
saving), run (deciding and running one training), local_launch (child processes on this pod), __main__ (a rank).
"""

from textsql.train.arguments import DataArguments, ModelArguments, TextsqlTrainingArguments
from textsql.train.local_launch import run_training
from textsql.train.run import train

__all__ = ["DataArguments", "ModelArguments", "TextsqlTrainingArguments", "run_training", "train"]
