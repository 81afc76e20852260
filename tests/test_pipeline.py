"""The whole flow end to end, as `cpuforge run` runs it: summary, stage store, MLflow, Prefect states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cpuforge.flows.cli import main
from cpuforge.models import llama_cpp_runtime
from cpuforge.tasks import stages as registry
from cpuforge.tasks.stages.evaluate import GGUF_VARIANTS
from tests.conftest import corpus_bytes

pytestmark = pytest.mark.slow


def run_cli(tmp_path: Path, workdir: Path, *args: str) -> tuple[int, dict | None]:
    summary = tmp_path / f"summary-{uuid.uuid4().hex[:6]}.json"
    code = main(["run", "--profile", "tiny", "--workdir", str(workdir), "--summary", str(summary), *args])
    return code, (json.loads(summary.read_text()) if summary.exists() else None)


def mlflow_client(workdir: Path):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")


def prefect_task_states(flow_run_id: str) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def test_run_then_rerun_is_cached_and_tracked(tmp_path, text_corpus, prefect_server, capsys):
    workdir = tmp_path / "work"
    code, first = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}")
    assert code == 0
    assert set(first) >= {"run_id", "mlflow_run_id", "profile", "stages"}
    assert first["profile"] == "tiny" and first["status"] == "completed"
    tok = first["stages"]["tokenize"]
    assert tok["status"] == "completed" and tok["seconds"] > 0
    out = Path(tok["output_dir"])
    assert out.parent == workdir / "stages" and {"tokenizer.json", "train.bin", "val.bin", "meta.json"} <= {
        p.name for p in out.iterdir()}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == corpus_bytes(text_corpus)
    for name in ("docs_train", "docs_val", "bytes_train", "bytes_val", "tokens_train", "tokens_val",
                 "vocab_size", "tokens_per_s"):
        assert tok["metrics"][name] > 0
    assert (workdir / "runs" / first["run_id"] / "summary.json").is_file()
    stages = registry.names()
    assert prefect_task_states(first["run_id"]) == {name: "Completed" for name in (*stages, "register")}
    assert list(first["stages"]) == stages

    pre = first["stages"]["pretrain"]
    assert pre["status"] == "completed"
    for name in ("params", "tokens", "tokens_per_s", "mfu", "val_loss", "val_bpb", "peak_rss_mb", "seconds"):
        assert pre["metrics"][name] > 0, name
    model_dir = Path(pre["output_dir"]) / "model"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    samples = (Path(first["stages"]["evaluate"]["output_dir"]) / "samples.txt").read_text()
    prompts = first["stages"]["evaluate"]["sample_prompts"]  # the opening words of val documents: the corpus' own
    corpus_text = " ".join(f.read_text(encoding="utf-8", errors="replace") for f in text_corpus.rglob("*.*"))
    assert prompts and all(p.strip() and p.split()[0] in corpus_text for p in prompts)
    assert all(f"=== {variant}, prompt: {prompts[0]!r}" in samples for variant in ("pretrained", "pruned", "onnx-int8"))
    pruned, recovered = first["stages"]["prune"]["metrics"], first["stages"]["recover"]["metrics"]
    assert pruned["params_before"] == pre["metrics"]["params"]
    assert pruned["params_after"] <= pruned["params_before"] / 2
    assert pruned["val_bpb_before"] == pytest.approx(pre["metrics"]["val_bpb"], abs=1e-3)
    assert pruned["val_bpb_after"] > 0 and recovered["val_bpb"] > 0
    assert recovered["params"] == pruned["params_after"] and recovered["tokens"] > 0
    # measured against its teacher, and against pretraining's tokens where there was pretraining
    assert recovered["teacher_val_bpb"] == pre["metrics"]["val_bpb"]
    assert recovered["bpb_vs_teacher"] == pytest.approx(recovered["val_bpb"] / pre["metrics"]["val_bpb"] - 1, abs=1e-3)
    assert recovered["tokens_vs_pretrain"] == pytest.approx(recovered["tokens"] / pre["metrics"]["tokens"], abs=1e-3)

    client = mlflow_client(workdir)
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["cpuforge.profile"] == "tiny"
    # runs are compared on the parent run: the final model's figures and each stage's time
    final = first["stages"]["evaluate"]["metrics"]
    assert {k: parent.data.metrics[k] for k in ("final_val_bpb", "final_file_bytes", "onnx-int8/decode_tok_s")} == {
        k: final[k] for k in ("final_val_bpb", "final_file_bytes", "onnx-int8/decode_tok_s")}
    assert {f"seconds/{name}" for name in stages} <= set(parent.data.metrics) and parent.data.metrics[
        "seconds/pretrain"] == first["stages"]["pretrain"]["seconds"]
    child = client.get_run(tok["mlflow_run_id"])
    assert child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.metrics["tokens_train"] == tok["metrics"]["tokens_train"]
    assert child.data.params["tokenizer.vocab_size"] == "512"
    assert {a.path for a in client.list_artifacts(child.info.run_id)} >= {"tokenizer.json", "meta.json"}
    assert child.inputs.dataset_inputs and child.inputs.dataset_inputs[0].dataset.name == "corpus"
    assert {(t.key, t.value) for t in child.inputs.dataset_inputs[0].tags} == {("mlflow.data.context", "train")}
    assert client.get_experiment(parent.info.experiment_id).name == "cpuforge"
    train_run = client.get_run(pre["mlflow_run_id"])
    for series in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu"):
        assert len(client.get_metric_history(train_run.info.run_id, series)) == pre["metrics"]["steps"], series
    assert {m.step for m in client.get_metric_history(train_run.info.run_id, "val/bpb")} == {10, 20, 30}
    assert train_run.data.metrics["val_bpb"] == pre["metrics"]["val_bpb"]
    # train.compile=auto: the tiny profile's 30 steps cannot repay a compile, and the run says so without probing
    assert train_run.data.params["compiled"] == "False" and "not probed" in train_run.data.params["compile_choice"]
    assert not any(name.startswith("compile_") for name in pre["metrics"])
    assert {"loss_curve.png", "model"} <= {a.path for a in client.list_artifacts(train_run.info.run_id)}
    assert {"model/model.safetensors", "model/config.json", "model/tokenizer.json"} <= {
        a.path for a in client.list_artifacts(train_run.info.run_id, "model")}

    check_deploy_stages(first, client, workdir)

    code, second = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}")
    assert code == 0
    again = second["stages"]["tokenize"]
    assert again["status"] == "cached" and again["output_dir"] == tok["output_dir"]
    assert again["metrics"] == tok["metrics"]
    assert {v["status"] for v in second["stages"].values()} == {"cached"}
    assert prefect_task_states(second["run_id"]) == {**{name: "Cached" for name in stages}, "register": "Completed"}
    cached_runs = {r.data.tags["cpuforge.stage"]: r for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{second['mlflow_run_id']}'")}
    assert set(cached_runs) == {*stages, "register"}  # the champion gate runs every time
    assert cached_runs["tokenize"].data.tags["cpuforge.cached"] == "true"
    assert cached_runs["tokenize"].data.tags["cpuforge.source_run_id"] == tok["mlflow_run_id"]
    assert cached_runs["pretrain"].data.tags["cpuforge.source_run_id"] == pre["mlflow_run_id"]

    assert second["registry"]["version"] == "1" and second["registry"]["decision"] == "kept champion"
    assert second["registry"]["reason"] == "this model is already the champion"

    # `cpuforge plan` says so before running: what would be reused, what built, and why.
    def plan(*args: str) -> dict[str, dict]:
        capsys.readouterr()
        assert main(["plan", "--profile", "tiny", "--workdir", str(workdir), "--json",
                     "--set", f"data.source={text_corpus}", *args]) == 0
        return {row["stage"]: row for row in json.loads(capsys.readouterr().out)}

    assert {name: row["folder"] for name, row in plan().items()} == {
        name: entry["output_dir"] for name, entry in second["stages"].items()}
    assert {row["action"] for row in plan().values()} == {"reuse"}
    planned = plan("--set", "prune.keep_ratio=0.6")
    first_built = stages.index("prune")  # prune and every stage after it reads prune's output
    assert [planned[n]["action"] for n in stages] == ["reuse"] * first_built + ["build"] * (len(stages) - first_built)
    assert planned["prune"]["reasons"] == ["prune.keep_ratio: 0.5 -> 0.6"]
    assert planned["recover"]["reasons"] == ["input prune changes"]

    # A later stage's settings leave earlier stages cached; a stage's own settings re-run it and what follows.
    code, later = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}", "--set", "prune.keep_ratio=0.6")
    assert code == 0 and [later["stages"][n]["status"] for n in stages] == ["cached"] * 2 + ["completed"] * 6
    gate = later["registry"]
    assert gate["version"] == "2" and gate["previous_champion_version"] == "1"
    assert gate["champion_val_bpb"] is not None  # the old champion was scored on the same text
    assert (gate["decision"] == "promoted") == (gate["candidate_val_bpb"] < gate["champion_val_bpb"])
    assert gate["champion_version"] == ("2" if gate["decision"] == "promoted" else "1")
    assert str(client.get_model_version_by_alias("cpuforge-lm", "candidate").version) == "2"
    assert {n: later["stages"][n]["output_dir"] for n in stages} == {n: planned[n]["folder"] for n in stages}

    # --rebuild builds a stage and those after it again, in the same folders (same keys).
    code, rebuilt = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}", "--set", "prune.keep_ratio=0.6",
                            "--rebuild", "quantize")
    # gguf reads recover's model, not quantize's: it stays cached
    assert code == 0 and [rebuilt["stages"][n]["status"] for n in stages] == ["cached"] * 5 + ["completed", "cached",
                                                                                               "completed"]
    assert rebuilt["stages"]["quantize"]["output_dir"] == later["stages"]["quantize"]["output_dir"]

    # What the weekly deployment runs: continue from the champion. The champion already learned from
    # this very data, so the run starts where the champion's pretraining started and reuses everything.
    code, weekly = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}", "--set", "train.init_from=champion")
    assert code == 0 and weekly["pretrained_from"] is None
    assert {weekly["stages"][n]["status"] for n in stages} == {"cached"}

    # New data changes the source fingerprint and so the key; pretraining continues from the champion's
    # fp32 weights (fetched from its lineage in MLflow) with its tokenizer.
    (text_corpus / "new.txt").write_text("a brand new document\n" * 50)
    code, grown = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}", "--set", "train.init_from=champion")
    assert code == 0 and grown["stages"]["tokenize"]["status"] == "completed"
    assert grown["stages"]["tokenize"]["output_dir"] != tok["output_dir"]
    assert {grown["stages"][n]["status"] for n in stages[1:]} == {"completed"}  # new tokens: all retrained
    assert grown["pretrained_from"]["run_id"] == pre["mlflow_run_id"]
    first_loss = [json.loads(line)["loss"] for line in
                  (Path(first["stages"]["pretrain"]["output_dir"]) / "history.jsonl").read_text().splitlines()][0]
    continued = Path(grown["stages"]["pretrain"]["output_dir"]) / "history.jsonl"
    assert json.loads(continued.read_text().splitlines()[0])["loss"] < first_loss - 0.5  # not from scratch

    # The compression half alone, from the champion's pretrained weights, with another keep ratio.
    summary_path = tmp_path / "compress.json"
    source_run = client.get_model_version_by_alias("cpuforge-lm", "champion").tags["cpuforge.pretrain_run_id"]
    code = main(["compress", "--profile", "tiny", "--workdir", str(workdir), "--summary", str(summary_path),
                 "--set", f"data.source={text_corpus}", "--set", "prune.keep_ratio=0.7"])
    recompressed = json.loads(summary_path.read_text())
    assert code == 0 and recompressed["flow"] == "compress"
    assert list(recompressed["stages"]) == registry.names(registry.COMPRESS)
    assert recompressed["stages"]["tokenize"]["status"] == "cached"  # same data, the champion's tokenizer
    assert recompressed["pretrained_from"]["run_id"] == source_run
    source_bpb = next(r["stages"]["pretrain"]["metrics"]["val_bpb"] for r in (grown, first)
                      if r["stages"]["pretrain"]["mlflow_run_id"] == source_run)
    adopted = recompressed["stages"]["adopt"]["metrics"]
    assert adopted["val_bpb"] == pytest.approx(source_bpb, abs=2e-3)  # scored as pretraining scored it
    ratio = recompressed["stages"]["prune"]["metrics"]["params_after"] / adopted["params"]
    rec = recompressed["stages"]["recover"]["metrics"]  # an adopted teacher: no pretraining here to compare with
    assert rec["teacher_val_bpb"] == adopted["val_bpb"] and "tokens_vs_pretrain" not in rec
    assert 0.6 < ratio <= 0.75 and recompressed["registry"]["decision"] in ("promoted", "kept champion")


def check_deploy_stages(summary: dict, client, workdir: Path) -> None:
    """export -> quantize -> evaluate -> register, as a user sees them in the summary and in MLflow."""
    exported, quantized, evaluated = (summary["stages"][n] for n in ("export", "quantize", "evaluate"))
    assert exported["metrics"]["parity_max_abs_diff"] < 1e-3 and exported["metrics"]["generation_match"] == 1.0
    assert quantized["metrics"]["int8_bytes"] < quantized["metrics"]["fp32_bytes"] / 2.5
    variants = evaluated["variants"]
    with_llama_cpp = llama_cpp_runtime.missing() is None  # the GGUF files are measured where it is installed
    assert [v["variant"] for v in variants] == [spec.evaluates[0] for spec in registry.PIPELINE if spec.evaluates] + (
        list(GGUF_VARIANTS) if with_llama_cpp else [])
    for v in variants:
        assert {"variant", "params", "file_bytes", "val_bpb", "ppl", "prefill_tok_s", "decode_tok_s"} <= set(v)
        assert v["val_bpb"] > 0 and v["prefill_tok_s"] > 0 and v["decode_tok_s"] > 0 and v["peak_rss_mb"] > 0
    by_name = {v["variant"]: v for v in variants}
    assert by_name["onnx-int8"]["params"] == by_name["recovered"]["params"] < by_name["pretrained"]["params"]
    assert by_name["onnx-fp32"]["val_bpb"] == pytest.approx(by_name["recovered"]["val_bpb"], rel=1e-3)
    assert evaluated["metrics"]["size_ratio"] > 3 and evaluated["metrics"]["final_val_bpb"] == by_name["onnx-int8"]["val_bpb"]
    out = Path(evaluated["output_dir"])
    assert "| onnx-int8 | onnx |" in (out / "report.md").read_text()
    saved = {v["variant"]: v for v in json.loads((out / "variants.json").read_text())}
    # the pruned and recovered models run the same computation: timed once, and the report says so
    assert saved["pruned"]["timed_as"] == "recovered" and "timed_as" not in saved["recovered"]
    assert by_name["pruned"]["decode_tok_s"] == by_name["recovered"]["decode_tok_s"]
    assert "pruned runs the same computation as recovered" in (out / "report.md").read_text()
    if with_llama_cpp:  # the same weights in llama.cpp score as they do in cpuforge
        assert by_name["gguf-q8_0"]["val_bpb"] == pytest.approx(by_name["recovered"]["val_bpb"], rel=0.01)
        assert by_name["gguf-q4_0"]["file_bytes"] < by_name["gguf-q8_0"]["file_bytes"]
        assert "gguf-q8_0, gguf-q4_0 run in llama.cpp (llama-cpp-python " in (out / "report.md").read_text()
    else:
        assert ("gguf-q8_0, gguf-q4_0 not measured: llama.cpp is not installed: pip install 'cpuforge[bench]'"
                in (out / "report.md").read_text())
    assert (out / "quality_vs_size_speed.png").stat().st_size > 10_000
    eval_run = client.get_run(evaluated["mlflow_run_id"])
    assert eval_run.data.metrics["onnx-int8/val_bpb"] == by_name["onnx-int8"]["val_bpb"]
    assert {"variants_table.json", "report.md", "quality_vs_size_speed.png"} <= {
        a.path for a in client.list_artifacts(eval_run.info.run_id)}

    gate = summary["registry"]
    assert gate["version"] == "1" and gate["decision"] == "promoted"
    assert gate["aliases"] == ["candidate", "champion"] and gate["reason"] == "there is no champion yet"
    version = client.get_model_version_by_alias("cpuforge-lm", "champion")
    assert str(version.version) == "1" and version.tags["cpuforge.gate_decision"] == "promoted"
    from cpuforge.tasks.release.register import open_model

    champion = open_model("models:/cpuforge-lm@champion", f"sqlite:///{workdir}/mlflow.db")
    assert champion.kind == "onnx" and champion.params == by_name["onnx-int8"]["params"]
    assert "".join(champion.stream("The model", 8, temperature=0.0))  # generates text from the registry


def test_a_failing_stage_fails_the_runs_and_leaves_nothing_finished(tmp_path, prefect_server, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n")
    workdir = tmp_path / "work"
    code, summary = run_cli(tmp_path, workdir, "--set", f"data.source={empty}")
    assert code == 2
    err = capsys.readouterr().err
    assert "error: the corpus" in err and "is empty" in err
    assert summary["status"] == "failed" and summary["stages"]["tokenize"]["status"] == "failed"
    assert "pretrain" not in summary["stages"]  # nothing after a failed stage runs
    assert not [p for p in (workdir / "stages").iterdir() if p.name.startswith("tokenize-") and
                not p.name.endswith(".partial")]
    client = mlflow_client(workdir)
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FAILED"
    children = client.search_runs([client.get_run(summary["mlflow_run_id"]).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'")
    assert [r.info.status for r in children] == ["FAILED"]


def test_stop_after_runs_the_stages_up_to_it_and_registers_nothing(tmp_path, text_corpus, prefect_server):
    workdir = tmp_path / "work"
    code, summary = run_cli(tmp_path, workdir, "--set", f"data.source={text_corpus}", "--stop-after", "prune")
    assert code == 0 and summary["status"] == "completed" and summary["stopped_after"] == "prune"
    assert list(summary["stages"]) == registry.names()[: registry.names().index("prune") + 1]
    assert "registry" not in summary  # nothing to register before quantize and evaluate
    assert all(entry["peak_rss_mb"] > 0 for entry in summary["stages"].values())  # each stage built here
    assert not mlflow_client(workdir).search_registered_models()
    pruned = Path(summary["stages"]["prune"]["output_dir"]) / "model"
    assert (pruned / "model.safetensors").is_file()  # the stage's output is kept for the next run


def test_bad_config_is_rejected_before_any_work(tmp_path, capsys):
    code, summary = run_cli(tmp_path, tmp_path / "w", "--set", "model.n_head=5")
    assert code == 2 and summary is None
    err = capsys.readouterr().err
    assert err.strip() == "error: invalid configuration: model.n_head=5 does not divide model.d_model=64"
    assert "Traceback" not in err
    assert not (tmp_path / "w" / "stages").exists()


def test_console_script_on_the_embedded_corpus(tmp_path):
    """`cpuforge run --profile tiny` exactly as a user types it, in a fresh process, beside packages of
    the user's own named `models`, `tasks` and `flows` (cpuforge's live under `cpuforge.`)."""
    theirs = tmp_path / "their-packages"
    for name in ("models", "tasks", "flows"):
        (theirs / name).mkdir(parents=True)
        (theirs / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name} package was imported')\n")
    # In-process runs above leave MLFLOW_*_URI in os.environ (mlflow sets them); a user's shell has none.
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")} | {
        "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(theirs)}
    exe = Path(sys.executable).with_name("cpuforge")
    proc = subprocess.run([str(exe), "run", "--profile", "tiny", "--summary", "s.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["stages"]["tokenize"]["status"] == "completed"
    assert [v["status"] for v in summary["stages"].values()] == ["completed"] * 8
    assert (tmp_path / "cpuforge-runs" / "mlflow.db").is_file()
    assert "tokenize" in proc.stdout and "mlflow ui --backend-store-uri" in proc.stdout
    output = proc.stdout + proc.stderr  # the run's own progress lines, no library's bars among them
    assert "Downloading artifacts" not in output and "%|" not in output, output[-3000:]
    assert "could not resolve" not in output  # the embedded corpus is no hub dataset
    # The registered champion, by URI, from the default store in ./cpuforge-runs: generate and evaluate.
    gen = subprocess.run([str(exe), "generate", "--model", "models:/cpuforge-lm@champion", "--prompt", "def ",
                          "--max-new-tokens", "20", "--seed", "0"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.startswith("def ") and len(gen.stdout) > len("def \n")
    text = tmp_path / "unseen.txt"
    text.write_text("class Stack:\n    def push(self, item):\n        self.items.append(item)\n" * 20)
    ev = subprocess.run([str(exe), "evaluate", "--model", "models:/cpuforge-lm@champion", "--text", str(text), "--json"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    scored = json.loads(ev.stdout)
    assert scored["format"] == "onnx" and 0 < scored["val_bpb"] < 8 and 0 < len(text.read_bytes()) - scored["bytes"] <= 8
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad_text = subprocess.run([str(exe), "evaluate", "--model", "models:/cpuforge-lm@champion", "--text", str(empty)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad_text.returncode == 2 and bad_text.stderr.strip() == "error: the text is empty: nothing to score"
    bad = subprocess.run([str(exe), "run", "--set", "data.source=/no/such/dir"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: data.source: no such file or folder: '/no/such/dir' (use a path, a glob, 'stdlib', or 'hf:<dataset id>')"]


def test_the_cli_sets_prefect_start_up_defaults_before_prefect_reads_them():
    """A fresh machine's first run migrates Prefect's database; 20 s (Prefect's default) was too short there."""
    code = ("import cpuforge.flows.cli as cli; cli.main(['config', '--profile', 'tiny']); "
            "from prefect.settings import get_current_settings; "
            "print(get_current_settings().server.ephemeral.startup_timeout_seconds)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "180", out.stderr[-2000:]


def test_auto_size_is_chosen_before_the_keys_and_logged(tmp_path, text_corpus, prefect_server, capsys, monkeypatch):
    """model.size=auto: `cpuforge plan` and the run key the same chosen shape (the measurement is cached in
    the workdir), and the choice and why reach the summary and MLflow. The speed is injected."""
    from cpuforge.models.llama import flops_per_token
    from cpuforge.tasks.engine import sizing

    measured = []
    monkeypatch.setattr(sizing, "measure_shapes", lambda shapes, *a, **k: measured.append(len(shapes)) or [
        1e9 / flops_per_token(s) for s in shapes])
    workdir = tmp_path / "work"
    args = ("--set", f"data.source={text_corpus}", "--set", "model.size=auto", "--set", "model.block_size=64",
            "--set", "model.n_layer=1")
    capsys.readouterr()
    assert main(["plan", "--profile", "tiny", "--workdir", str(workdir), "--json", *args]) == 0
    planned = {row["stage"]: row for row in json.loads(capsys.readouterr().out)}
    code, summary = run_cli(tmp_path, workdir, *args)
    assert code == 0 and summary["status"] == "completed"
    pre = summary["stages"]["pretrain"]
    assert pre["output_dir"] == planned["pretrain"]["folder"]  # the same key: the same shape
    assert len(measured) >= 1 and measured[0] > 1  # the candidates were timed once, at plan time
    metrics = pre["metrics"]
    assert metrics["size_auto_params"] == metrics["params"]
    assert metrics["size_auto_tokens_per_s"] > 0 and metrics["size_auto_expected_tokens"] > 0
    assert metrics["size_auto_tokens_per_param"] == pytest.approx(
        metrics["size_auto_expected_tokens"] / metrics["params"], rel=1e-2)
    params = mlflow_client(workdir).get_run(pre["mlflow_run_id"]).data.params
    assert params["size_auto"] == "True" and "tokens/param" in params["size_auto_reason"]
    assert json.loads(params["size_auto_shape"])["n_layer"] == 1  # the field set by hand is kept
