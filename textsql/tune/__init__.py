"""`textsql tune`: the fastest strategy and micro-batch that fit, measured with textsql's own training at a fixed global
batch: candidates from the planner, failures recorded beside their prediction, the best few repeated, a simpler setting
preferred when it is nearly as fast, a table, a plot and a `textsql train` recipe of the winner; resumable."""

from __future__ import annotations

from dataclasses import asdict

from textsql.arguments.training import arguments_dict, parse_arguments
from textsql.arguments.tune import TuneArguments
from textsql.errors import TextsqlError
from textsql.families import family_of
from textsql.hub import load_config
from textsql.paths import TUNE_PLOT_FILE, TUNE_RECIPE_FILE, TUNE_TABLE_FILE
from textsql.planner.shape import GIB
from textsql.strategy.devices import NodeDevices, RunDevices, resolve_run_devices
from textsql.strategy.table import strategy_rank
from textsql.tracking import end_tune_run, start_tune_run
from textsql.train.local_launch import node_devices
from textsql.tune.choose import choose_winner, confirmation_runs, repeat_rounds, summarize
from textsql.tune.measure import Measurements, refused_here
from textsql.tune.report import TuneResult, format_table, plot_tune, write_recipe
from textsql.tune.space import lever_candidates, micro_batch_choices, plan_candidates, strategy_choices


def tune_devices(args: TuneArguments, training, devices: NodeDevices) -> RunDevices:
    """The device, ranks per pod and precision every candidate trains with: textsql train's own decision
    (strategy.devices.resolve_run_devices) for the arguments after -- (`training`), with tune's --accelerator and
    --num_gpus."""
    return resolve_run_devices(
        training, args.model_id, devices, ranks_asked=args.num_gpus, accelerator=args.accelerator
    )


def run_tune(
    args: TuneArguments,
    train_argv: list[str] | tuple = (),
    *,
    cluster=None,
    devices: NodeDevices | None = None,
    echo=print,
) -> TuneResult:
    """Measure every candidate (those in the tune folder's results are not run again), repeat the fastest few, choose,
    and write the table, the plot and the recipe into args.tune_dir. `train_argv`: more `textsql train` arguments for
    every candidate and the recipe. `cluster`: a started textsql.cluster.Cluster to measure on several pods."""
    settings = base_settings(args, train_argv, cluster)
    devices = devices if devices is not None else node_devices(args.accelerator)
    resolved = tune_devices(args, settings[2], devices)
    world = resolved.ranks * args.nodes
    base = arguments_dict(*settings)
    candidates, left_out = candidates_here(args, resolved, world, devices, base)
    measurements = Measurements.open(args, base, world, cluster, echo)
    echo(
        f"textsql tune: {len(candidates)} candidates at a global batch of {args.global_batch_size} on {world} rank(s) "
        f"({devices.describe()}, {resolved.precision.name}); {args.warmup_steps} warm-up + {args.timed_steps} timed "
        f"steps each, at most {args.timeout_s:g} s; results in {measurements.results_path}"
    )
    ordered = sorted(candidates, key=lambda c: (strategy_rank(c.strategy), c.strategy, c.micro_batch, c.adapter))
    parent = start_tune_run(base, asdict(args), measurements.tune_dir)  # MLflow: each candidate nested under it
    measurements.runs_base = dict(base, mlflow_parent_run_id=parent["run_id"]) if parent else base
    try:
        for i, candidate in enumerate(ordered, 1):
            measurements.run(candidate, 0, f"[{i}/{len(ordered)}]")
        added = measure_levers(args, measurements, ordered)
        ordered, candidates = ordered + added, candidates + added
        for round_, contenders in enumerate(repeat_rounds(measurements.rows, ordered, args), 1):
            for i, candidate in enumerate(contenders, 1):
                measurements.run(candidate, round_, f"[round {round_ + 1}/{args.repeats}, {i}/{len(contenders)}]")
        result = choose(args, measurements, candidates, left_out, settings)
        if args.confirm and result.winner is not None:
            confirm(args, measurements, result, {c.key: c for c in candidates}, settings, parent and parent["run_id"])
    except BaseException:
        end_tune_run(parent, failed=True)
        raise
    return write_report(result, measurements, parent)


