"""bench/real_model.py and bench/grpo.py without training anything: the paired bootstrap that tells GRPO's gain from
noise, the parts --only accepts, and docs/real-model.md's commands against the bench's."""

import pytest

from bench.real_model import (
    DECODINGS,
    GREEDY,
    MODEL,
    PARTS,
    RECIPES,
    REPO,
    SCORE_FLAGS,
    TRAINED,
    documented_commands,
    main,
)
from textsql.evaluate import paired_bootstrap
from textsql.wikisql.release import SAMPLE_SOURCE


def test_the_paired_bootstrap_s_difference_and_interval():
    keys = [("1-1", f"question {i}") for i in range(100)]
    before = list(zip(keys, [True] * 50 + [False] * 50))
    after = list(zip(keys, [True] * 45 + [False] * 5 + [True] * 15 + [False] * 35))  # 15 gained, 5 lost: +10 points
    result = paired_bootstrap(before, after, samples=500)
    assert result["difference"] == pytest.approx(0.10)
    assert (result["questions_gained"], result["questions_lost"]) == (15, 5)
    low, high = result["interval_95"]
    assert low < 0.10 < high and high - low < 0.25
    same = paired_bootstrap(before, before, samples=200)
    assert same["difference"] == 0 and same["interval_95"] == [0, 0]
    with pytest.raises(ValueError, match="different questions, or in another order"):
        paired_bootstrap(before, after[1:] + after[:1])


def test_only_takes_the_comparison_s_parts(capsys):
    assert set(TRAINED) < set(PARTS) and {"zero_shot", "decoding", "merged", "quantized"} < set(PARTS)
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "full,lora_everything"])
    assert exit_.value.code == 2 and "not lora_everything" in capsys.readouterr().err


def test_the_docs_commands_are_the_benchs_and_chain():
    """What a user types from docs/real-model.md is what bench/real_model.py measured: the same recipe files, the same
    scoring flags, the same prompt format; and every command reads the folder the one before wrote."""
    from textsql.arguments.training import parse_arguments

    commands = documented_commands()
    import_, prep = commands[0], commands[1]
    model_dir = import_[2]
    assert import_[:2] == ["import", MODEL]
    flags = dict(zip(prep[1::2], prep[2::2]))
    assert flags["--model_id"] == model_dir and flags["--source_format"] == "question+header+values"  # the best
    assert flags["--source"] == SAMPLE_SOURCE  # shipped with textsql: the bench's ../shared/real/wikisql files
    dataset_dir = flags["--output_dir"]

    # Every recipe the bench trains on the best prompts, in the doc's order; the history's recipe has its own prep.
    trained = [c[1] for c in commands if c[0] == "train"]
    documented = ("full", "lora", "qlora")
    assert trained == [str(RECIPES[name].relative_to(REPO)) for name in documented]
    assert {recipe for _, recipe, _ in TRAINED.values()} <= set(RECIPES)
    written = {}
    for name in documented:
        _, data, training = parse_arguments([str(RECIPES[name])])
        assert (data.dataset_dir, training.output_dir) == (dataset_dir, f"runs/smollm2-135m-{name}")
        written[name] = training.output_dir
    _, data, training = parse_arguments([str(RECIPES["full-question-header"])])
    assert data.dataset_dir != dataset_dir and training.output_dir.endswith("full-question-header")
    merged = [c[1] for c in commands if c[0] == "merge"]
    assert merged == [written["lora"], written["qlora"]]

    scored = [c for c in commands if c[0] == "infer"]
    folders = {c[c.index("--model_dir") + 1] for c in scored}
    assert folders == {*written.values(), f"{written['lora']}-merged", f"{written['qlora']}-merged"}
    outputs = [c[c.index("--output_dir") + 1] for c in scored]
    assert len(set(outputs)) == len(outputs)  # no scoring replaces another's
    for command in scored:
        assert command[command.index("--dataset_dir") + 1] == dataset_dir
        rest = command[command.index("--dataset_dir") + 2 :]
        assert rest[: len(SCORE_FLAGS)] == SCORE_FLAGS, command  # the bench's scoring flags, in its order
        model_dir, output = command[command.index("--model_dir") + 1], command[command.index("--output_dir") + 1]
        assert output.startswith(f"{model_dir}/")  # beside the model, not over it
        if "--greedy_predictions" not in command:
            assert rest[len(SCORE_FLAGS) : len(SCORE_FLAGS) + 2] == GREEDY and output == f"{model_dir}/greedy"
    # Every decoding the bench scores, with the bench's flags, reusing the greedy scoring's answers as the bench does.
    decoded = [c for c in scored if "--greedy_predictions" in c]
    flags = [c[c.index("--decoding") : c.index("--greedy_predictions")] for c in decoded]
    assert sorted(flags) == sorted(DECODINGS.values())
    for command in decoded:
        greedy = command[command.index("--greedy_predictions") + 1]
        assert greedy == f"{command[command.index('--model_dir') + 1]}/greedy/predictions.jsonl"


