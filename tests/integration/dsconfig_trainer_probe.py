"""Train a tiny T5 for two steps under the real Seq2SeqTrainer with each DeepSpeed config given; one JSON line each.

    DS_ACCELERATOR=cpu python tests/integration/dsconfig_trainer_probe.py RESULTS.jsonl CONFIG.json [CONFIG.json ...]

The whole path a config takes in `textsql train` runs: TrainingArguments (the Trainer's "auto", accelerate's
DeepSpeedPlugin), Trainer.train (accelerate's _prepare_deepspeed, deepspeed.initialize, two optimizer steps). One
process, one rank on the CPU; tests/integration/test_dsconfig_docs.py runs it once for several configs.
"""

import json
import os
import sys
import tempfile
import time


def train_two_steps(config_path: str, output_dir: str) -> None:
    import torch
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    args = Seq2SeqTrainingArguments(
        output_dir=output_dir,
        deepspeed=config_path,
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        average_tokens_across_devices=False,
        dataloader_num_workers=0,
    )
    model = T5ForConditionalGeneration(
        T5Config(
            d_model=32,
            num_layers=1,
            num_heads=2,
            d_kv=16,
            d_ff=64,
            vocab_size=100,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    data = [{"input_ids": torch.randint(2, 100, (8,)), "labels": torch.randint(2, 100, (5,))} for _ in range(8)]
    result = Seq2SeqTrainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 2, result


def main(results: str, paths: list[str]) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed outside its launcher: one rank of its own (DESIGN.md, pitfall 4).
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    for path in paths:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as output_dir:
            try:
                train_two_steps(path, output_dir)
                outcome = {"config": path, "ok": True, "error": ""}
            except Exception as error:  # noqa: BLE001 - the failure is the result reported
                outcome = {
                    "config": path,
                    "ok": False,
                    "error": f"{type(error).__name__}: {' '.join(str(error).split())}",
                }
            finally:
                unset_hf_deepspeed_config()
                AcceleratorState._reset_state(True)
        with open(results, "a", encoding="utf-8") as out:  # not stdout: the Trainer and DeepSpeed print there
            out.write(json.dumps({**outcome, "seconds": round(time.perf_counter() - started, 1)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