def base_settings(args: TuneArguments, train_argv, cluster) -> tuple:
    """textsql train's arguments every candidate starts from (the model, the dataset, what follows --), checked."""
    settings = parse_arguments(["--model_id", args.model_id, "--dataset_dir", args.dataset_dir, *train_argv])
    if settings[2].lora:
        raise TextsqlError(
            "--lora True after -- would train every candidate with an adapter under a full fine-tuning's name. Pass "
            "--lora True before -- instead: each setting is then measured with and without a LoRA adapter "
            "(--lora_rank and --lora_targets after -- still apply)."
        )
    if cluster is None and args.nodes != 1:
        raise TextsqlError(
            f"--nodes {args.nodes} needs a started cluster: call textsql.tune.run_tune(args, cluster=...) "
            "with a textsql.cluster.Cluster (its pods are the nodes), or tune on this pod with --nodes 1."
        )
    return settings


def candidates_here(args: TuneArguments, resolved: RunDevices, world: int, devices: NodeDevices, base: dict):
    """The candidates to measure on these devices, and those left out (predicted not to fit, refused here)."""
    if args.global_batch_size % world:
        raise TextsqlError(
            f"The global batch {args.global_batch_size} does not divide over {world} ranks: pass a "
            f"--global_batch_size that is a multiple of {world}."
        )
    gpu_memory_gb = args.gpu_memory_gb or (
        devices.gpus[0].memory_bytes / GIB if devices.gpus and devices.gpus[0].memory_bytes else None
    )
    accelerator, precision = resolved.accelerator, resolved.precision.name
    strategies = strategy_choices(args.strategies, accelerator, args.nodes)
    micro_batches = micro_batch_choices(args.global_batch_size // world, args.micro_batches)
    candidates, left_out = plan_candidates(
        args, strategies, micro_batches, world, accelerator, precision, gpu_memory_gb, base
    )
    candidates, refused = refused_here(candidates, accelerator, devices)
    return candidates, left_out + refused


def measure_levers(args: TuneArguments, measurements: Measurements, ordered: list) -> list:
    """--levers: each lever alone on the first round's fastest setting, then those that made it faster together."""
    added = []
    if not args.lever_names:
        return added
    causal = family_of(load_config(args.model_id)).causal
    for stage in ("alone", "together"):
        tried = ordered + added
        first = summarize([r for r in measurements.rows if r["repeat"] == 0 and r["key"] in {c.key for c in tried}])
        now = lever_candidates(first, {c.key: c for c in tried}, args.lever_names, causal, stage)
        for i, candidate in enumerate(now, 1):
            measurements.run(candidate, 0, f"[lever {stage} {i}/{len(now)}]")
        added += now
    return added


def choose(args: TuneArguments, measurements: Measurements, candidates: list, left_out: list, settings) -> TuneResult:
    """The table of every candidate's measurements, the winner (a simpler setting within the tolerance), its recipe."""
    by_key = {c.key: c for c in candidates}
    table = summarize([r for r in measurements.rows if r["key"] in by_key])
    winner = choose_winner(table, args.tolerance)
    default = next((e for e in table if e["default"]), None)
    tune_dir = measurements.tune_dir
    result = TuneResult(table, winner, default, left_out, tune_dir, None, None, 0, args.global_batch_size)
    if winner is not None:
        result.recipe = write_recipe(tune_dir / TUNE_RECIPE_FILE, winner, *settings, args)
    return result


def confirm(args: TuneArguments, measurements: Measurements, result: TuneResult, by_key, settings, parent_id) -> None:
    """--confirm: the winner's recipe and the default settings trained as `textsql train` reads them, in rounds of
    alternating order; their table beside the candidates'."""
    confirming = confirmation_runs(result, by_key, args, settings, parent_id)
    for round_ in range(args.repeats):
        order = confirming[:: -1 if round_ % 2 else 1]
        for i, (candidate, arguments_for) in enumerate(order, 1):
            position = f"[recipe round {round_ + 1}/{args.repeats}, {i}/{len(order)}]"
            measurements.run(candidate, round_, position, arguments_for)
    keys = {candidate.key for candidate, _ in confirming}
    result.confirmation = summarize([r for r in measurements.rows if r["key"] in keys])


def write_report(result: TuneResult, measurements: Measurements, parent) -> TuneResult:
    """The table and the plot written beside the recipe; the tune's MLflow run ended with them."""
    result.measured_now = measurements.measured_now
    tune_dir = measurements.tune_dir
    (tune_dir / TUNE_TABLE_FILE).write_text(format_table(result) + "\n")
    result.plot = plot_tune(result, tune_dir / TUNE_PLOT_FILE)
    winner = result.winner
    end_tune_run(parent, [tune_dir / TUNE_TABLE_FILE, result.plot, result.recipe], winner and winner["key"])
    return result