def test_grpo_bench_flags_are_textsql_s_and_its_variants_checked(capsys, tmp_path):
    """bench/grpo.py's GRPO flags with each variant's parse as `textsql train --stage grpo` arguments: a constant learning
    rate after warm-up, 8 generations of 8 prompts a step, learnable questions only, hundreds of steps; the held-out
    variant's supervised run learns the questions before the ones GRPO starts from; two seeds at least."""
    from bench.grpo import GRPO, HEAD, SEEDS, VARIANTS
    from bench.grpo import main as grpo_main
    from textsql.arguments.training import parse_arguments

    assert len(SEEDS) >= 2
    for name, (_, sft_flags, flags) in VARIANTS.items():
        given = ["--model_id", "m", "--dataset_dir", "d", "--output_dir", str(tmp_path / name), *GRPO, *flags]
        training = parse_arguments(given)[2]
        assert training.lr_scheduler_type == "constant_with_warmup" and training.warmup_steps > 0
        assert training.learnable_only and training.num_generations == 8 and training.max_steps >= 200
        completions = training.per_device_train_batch_size * training.gradient_accumulation_steps
        assert completions // training.num_generations == 8
        if name == "heldout":
            assert sft_flags == ["--max_train_samples", str(HEAD)] and training.grpo_questions_from == HEAD
    with pytest.raises(SystemExit) as exit_:
        grpo_main(["--variants", "heldout,everything"])
    assert exit_.value.code == 2 and "not everything" in capsys.readouterr().err


def test_the_lanes_run_one_step_at_a_time_in_priority_order_and_a_stopped_training_resumes(tmp_path):
    """Two lanes side by side: a lane runs one step at a time, its waiting steps by priority; a training whose run folder
    has no summary (stopped halfway) is started without --overwrite, so `textsql train` resumes its newest checkpoint;
    a chain that fails is said and the others finish."""
    import threading
    import time
    from argparse import Namespace

    from bench.real_model import Bench, Lane, run_side_by_side

    lane, order, inside = Lane("score"), [], []
    started = threading.Event()

    def hold(name, priority):
        with lane.held(priority):
            inside.append(name)
            assert len(inside) == 1  # never two steps of one lane at once
            if name == "first":
                started.set()
                time.sleep(0.3)  # the others queue behind it meanwhile
            order.append(name)
            inside.remove(name)

    first = threading.Thread(target=hold, args=("first", 9))
    first.start()
    started.wait()
    waiting = [threading.Thread(target=hold, args=(n, p)) for n, p in (("late", 5), ("early", 1), ("middle", 3))]
    for thread in waiting:
        thread.start()
        time.sleep(0.05)
    for thread in [first, *waiting]:
        thread.join()
    assert order == ["first", "early", "middle", "late"]

    bench = Bench(Namespace(workdir=str(tmp_path), fresh=False, lanes=2, real_dir=tmp_path))
    assert bench.lanes["train"] is not bench.lanes["score"]
    calls = []
    bench.run = lambda name, *argv: calls.append(argv) or (_ for _ in ()).throw(SystemExit(f"{name} failed"))
    (tmp_path / "runs" / "stopped").mkdir(parents=True)  # a training stopped halfway: no run_summary.json
    failed = {}
    run_side_by_side(
        {
            "stopped": lambda: bench.train("stopped", tmp_path, recipe=tmp_path / "r.yaml", model_id=tmp_path),
            "new": lambda: bench.train("new", tmp_path, recipe=tmp_path / "r.yaml", model_id=tmp_path),
            "fine": lambda: None,
        },
        failed,
    )
    assert set(failed) == {"stopped", "new"} and "train-new failed" in failed["new"]
    by_run = {argv[argv.index("--output_dir") + 1].rsplit("/", 1)[1]: argv for argv in calls}
    assert "--overwrite" not in by_run["stopped"] and "--overwrite" in by_run["new"]
    for argv in calls:
        assert argv[argv.index("--save_strategy") + 1] == "steps"
