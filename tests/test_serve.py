"""After one tiny run, what a user does with its outputs: serve the registered champion with
`mlflow models serve` and ask it for text, read its description and alias history, and list the
runs and models from the command line. One run serves every check (CI time)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from cpuforge.flows.cli import main
from tests.test_openai_server import client, start, stop

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, prefect_server) -> tuple[Path, dict]:
    """(workdir, summary) of one `cpuforge run --profile tiny`."""
    root = tmp_path_factory.mktemp("serve")
    workdir, summary_path = root / "work", root / "summary.json"
    assert main(["run", "--profile", "tiny", "--workdir", str(workdir), "--summary", str(summary_path)]) == 0
    return workdir, json.loads(summary_path.read_text())


def cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def served(tiny_run, tmp_path_factory):
    """`mlflow models serve -m models:/cpuforge-lm@champion --env-manager local` on a free loopback port."""
    workdir, _ = tiny_run
    port = free_port()
    # MLflow starts the scoring server as `uvicorn` from PATH: the one beside this interpreter.
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/mlflow.db",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MLFLOW_REGISTRY_URI", None)
    log = (tmp_path_factory.mktemp("serve-log") / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/cpuforge-lm@champion",
                               "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a wait for the server to come up, not a speed check
        while True:
            assert server.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server's own worker processes too
        server.wait(timeout=60)
        log.close()


def test_the_served_champion_answers_a_prompt_with_cpuforges_own_greedy_text(tiny_run, served, capsys):
    workdir, _ = tiny_run
    code, out = cli(capsys, "generate", "--model", "models:/cpuforge-lm@champion", "--tracking-uri",
                    f"sqlite:///{workdir}/mlflow.db", "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    assert code == 0 and out.startswith("def ")
    greedy = out[len("def "):-1]
    assert greedy

    status, body = post(f"{served}/invocations", {"dataframe_records": [{"prompt": "def "}],
                                                  "params": {"max_new_tokens": 8, "temperature": 0}})
    assert status == 200, body
    assert body == {"predictions": [greedy]}

    # Several prompts as a plain list; a stop string cuts the text before it.
    status, body = post(f"{served}/invocations", {"inputs": ["def ", "class "],
                                                  "params": {"max_new_tokens": 8, "temperature": 0.0}})
    assert status == 200 and len(body["predictions"]) == 2 and body["predictions"][0] == greedy
    stop = greedy[-1]  # a tiny model's greedy text may be only whitespace: any character of it will do
    status, body = post(f"{served}/invocations", {"inputs": ["def "],
                                                  "params": {"max_new_tokens": 8, "temperature": 0, "stop": [stop]}})
    assert status == 200 and body["predictions"] == [greedy[:greedy.index(stop)]]

    # Sampling with a seed repeats itself.
    sampled = {"inputs": ["def "], "params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 3}}
    first, second = post(f"{served}/invocations", sampled), post(f"{served}/invocations", sampled)
    assert first[0] == 200 and first == second

    status, body = post(f"{served}/invocations", {"inputs": [""], "params": {"max_new_tokens": 8}})
    assert status == 400 and "the prompt is empty" in body["message"]


def test_models_lists_the_version_its_description_and_every_alias_move(tiny_run, capsys):
    workdir, summary = tiny_run
    code, out = cli(capsys, "models", "--workdir", str(workdir), "--json")
    assert code == 0
    found = json.loads(out)
    [version] = found["versions"]
    assert version["version"] == "1" and version["aliases"] == ["candidate", "champion"]
    assert version["decision"] == "promoted" and version["reason"] == "there is no champion yet"
    evaluated = summary["stages"]["evaluate"]["metrics"]
    assert version["val_bpb"] == pytest.approx(evaluated["final_val_bpb"], abs=1e-5)
    assert version["params"] > 0 and version["file_bytes"] == evaluated["final_file_bytes"]
    description = version["description"]
    for fact in (f"{version['params']:,} parameters", "data: stdlib", f"{evaluated['final_val_bpb']:.4f} bits per byte",
                 "tokens/s decode", f"MLflow run {summary['mlflow_run_id']}"):
        assert fact in description, (fact, description)

    moves = found["alias_history"]
    assert [(m["alias"], m["version"], m["previous"]) for m in moves] == [("candidate", "1", None),
                                                                           ("champion", "1", None)]
    assert moves[1]["why"] == "there is no champion yet" and "@" in moves[1]["by"]
    assert moves[1]["at"][:10] == summary["finished_at"][:10]

    code, out = cli(capsys, "models", "--workdir", str(workdir))
    assert code == 0 and "candidate,champion" in out and "champion -> version 1 (was unset)" in out


def test_runs_lists_the_run_from_its_summary_and_from_mlflow(tiny_run, capsys):
    workdir, summary = tiny_run
    code, out = cli(capsys, "runs", "--workdir", str(workdir), "--json")
    assert code == 0
    [row] = json.loads(out)
    expected = {"run_id": summary["run_id"], "profile": "tiny", "data_source": "stdlib", "status": "completed",
                "final_val_bpb": summary["stages"]["evaluate"]["metrics"]["final_val_bpb"], "decision": "promoted",
                "model_version": "1", "mlflow_run_id": summary["mlflow_run_id"]}
    assert {k: row[k] for k in expected} == expected and row["seconds"] > 0

    code, out = cli(capsys, "runs", "--tracking-uri", f"sqlite:///{workdir}/mlflow.db", "--json")
    assert code == 0
    [tracked] = json.loads(out)
    assert {k: tracked[k] for k in expected} == expected and tracked["seconds"] > 0

    code, out = cli(capsys, "runs", "--workdir", str(workdir))
    assert code == 0 and "tiny" in out and "promoted" in out and summary["run_id"] in out
    assert main(["runs", "--workdir", str(workdir / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_push_dry_run_lists_the_hub_layout_and_uploads_nothing(tiny_run, capsys, monkeypatch):
    workdir, _ = tiny_run
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("a dry run reached the Hub")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", no_network)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", no_network)
    code, out = cli(capsys, "push", "--repo-id", "me/cpuforge-tiny", "--workdir", str(workdir), "--dry-run")
    assert code == 0, out
    listed = [line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["MB"]][:-1]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "model-q8_0.gguf", "model-q4_0.gguf",
                 "onnx/model.int8.onnx", "onnx/genai_config.json", "onnx/tokenizer.json", "README.md"):
        assert name in listed, (name, out)
    assert "dry run: nothing uploaded to https://huggingface.co/me/cpuforge-tiny" in out


def test_push_makes_one_commit_of_every_file_with_a_card_for_the_repo(tiny_run, capsys, monkeypatch):
    """Everything short of the network: the repository is created (private when asked) and one commit holds the
    files the dry run lists, the card pointing at the repository and naming what runs each file."""
    workdir, _ = tiny_run
    import huggingface_hub
    from huggingface_hub.errors import LocalTokenNotFoundError

    calls = {}

    def create_repo(self, repo_id, **kw):
        calls["repo"] = (repo_id, kw)

    def create_commit(self, repo_id, operations, **kw):
        calls["commit"] = {op.path_in_repo: op for op in operations}
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    code, out = cli(capsys, "push", "models:/cpuforge-lm/1", "--repo-id", "me/cpuforge-tiny", "--private",
                    "--workdir", str(workdir))
    assert code == 0 and "pushed to https://huggingface.co/me/cpuforge-tiny" in out
    assert calls["repo"] == ("me/cpuforge-tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    files = calls["commit"]
    weights = Path(files["model.safetensors"].path_or_fileobj)
    assert weights.parent.name == "model" and weights.parent.parent.name.startswith("recover-")
    card = files["README.md"].path_or_fileobj.decode()
    assert 'from_pretrained("me/cpuforge-tiny")' in card and "tags: [cpuforge, llama, gguf, onnx]" in card
    assert "`model-q4_0.gguf`" in card and "og.Model('onnx')" in card

    def logged_out(self, repo_id, **kw):
        raise LocalTokenNotFoundError("no token")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", logged_out)
    capsys.readouterr()
    assert main(["push", "--repo-id", "me/cpuforge-tiny", "--workdir", str(workdir)]) == 2
    assert capsys.readouterr().err.strip() == ("error: not logged in to the Hugging Face Hub: run `hf auth login` "
                                               "or set HF_TOKEN")
    assert main(["push", "--repo-id", "not a repo", "--workdir", str(workdir)]) == 2
    assert "expected USER_OR_ORG/NAME" in capsys.readouterr().err


def test_serve_gives_the_work_folders_champion_to_openai_clients(tiny_run, capsys):
    """`cpuforge serve --workdir W` with no MODEL serves W's champion (the quantized ONNX model) under its
    registered name, with the same greedy text `cpuforge generate` gives."""
    workdir, _ = tiny_run
    code, out = cli(capsys, "generate", "--model", "models:/cpuforge-lm@champion", "--tracking-uri",
                    f"sqlite:///{workdir}/mlflow.db", "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    greedy = out[len("def "):-1]
    port = free_port()
    server = start(None, port, "--workdir", str(workdir))
    try:
        api = client(port)
        assert [m.id for m in api.models.list().data] == ["cpuforge-lm"]
        answer = api.completions.create(model="cpuforge-lm", prompt="def ", max_tokens=8, temperature=0)
        assert answer.choices[0].text == greedy
    finally:
        stop(server)
