"""`textsql compare`: the Gradio app served on loopback, rendered air-gapped in headless Chromium, asked once through
its API, and stopped with nothing left running; and the same comparison over a split as JSON. Both families side by
side: T5 models (base, LoRA adapter, quantized) and a fine-tuned causal LM answer the same questions."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import chromium_command, headless_chromium

from textsql.train.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
# Every host but the loopback resolves to nothing: the page must render with no network (CML's air-gapped clusters).
AIR_GAPPED = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"


def chromium(*args, user_data_dir: Path) -> subprocess.CompletedProcess:
    return headless_chromium(AIR_GAPPED, *args, user_data_dir=user_data_dir, window="1400,1000")


def chromium_evaluate(url: str, expression: str, until: str, user_data_dir: Path, timeout: float = 120):
    """Open `url` in headless Chromium (air-gapped), wait until the JavaScript `until` is true, then return the value of
    `expression` (awaited when it is a promise): DevTools' protocol over --remote-debugging-pipe (commands on the
    browser's fd 3, answers on its fd 4, each JSON message ended by a NUL byte)."""
    commands_read, commands_write = os.pipe()
    answers_read, answers_write = os.pipe()
    ends = (os.dup(commands_read), os.dup(answers_write))  # above 4, so that fd 3 and 4 can be made of them
    os.close(commands_read), os.close(answers_write)
    browser = subprocess.Popen(
        chromium_command(AIR_GAPPED, "--remote-debugging-pipe", "about:blank", user_data_dir=user_data_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(3, 4),
        preexec_fn=lambda: (os.dup2(ends[0], 3), os.dup2(ends[1], 4)),
    )
    os.close(ends[0]), os.close(ends[1])
    pending, counter = b"", iter(range(1, 1_000_000))

    def send(method: str, params: dict, session: str | None = None) -> dict:
        nonlocal pending
        number = next(counter)
        message = {"id": number, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(commands_write, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in pending:
                chunk = os.read(answers_read, 1 << 20)
                assert chunk, "Chromium closed its DevTools pipe"
                pending += chunk
            raw, pending = pending.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == number:
                assert "error" not in answer, answer
                return answer["result"]

    def evaluate(text: str, session: str):
        result = send("Runtime.evaluate", {"expression": text, "returnByValue": True, "awaitPromise": True}, session)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    try:
        target = send("Target.createTarget", {"url": url})["targetId"]
        session = send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        deadline = time.monotonic() + timeout
        while not evaluate(until, session):
            assert time.monotonic() < deadline, f"the page never got to `{until}`"
            time.sleep(0.3)
        return evaluate(expression, session)
    finally:
        browser.kill()
        browser.wait()
        os.close(commands_write), os.close(answers_read)


# In the page: pick the second table with the mouse, as a user does, and watch the question picker meanwhile.
PICK_ANOTHER_TABLE = """(async () => {
  const sleep = ms => new Promise(done => setTimeout(done, ms));
  const byLabel = label => [...document.querySelectorAll('input')].find(e => e.getAttribute('aria-label') === label);
  const question = byLabel('Question from the split'), table = byLabel('Table');
  const typed = [...document.querySelectorAll('textarea')].find(e => e.placeholder);
  const block = question.closest('.block');
  const overlays = new Set();  // the block's progress overlay, whenever it is shown
  new MutationObserver(() => block.querySelectorAll('[data-testid="status-tracker"]').forEach(tracker => {
    if (!tracker.classList.contains('hide')) overlays.add(tracker.className);
  })).observe(block, {attributes: true, childList: true, subtree: true});
  const first = question.value;
  table.focus(); table.click();
  await sleep(300);
  const option = document.querySelectorAll('#' + table.getAttribute('aria-controls') + ' li')[1];
  option.dispatchEvent(new MouseEvent('mousedown', {bubbles: true})); option.click();
  for (let i = 0; i < 300 && question.value === first; i++) await sleep(100);
  await sleep(300);
  const color = element => getComputedStyle(element).color;
  return {first, question: question.value, table: table.value, overlays: [...overlays], question_color: color(question),
          table_color: color(table), placeholder_color: getComputedStyle(typed, '::placeholder').color,
          question_opacity: getComputedStyle(question).opacity};
})()"""
# Ready: the question list of the first table came (app.load's answer filled the table preview's cells too).
PAGE_READY = """[...document.querySelectorAll('input')].some(e => e.getAttribute('aria-label') === 'Question from the split'
  && e.value.length > 0) && [...document.querySelectorAll('.block')].some(b => b.textContent.includes('The table (first rows)')
  && b.querySelectorAll('td').length > 0)"""


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def call_api(base: str, endpoint: str, data: list, timeout: float = 300):
    """Gradio's HTTP API: POST the inputs, then read the event stream until the result (or the error) comes."""
    request = urllib.request.Request(
        f"{base}/gradio_api/call/{endpoint}",
        data=json.dumps({"data": data}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        event_id = json.loads(response.read())["event_id"]
    stream = get(f"{base}/gradio_api/call/{endpoint}/{event_id}", timeout=timeout)
    events = re.findall(r"event: (\w+)\ndata: (.*)", stream)
    assert events and events[-1][0] == "complete", stream[-2000:]
    return json.loads(events[-1][1])


@pytest.fixture(scope="module")
def causal_run(causal_assets, tmp_path_factory):
    """A tiny Qwen2 fine-tuned by textsql for 2 steps on question+header prompts (in this process, no DeepSpeed): a
    run folder whose config says how it reads a question, so it answers a T5 dataset's questions beside the T5s."""
    import logging

    from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments
    from textsql.train.run import train

    data_dir, model_dir = causal_assets
    saved = dict(os.environ)
    try:
        os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TENSORBOARD_LOGGING_DIR="")
        training = TextsqlTrainingArguments(
            runs_root=str(tmp_path_factory.mktemp("causal-run")),
            max_steps=2,
            per_device_train_batch_size=8,
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
        )
        summary = train(
            ModelArguments(model_id=str(model_dir)),
            DataArguments(dataset_dir=str(data_dir), execution_accuracy_samples=0),
            training,
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
        root = logging.getLogger()  # the run configured logging for itself
        for handler in [h for h in root.handlers if getattr(h, "textsql", False)]:
            root.removeHandler(handler)
            handler.close()
    return Path(summary.output_dir)


@pytest.fixture(scope="module")
def quantized_model(assets, tmp_path_factory):
    import torch

    from textsql.arguments.quantize import QuantizeArguments
    from textsql.quantize import quantize_and_save

    data_dir, model_dir = assets
    output = tmp_path_factory.mktemp("quantized") / "tiny-t5-torchao-int8"
    return quantize_and_save(
        QuantizeArguments(model_dir=str(model_dir), output_dir=str(output), dataset_dir=str(data_dir)),
        torch.device("cpu"),
    )


def test_app_in_chromium_air_gapped_one_api_call_and_nothing_left(
    assets, lora_adapter, quantized_model, causal_run, tmp_path
):
    import psutil
    from matplotlib.image import imread

    data_dir, model_dir = assets
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDSW_", "GRADIO_"))}
    env.update(
        CDSW_APP_PORT=str(port),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TEXTSQL_COMPARE_MODELS=f"base={model_dir},lora={lora_adapter},int8={quantized_model},causal={causal_run}",
        TEXTSQL_DATASET_DIR=str(data_dir),
    )
    log = tmp_path / "app.log"
    with open(log, "w") as out:  # the CML way: the application script, no arguments, the port from $CDSW_APP_PORT
        process = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "compare_app.py"), "--max_new_tokens", "12"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    children = []
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, f"the app exited with {process.returncode}:\n{log.read_text()}"
            try:
                page = get(base + "/", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, f"the app did not answer within 240 s:\n{log.read_text()}"
                time.sleep(1)
        children = psutil.Process(process.pid).children(recursive=True)
        with pytest.raises(OSError):  # loopback only
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
        # Air-gapped: the page loads no script, style or font from another host, and analytics are off.
        assert not re.findall(r"""(?:src|href)=["']https?://(?!127\.0\.0\.1)""", page), (
            "the page loads something from the internet"
        )
        config = json.loads(get(base + "/config"))
        assert config.get("analytics_enabled") is False and not config.get("share_url")
        # The page rendered with every other host unresolvable shows the app, its models and the table picker.
        dom = chromium("--virtual-time-budget=20000", "--dump-dom", base + "/", user_data_dir=tmp_path / "profile-dom")
        assert dom.returncode == 0, dom.stderr[-3000:]
        for text in (
            "textsql compare",
            "base (model, t5)",
            "lora (LoRA adapter, t5)",
            "int8 (quantized (torchao-int8), t5)",
            "causal (model, qwen2)",
            "Compare",
        ):
            assert text in dom.stdout, f"'{text}' is not on the rendered page"
        screenshot = tmp_path / "compare.png"
        shot = chromium(
            "--virtual-time-budget=20000",
            f"--screenshot={screenshot}",
            base + "/",
            user_data_dir=tmp_path / "profile-shot",
        )
        assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-3000:]
        pixels = imread(screenshot)
        assert pixels.shape[:2] == (1000, 1400) and pixels[..., :3].var() > 0.001, "the screenshot is blank"
        orange = (
            (pixels[..., 0] > 0.9) & (pixels[..., 1] > 0.35) & (pixels[..., 1] < 0.7) & (pixels[..., 2] < 0.3)
        ).mean()
        assert orange > 0.0005, "the primary (orange) Compare button is not in the screenshot"

        # The chosen question reads as a value, not as a placeholder: in the text colour of the table picker, and no
        # progress overlay greys it while the next table's questions come (issue 32, item 8).
        picked = chromium_evaluate(base + "/", PICK_ANOTHER_TABLE, PAGE_READY, user_data_dir=tmp_path / "profile-pick")
        assert picked["table"] != "" and picked["question"] not in ("", picked["first"]), picked
        assert picked["overlays"] == [], f"a progress overlay covered the question picker: {picked}"
        assert picked["question_color"] == picked["table_color"] != picked["placeholder_color"], picked
        assert picked["question_opacity"] == "1", picked

        # One comparison through the app's API: the first table, its first question of the split.
        from textsql.evaluate import load_scoring_set

        scoring = load_scoring_set(str(data_dir), "test")
        table_id = scoring.table_ids[0]
        _, _, details = call_api(base, "compare", [table_id, 0, ""])
        assert details["question"] == scoring.questions[0] and details["gold_sql"] == scoring.gold_texts[0]
        assert [row["label"] for row in details["models"]] == ["base", "lora", "int8", "causal"]
        assert [row["family"] for row in details["models"]] == ["t5", "t5", "t5", "qwen2"]
        assert "### " not in details["models"][-1]["sql"]  # only the causal LM's new tokens, not its prompt
        for row in details["models"]:
            assert (
                set(row["verdicts"]) == {"exact_match", "logical_form_match", "execution_match"}
                and row["latency_ms"] > 0
            )
            assert ("answer" in row) != ("error" in row)
        typed = call_api(base, "compare", [table_id, None, "How many rows are there?"])[2]
        assert typed["gold_sql"] is None and all("verdicts" not in row for row in typed["models"])
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # what CML sends when an Application stops
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"still running after the app stopped: {alive}"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_split_comparison_as_json(assets, lora_adapter, quantized_model, causal_run, textsql_in_process, tmp_path):
    data_dir, model_dir = assets
    output = tmp_path / "compare.json"
    status, out, err = textsql_in_process(
        [
            "compare",
            f"base={model_dir}",
            f"lora={lora_adapter}",
            f"int8={quantized_model}",
            f"causal={causal_run}",
            "--dataset_dir",
            str(data_dir),
            "--max_examples",
            "6",
            "--max_new_tokens",
            "12",
            "--output",
            str(output),
        ]
    )
    assert status == 0, err
    report = json.loads(output.read_text())
    assert [m["label"] for m in report["models"]] == ["base", "lora", "int8", "causal"] and report["examples"] == 6
    assert report["models"][0]["agreement_with_first"] == 1.0
    assert [m["kind"] for m in report["models"]] == ["model", "LoRA adapter", "quantized (torchao-int8)", "model"]
    assert [m["family"] for m in report["models"]] == ["t5", "t5", "t5", "qwen2"]
    assert len(report["questions"]) == 6 and set(report["questions"][0]["models"]) == {"base", "lora", "int8", "causal"}
    # the causal LM read its own prompt layout (question and columns) for the T5 dataset's questions
    from textsql.arguments.compare import CompareArguments
    from textsql.serve.compare import Comparison

    comparison = Comparison(
        CompareArguments(models=[f"causal={causal_run}"], dataset_dir=str(data_dir), max_new_tokens=4)
    )
    scoring = comparison.sources_for(comparison.models[0], comparison.scoring)
    assert scoring.sources[0].startswith("### Question: ") and "### Columns: " in scoring.sources[0]
    assert scoring.questions == comparison.scoring.questions and not comparison.scoring.sources[0].startswith("###")
    assert "same SQL as first" in out and f"wrote {output}" in out


def test_a_run_fine_tuned_on_another_source_format_reads_the_questions_as_it_learned(
    causal_assets, causal_run, tmp_path
):
    """Issue 41: a run on the question alone (the causal demo's format before issue 54) beside runs on questions and
    columns, on one dataset: each
    model of the family reads the questions in the format it was fine-tuned on, where compare refused it before."""
    from textsql.arguments.compare import CompareArguments
    from textsql.arguments.prep import PrepArguments
    from textsql.prep import prepare_dataset
    from textsql.serve.compare import Comparison

    data_dir, model_dir = causal_assets
    questions_only = prepare_dataset(  # the walkthrough's format; causal_run learned on question+header
        PrepArguments(
            source=str(data_dir.parent / "wikisql-generated"),
            model_id=str(model_dir),
            output_dir=str(tmp_path / "question"),
            max_examples_per_split=6,
            source_format="question",
        )
    )
    comparison = Comparison(
        CompareArguments(models=[f"run={causal_run}", f"base={model_dir}"], dataset_dir=str(questions_only))
    )
    own = comparison.sources_for(comparison.models[0], comparison.scoring)
    assert "### Columns: " in own.sources[0] and "### Columns: " not in comparison.scoring.sources[0]
    assert comparison.sources_for(comparison.models[1], comparison.scoring) is comparison.scoring


def test_a_model_of_the_other_family_not_fine_tuned_by_textsql_is_refused(assets, causal_assets, textsql_in_process):
    """A base causal LM carries no record of how it reads a question: on T5's data it is refused, with the fix."""
    data_dir, _ = assets
    status, _, err = textsql_in_process(
        ["compare", f"qwen={causal_assets[1]}", "--dataset_dir", str(data_dir), "--output", "x.json"]
    )
    assert status == 2 and "was not fine-tuned by textsql" in err and "textsql prep --model_id" in err
    assert f"The model 'qwen' ({causal_assets[1]}) cannot be compared" in err  # which one, of those named


def test_two_models_with_one_label_are_refused(assets, textsql_in_process):
    data_dir, model_dir = assets
    status, _, err = textsql_in_process(
        ["compare", f"a={model_dir}", f"a={model_dir}", "--dataset_dir", str(data_dir), "--output", "x.json"]
    )
    assert status == 2 and "label them" in err
