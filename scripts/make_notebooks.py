"""Write every notebook in notebooks/ from the cell texts below (run after editing them; the .ipynb files are committed,
and a test checks that regenerating them changes nothing)."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

# After a split comparison (textsql.serve.compare): the questions where the models wrote different SQL.
DISAGREEMENTS_CELL = (
    "import pandas as pd\n\n"
    "rows = [{'question': q['question'], 'gold': q['gold_sql'], **{label: m['sql'] for label, m in q['models'].items()}}\n"
    "        for q in report['questions'] if len({m['sql'] for m in q['models'].values()}) > 1]\n"
    "pd.DataFrame(rows).head(10)  # questions where the models disagree"
)
NOTEBOOKS = {
    "prep_dataset.ipynb": [
        new_markdown_cell(
            "# Prepare WikiSQL\n\n"
            "Loads WikiSQL, tokenizes it with the model's tokenizer and a T5 task prefix (no fixed padding: batches are "
            "padded by the collator), reports token lengths, and saves a `DatasetDict` to `output_dir`.\n\n"
            "`source` is `generate` (built-in generated data), `wikisql-sample` (real WikiSQL lines shipped with "
            "textsql: 1,000 train and 1,062 test questions), a folder or `.tar.bz2` of the original release files "
            "(`train.jsonl`, `train.tables.jsonl`, `dev.jsonl`, ... — what an air-gapped cluster uses), or a hub name of "
            "a parquet copy. Same as `textsql prep`."
        ),
        new_code_cell(
            'source = "wikisql-sample"\nmodel_id = None  # None: SmolLM2-135M-Instruct (imported from its wheel the first time), else the tiny T5 of textsql demo --tiny (offline), else t5-small\noutput_dir = "data/wikisql"\n'
            'source_prefix = "translate English to SQL: "\nsource_format = "auto"  # the family\'s best: question+header+values (the cells the question names); "question": the walkthrough\'s\n'
            "max_examples_per_split = None\noverwrite = False",
            metadata={"tags": ["parameters"]},
        ),
        new_code_cell(
            "from textsql.notebook import default_model_id, real_model\nfrom textsql.prep import PrepArguments, format_length_report, prepare_dataset\nfrom textsql.prepared import load_prepared\n\n"
            "args = PrepArguments(source=source, model_id=model_id or real_model(fetch=True) or default_model_id(), output_dir=output_dir, source_prefix=source_prefix,\n"
            "                     source_format=source_format, max_examples_per_split=max_examples_per_split, overwrite=overwrite)\n"
            "folder = prepare_dataset(args)"
        ),
        new_code_cell(
            "dataset, metadata = load_prepared(folder)\nprint(format_length_report(metadata['lengths']))\ndataset"
        ),
        new_code_cell("dataset['train'].select(range(5)).to_pandas()[['question', 'target']]"),
    ],
    "train_single_pod.ipynb": [
        new_markdown_cell(
            "# Fine-tune on one pod\n\n"
            "Trains with the Seq2SeqTrainer, without DeepSpeed (`deepspeed = None`) or with a strategy from `dsconfig/` "
            "(`zero1`, `zero2`, `zero3_offload`, or a path to your own edited JSON), one rank per visible GPU. The "
            "arguments are the same dataclasses `textsql train` parses (`TextsqlTrainingArguments` takes every Trainer "
            "argument); building them here touches no GPU. Training runs in child processes (the `deepspeed` launcher "
            "when a config is given), its output streams here, and the run summary is shown at the end. Runs land under "
            "`runs_root`; watch them with `textsql tensorboard` (TensorBoard on the runs root)."
        ),
        new_code_cell(
            'model_id = None  # None: the imported SmolLM2-135M-Instruct, else the tiny T5 of textsql demo (offline), else t5-small\ndataset_dir = "data/wikisql"\nruns_root = "runs"\ndeepspeed = "zero2"\n'
            "num_gpus = None  # one rank per visible GPU; 1 for one GPU\nepochs = 3\nper_device_train_batch_size = 32\n"
            "per_device_eval_batch_size = 32\ngradient_checkpointing = False\nextra_args = {}  # any other Trainer argument\n"
            "execution_accuracy_samples = 200  # validation questions whose SQL is scored at the end (as infer decodes); 0: none",
            metadata={"tags": ["parameters"]},
        ),
        new_code_cell(
            "from textsql.notebook import default_model_id, real_model\nfrom textsql.train import DataArguments, ModelArguments, TextsqlTrainingArguments\n\n"
            "training = TextsqlTrainingArguments(\n"
            "    runs_root=runs_root, deepspeed=deepspeed, num_train_epochs=epochs, activation_checkpointing=gradient_checkpointing,\n"
            "    per_device_train_batch_size=per_device_train_batch_size, per_device_eval_batch_size=per_device_eval_batch_size,\n"
            "    **extra_args)\n"
            "model = ModelArguments(model_id=model_id or real_model() or default_model_id())  # as prep_dataset's\n"
            "data = DataArguments(dataset_dir=dataset_dir, execution_accuracy_samples=execution_accuracy_samples)"
        ),
        new_code_cell(
            "from textsql.strategy.dsconfig import load_dsconfig, resolve_dsconfig_path\n\n"
            "if deepspeed:  # validate the config before anything starts\n"
            "    load_dsconfig(resolve_dsconfig_path(deepspeed))"
        ),
        new_code_cell(
            "from textsql.train.local_launch import run_training\n\n"
            "summary = run_training(model, data, training, num_gpus=num_gpus)"
        ),
        new_code_cell(
            "import pandas as pd\n\npd.DataFrame(summary.peak_memory_per_rank)  # the summary itself is printed above"
        ),
    ],
    "train_multi_pod.ipynb": [
        new_markdown_cell(
            "# Train on several pods with DeepSpeed\n\n"
            "Every pod — this session and `workers` worker pods (CML: `cml.workers_v1.launch_workers`) — runs torchrun's "
            "elastic agent (c10d rendezvous at this session's address); each pod's command and environment are fixed when "
            "it is created, so no pod listens for orders. No ssh and no keys. `cluster.train` decides once CPU or GPU, "
            "precision and which checkpoint to resume from, starts the pods, shows every rank's output here, and stops "
            "every pod when it ends: on any failure, interrupt (Ctrl-C) or a pod that is lost, frozen or never starts, "
            "the rank or pod that failed first is named, and the message says which checkpoint the next run resumes "
            "from: run the cell again to resume.\n\n"
            "Long trainings: CML ends an idle session (and its workers) after its idle timeout. Run the same training as a "
            "CML Job instead: `textsql cluster train --backend cml --workers 2 --nvidia_gpu 1 -- <training arguments>`.\n\n"
            '`backend = "local"` runs the same on this machine (the session 127.0.0.1, workers 127.0.0.2, ...). Runs land in '
            "`runs/`; launch logs in `.textsql/cluster/`. Variables you set to tune or debug reach every rank: those under "
            "`NCCL_*`, `TORCH_NCCL_*`, `GLOO_*`, `DS_*`, and by name `PYTORCH_CUDA_ALLOC_CONF`, `HF_HOME`, `HF_HUB_CACHE`, "
            "`HF_HUB_OFFLINE`, `HF_DATASETS_CACHE`, ... (the list is `textsql/redaction.py`; not every `HF_*`); add your "
            'own with `Cluster(forward_env=("MY_SETTING",))`. Secrets (tokens such as `HF_TOKEN`, passwords, keys) never '
            "do.\n\n"
            "`limits`: how long a rank may go without progress in each phase before its pod names it (`WatchLimits`: the "
            "first step, a later one by a limit learned from the steps before, an evaluation without a batch done, a save "
            "without a byte written; the defaults, in `docs/multi-pod.md`, are sized for a 7B ZeRO-3 run saving to the "
            "project folder), and the join window of an elastic launch (`min_workers`): raise one for a slower run."
        ),
        new_code_cell(
            'backend = "cml"\nworkers = 2\ncpu, memory, nvidia_gpu = 8, 32, 1  # each worker pod: cores, GiB, GPUs\n'
            "min_workers = None  # elastic: start with this many workers if the others have not joined within the join window\n"
            'limits = {}  # e.g. {"save_timeout": 1800, "first_step_timeout": 1800}: WatchLimits, in seconds\n'
            'model_id = None  # None: the imported SmolLM2-135M-Instruct, else the tiny T5 of textsql demo (offline), else t5-small\ndataset_dir = "data/wikisql"\n'
            'deepspeed = "zero2"\nepochs = 3\nper_device_train_batch_size = per_device_eval_batch_size = 32\n'
            "extra_args = {}  # any other Trainer argument",
            metadata={"tags": ["parameters"]},
        ),
        new_code_cell(
            "from textsql.cluster import Cluster, WatchLimits\n\n"
            "cluster = Cluster(backend, workers=workers, cpu=cpu, memory=memory, nvidia_gpu=nvidia_gpu, min_workers=min_workers,\n"
            "                  limits=WatchLimits(**limits))\n"
            "cluster.start()"
        ),
        new_code_cell(
            "from textsql.notebook import default_model_id, real_model\nfrom textsql.train import DataArguments, ModelArguments, TextsqlTrainingArguments\n\n"
            "model = ModelArguments(model_id=model_id or real_model() or default_model_id())  # as prep_dataset's\n"
            "data = DataArguments(dataset_dir=dataset_dir)\n"
            "training = TextsqlTrainingArguments(deepspeed=deepspeed, num_train_epochs=epochs, **extra_args,\n"
            "                                    per_device_train_batch_size=per_device_train_batch_size,\n"
            "                                    per_device_eval_batch_size=per_device_eval_batch_size)\n"
            "plan = cluster.preflight(model, data, training)"
        ),
        new_code_cell("result = cluster.train(model, data, training)"),
        new_code_cell(
            "import pandas as pd\n\n"
            "pd.DataFrame(result['ranks'])[['rank', 'node_address', 'world_size', 'global_step', 'final_loss', 'train_loss', 'eval_loss']]"
        ),
        new_code_cell("from textsql.run_summary import format_summary\n\nprint(format_summary(result['summary']))"),
        new_code_cell("cluster.stop()"),
    ],
    "run_inference.ipynb": [
        new_markdown_cell(
            "# Generate and score SQL\n\n"
            "Loads a fine-tuned model folder (the run folder of any strategy), generates SQL for a split in batches, "
            "parses it back against each question's table, executes it in SQLite and scores it exactly as WikiSQL's "
            "evaluate.py does: execution and logical-form accuracy (plus exact match), and which parts of the query are "
            "right. `decoding = \"auto\"` is the model family's best: constrained (every answer a query over the question's "
            "table), told against greedy's answers (the questions it fixed and broke); `\"greedy\"` is the walkthrough's, "
            '`"constrained+execution_guided"` (with `num_beams` of 4 or so) takes the first constrained beam that '
            "executes. Writes `predictions.jsonl` and `eval_metrics.json` into the model folder. Same as `textsql infer`. "
            "Put your own questions in `questions` (and a `table_id` to run them)."
        ),
        new_code_cell(
            "model_dir = None  # None: the newest run under runs/ (train_single_pod's), else the run textsql demo fine-tuned\n"
            'dataset_dir = "data/wikisql"\nsplit = "test"\nmax_examples = None\n'
            'batch_size = 64\ndecoding = "auto"  # the family\'s best: constrained; or "greedy", "constrained+execution_guided"\n'
            "num_beams = 1\nquestions = []\ntable_id = None",
            metadata={"tags": ["parameters"]},
        ),
        new_code_cell(
            "from textsql.infer import InferArguments, run_inference\nfrom textsql.notebook import latest_run\n\n"
            "model_dir = model_dir or latest_run()\n"
            "metrics = run_inference(InferArguments(model_dir=model_dir, dataset_dir=dataset_dir, split=split, max_examples=max_examples,\n"
            "                                       batch_size=batch_size, decoding=decoding, num_beams=num_beams))"
        ),
        new_code_cell(
            "import pandas as pd\n\n"
            "parts = pd.Series(metrics['components'], name='share right')\n"
            "parts.plot.barh(xlim=(0, 1), title='Which parts of the query are right');"
        ),
        new_code_cell(
            "predictions = pd.read_json(f'{model_dir}/predictions.jsonl', lines=True)\n"
            "if 'greedy_execution_match' in predictions:  # the decoding's answers against greedy's, beside the parts\n"
            "    changed = predictions[predictions.execution_match != predictions.greedy_execution_match]\n"
            "    print(metrics['decoding']['label'], 'against greedy:', metrics['decoding']['against_greedy'])\n"
            "    display(changed.assign(fixed=changed.execution_match)[['question', 'greedy_sql', 'predicted_sql', 'gold_sql', 'fixed']].head(10))"
        ),
        new_code_cell(
            "pd.concat({'by aggregation': pd.DataFrame(metrics['by_aggregation']).T,\n"
            "           'by conditions': pd.DataFrame(metrics['by_num_conditions']).T})"
        ),
        new_code_cell(
            "predictions[~predictions.execution_match][['question', 'predicted_sql', 'gold_sql', 'wrong_parts', 'parse_error']].head(10)"
        ),
        new_code_cell(
            "if questions:\n"
            "    run_inference(InferArguments(model_dir=model_dir, dataset_dir=dataset_dir, question=questions, table_id=table_id,\n"
            "                                 decoding=decoding, num_beams=num_beams))"
        ),
    ],
    "benchmark_report.ipynb": [
        new_markdown_cell(
            "# Benchmark report\n\n"
            "Collects every `run_summary.json` under `runs_root` (and the `eval_metrics.json` that `textsql infer` writes "
            "beside it) into one table in the walkthrough's shape: model, technique, nodes, epochs, duration, samples/s, "
            "memory per pod (max over ranks: CUDA reserved on GPUs, peak RSS on a CPU-only run), eval loss and execution "
            "accuracy. Saves it as Markdown and CSV with PNG plots (time and memory per strategy, loss curves from the "
            "TensorBoard events) in `output_dir` (default `<runs_root>/report`). Same as `textsql report`."
        ),
        new_code_cell(
            'runs_root = "runs"\noutput_dir = None  # None: <runs_root>/report', metadata={"tags": ["parameters"]}
        ),
        new_code_cell(
            "from textsql.report import build_report\n\nreport = build_report(runs_root, output_dir)\nreport.table"
        ),
        new_code_cell("for path in [*report.files.values(), *report.plots.values()]:\n    print('wrote', path)"),
        new_code_cell(
            "from IPython.display import Image, display\n\nfor path in report.plots.values():\n    display(Image(filename=str(path)))"
        ),
    ],
    "finetune_lora.ipynb": [
        new_markdown_cell(
            "# LoRA end to end: train an adapter, merge, quantize, compare\n\n"
            "Trains a LoRA adapter on the base model (the base stays frozen; the run folder holds the adapter and the "
            "tokenizer, as `textsql train --lora` writes them), merges it into a plain model folder on the CPU in fp32 "
            "(as `textsql merge` does), quantizes the merged model (`textsql quantize`: the method's size, questions/s and "
            "execution-accuracy delta against the unquantized model), and compares base, adapter, merged and quantized "
            "models on the same questions (`textsql compare --output`). The side-by-side web app is `textsql compare` "
            "(a CML Application: `scripts/compare_app.py`). Needs the lifecycle extra (`pip install '.[lifecycle]'`).\n\n"
            "Offline, the base is the real SmolLM2-135M-Instruct when it has been imported (`textsql import "
            "smollm2-135m-instruct`, as prep_dataset's), else the model `textsql demo` fine-tuned (a few minutes on a "
            "CPU): it writes SQL's shape, "
            "so the adapter's few epochs change answers the last cell shows. An untrained base writes the same tokens "
            "whatever the adapter, and the last cell says so."
        ),
        new_code_cell(
            "model_id = None  # None: the imported SmolLM2-135M-Instruct, else the model textsql demo fine-tuned (offline), else its tiny T5, else t5-small\n"
            'dataset_dir = "data/wikisql"\nruns_root = "runs"\ndeepspeed = None  # or "zero2", "zero3_offload"\n'
            "lora_rank = 8\nepochs = 3\nper_device_train_batch_size = 32\n"
            'method = "torchao-int8"  # bnb-int8, bnb-nf4, dynamic-int8 (CPU)\nmax_examples = 200\nextra_args = {}  # any other Trainer argument',
            metadata={"tags": ["parameters"]},
        ),
        new_code_cell(
            "from textsql.notebook import default_model_id, real_model, trained_demo_model\n"
            "from textsql.train import DataArguments, ModelArguments, TextsqlTrainingArguments, run_training\n\n"
            "model_id = model_id or real_model() or trained_demo_model() or default_model_id()  # as prep_dataset's\n"
            "training = TextsqlTrainingArguments(runs_root=runs_root, deepspeed=deepspeed, lora=True, lora_rank=lora_rank,\n"
            "                                    num_train_epochs=epochs, per_device_train_batch_size=per_device_train_batch_size, **extra_args)\n"
            "summary = run_training(ModelArguments(model_id=model_id), DataArguments(dataset_dir=dataset_dir), training)\n"
            "adapter_dir = summary.output_dir"
        ),
        new_code_cell(
            "from textsql.merge import MergeArguments, merge_adapter\n\n"
            "merged_dir = merge_adapter(MergeArguments(adapter=adapter_dir))  # <adapter>-merged, beside it"
        ),
        new_code_cell(
            "from textsql.quantize import QuantizeArguments, quantize_model\n\n"
            "quantized = quantize_model(QuantizeArguments(model_dir=str(merged_dir), method=method, dataset_dir=dataset_dir, max_examples=max_examples))"
        ),
        new_code_cell(
            "from textsql.serve.compare import CompareArguments, Comparison, format_split_comparison\n\n"
            'models = [f"base={model_id}", f"lora={adapter_dir}", f"merged={merged_dir}", f"{method}={quantized[\'output_dir\']}"]\n'
            'comparison = Comparison(CompareArguments(models=models, dataset_dir=dataset_dir, split="test"))\n'
            "report = comparison.compare_split(max_examples)\n"
            "print(format_split_comparison(report))"
        ),
        new_code_cell(
            "import pandas as pd\n\n"
            "rows = [{'question': q['question'], 'gold': q['gold_sql'], **{label: m['sql'] for label, m in q['models'].items()}}\n"
            "        for q in report['questions'] if len({m['sql'] for m in q['models'].values()}) > 1]\n"
            "if not rows:\n"
            "    print('The models wrote the same SQL on every question: an untrained base (the tiny T5 before `textsql demo` '\n"
            "          'fine-tunes it) writes the same few tokens whatever the adapter. Run `textsql demo`, or train longer.')\n"
            "pd.DataFrame(rows).head(10)  # questions where the models disagree"
        ),
    ],
    "finetune_causal_lm.ipynb": [
        new_markdown_cell(
            "# A causal LM end to end: prep, LoRA, merge, quantize, compare\n\n"
            "The decoder-only road ([docs/causal-lm.md](../docs/causal-lm.md)): prep lays each question and the table's "
            "columns out as one prompt, followed by the SQL and EOS (labels masked on the prompt); a LoRA adapter is "
            "trained on the frozen base (`textsql train --lora True`), merged into a plain model folder in fp32 "
            "(`textsql merge`), quantized (`textsql quantize`: size, questions/s and the execution-accuracy delta), and "
            "base, adapter, merged and quantized models answer the same questions (`textsql compare --output`), beside a "
            "T5 run when `t5_model` names one. Offline on the real pretrained SmolLM2-135M-Instruct when it has been "
            "imported (`textsql import smollm2-135m-instruct`, [docs/real-model.md](../docs/real-model.md)): its answers "
            "before fine-tuning (the `base` row) and after (`lora`, `merged`) differ where you can read them; else on "
            "the model `textsql demo --tiny --family causal` fine-tuned (`bash scripts/bootstrap.sh demo --tiny --family causal`: a "
            "tiny causal LM that writes SQL's shape; its untrained base writes none). Any other model: set `model_id` "
            "(recipes/smollm2-135m-lora.yaml and recipes/qwen2.5-0.5b-lora.yaml have settings). "
            "Needs the lifecycle extra (`pip install '.[lifecycle]'`)."
        ),
        new_code_cell(
            "model_id = None  # None: the imported SmolLM2-135M-Instruct, else the demo's fine-tuned causal LM, else Qwen2.5-0.5B\n"
            'source = "generate"  # or "wikisql-sample" (real WikiSQL lines shipped with textsql), or a release folder\n'
            'dataset_dir, source_format = "data/notebook-causal", None  # None: the format model_id learned, else the best (auto)\n'
            "max_examples_per_split = None\noverwrite = False  # True: prepare and train again over an earlier run's\n"
            'runs_root = "runs"\ndeepspeed = None  # or "zero2", "zero3_offload"\n'
            'lora_rank, lora_targets, epochs = 8, "all", 3  # lora_targets: "all" (every linear layer) or "qv"\n'
            "per_device_train_batch_size = 16\n"
            'method = "torchao-int8"  # bnb-int8, bnb-nf4, dynamic-int8 (CPU); max_examples scored, max_new_tokens each\n'
            "max_examples, max_new_tokens, t5_model, extra_args = 200, 64, None, {}  # t5_model: a T5 run to compare beside\n"
            'quantize_base, gptq_bits = "nf4", 4  # QLoRA: "nf4"/"int8"; GPTQ: 4/8 (its environment: minutes, once); None skips',
            metadata={"tags": ["parameters"]},
        ),
        new_code_cell(
            "from textsql.notebook import default_model_id, real_model, source_format_for, trained_demo_model\n"
            "from textsql.prep import PrepArguments, format_layout, format_length_report, prepare_dataset\nfrom textsql.prepared import load_prepared\n\n"
            'model_id = model_id or real_model() or trained_demo_model("causal") or default_model_id("causal")\n'
            'print(f"model: {model_id}")\n'
            "folder = prepare_dataset(PrepArguments(source=source, model_id=model_id, output_dir=dataset_dir, overwrite=overwrite,\n"
            "                                       source_format=source_format or source_format_for(model_id),\n"
            "                                       max_examples_per_split=max_examples_per_split))\n"
            "dataset, metadata = load_prepared(folder)\n"
            "print(format_layout(metadata), format_length_report(metadata['lengths']), sep='\\n')\n"
            "print(dataset['train'][0]['prompt'] + dataset['train'][0]['target'])  # one training sequence (then EOS)"
        ),
        new_code_cell(
            "from textsql.train import DataArguments, ModelArguments, TextsqlTrainingArguments, run_training\n\n"
            "training = TextsqlTrainingArguments(runs_root=runs_root, deepspeed=deepspeed, lora=True, lora_rank=lora_rank,\n"
            "                                    lora_targets=lora_targets, num_train_epochs=epochs, overwrite=overwrite,\n"
            "                                    per_device_train_batch_size=per_device_train_batch_size, **extra_args)\n"
            "summary = run_training(ModelArguments(model_id=model_id), DataArguments(dataset_dir=dataset_dir), training)\n"
            "adapter_dir = summary.output_dir"
        ),
        new_code_cell(
            "from textsql.merge import MergeArguments, merge_adapter\n\n"
            "merged_dir = merge_adapter(MergeArguments(adapter=adapter_dir, overwrite=overwrite))  # <adapter>-merged, beside it"
        ),
        new_code_cell(
            "from textsql.quantize import QuantizeArguments, quantize_model\n\n"
            "quantized = quantize_model(QuantizeArguments(model_dir=str(merged_dir), method=method, dataset_dir=dataset_dir,\n"
            "                                             max_examples=max_examples, max_new_tokens=max_new_tokens))"
        ),
        new_markdown_cell(
            "## QLoRA: the adapter on a 4-bit base, merged, then GPTQ\n\n"
            "The same adapter trained on a base loaded in NF4 (or int8) by bitsandbytes, what fits a 7B model on one "
            "A100-40GB (recipes/qwen2.5-7b-qlora-nf4.yaml); merged into the full-precision base and scored again against "
            "the adapter on its 4-bit base (the difference is printed: the adapter learned against rounded weights); then "
            "quantized with GPTQ calibrated on this dataset's own prompts, in an environment of its own that "
            "`textsql quantize --method gptq` creates once ([docs/lora.md](../docs/lora.md), "
            "[docs/lifecycle.md](../docs/lifecycle.md))."
        ),
        new_code_cell(
            "from textsql.merge import merge_and_score\n\n"
            "qlora_dir = qlora_merged_dir = None\n"
            "if quantize_base:\n"
            "    qlora = TextsqlTrainingArguments(runs_root=runs_root, deepspeed=deepspeed, lora=True, quantize_base=quantize_base,\n"
            "                                     lora_rank=lora_rank, lora_targets=lora_targets, num_train_epochs=epochs,\n"
            "                                     overwrite=overwrite, per_device_train_batch_size=per_device_train_batch_size, **extra_args)\n"
            "    qlora_dir = run_training(ModelArguments(model_id=model_id), DataArguments(dataset_dir=dataset_dir), qlora).output_dir\n"
            "    merge = MergeArguments(adapter=str(qlora_dir), score_examples=max_examples, max_new_tokens=max_new_tokens,\n"
            "                           overwrite=overwrite)\n"
            '    qlora_merged_dir = merge_and_score(merge)["output_dir"]'
        ),
        new_code_cell(
            "gptq = None\n"
            "if gptq_bits:\n"
            '    gptq = quantize_model(QuantizeArguments(model_dir=str(qlora_merged_dir or merged_dir), method="gptq", bits=gptq_bits,\n'
            "                                            dataset_dir=dataset_dir, max_examples=max_examples, max_new_tokens=max_new_tokens))"
        ),
        new_code_cell(
            "from textsql.serve.compare import CompareArguments, Comparison, format_split_comparison\n\n"
            'models = [f"base={model_id}", f"lora={adapter_dir}", f"merged={merged_dir}", f"{method}={quantized[\'output_dir\']}"]\n'
            'models += [f"qlora={qlora_dir}", f"qlora-merged={qlora_merged_dir}"] if qlora_dir else []\n'
            "models += [f\"gptq-{gptq_bits}bit={gptq['output_dir']}\"] if gptq else []\n"
            'models += [f"t5={t5_model}"] if t5_model else []  # a T5 run reads the same questions as it was fine-tuned to\n'
            'comparison = Comparison(CompareArguments(models=models, dataset_dir=dataset_dir, split="test", max_new_tokens=max_new_tokens))\n'
            "report = comparison.compare_split(max_examples)\n"
            "print(format_split_comparison(report))"
        ),
        new_code_cell(DISAGREEMENTS_CELL),
    ],
}


NOTEBOOKS_FOLDER = Path(__file__).resolve().parent.parent / "notebooks"


SETUP_CELL = "from textsql.notebook import setup\n\nsetup()  # textsql's errors as one paragraph, library FutureWarnings left out"


def with_setup(cells: list) -> list:
    """The notebook's cells with the setup cell after its title (before the parameters cell papermill looks for)."""
    return [cells[0], new_code_cell(SETUP_CELL), *cells[1:]]


def main(folder: Path = NOTEBOOKS_FOLDER) -> None:
    """Write every notebook into `folder` (the repository's notebooks/ by default)."""
    folder.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        cells = with_setup(cells)
        for number, cell in enumerate(cells):
            cell.id = f"cell-{number}"  # stable ids: regenerating a notebook changes only what its cells say
        notebook = new_notebook(cells=cells)
        notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        notebook.metadata["language_info"] = {"name": "python"}
        nbformat.write(notebook, folder / name)
        print("wrote", folder / name)


if __name__ == "__main__":
    main()
