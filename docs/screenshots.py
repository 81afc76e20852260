"""Redo the screenshots in docs/images/: a Prefect server and an MLflow server on loopback, the tiny
pipeline run against both, headless Chromium (driven by playwright) photographing what a user sees.

    python docs/screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

Needs Chromium (Debian: `apt-get install chromium`) and `pip install -e ".[docs]"` (playwright; its own
browser download is not needed). Takes a few minutes: pretraining is given two minutes of wall-clock
budget so that there is time to photograph its live progress. Everything lives in a temporary folder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_PNG_BYTES = 300_000
# MLflow's UI opens on its GenAI view with an assistant panel over a third of the page; these are the
# settings its own toggles store, so the pictures show the model-training view a cpuforge user reads.
MLFLOW_UI_SETTINGS = ("localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
                      "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
                      "localStorage.setItem('mlflow.workflowType_v1', JSON.stringify('machine_learning'));")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Pretraining long enough to be caught running; everything else as the tiny profile has it.
RUN_SETTINGS = ["train.max_steps=null", "train.max_minutes=2", "train.eval_interval=20"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def api(url: str, body: dict | None = None):
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def server(cmd: list[str], health: str, env: dict[str, str], log: Path) -> Iterator[None]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(health)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def save_small(png: bytes, path: Path) -> None:
    """A UI screenshot in at most 256 colours (PNG palette): a tenth of the size, no visible loss."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    for width in (image.width, 1100, 960):
        small = image if width == image.width else image.resize((width, round(image.height * width / image.width)))
        buffer = io.BytesIO()
        small.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(buffer, format="PNG", optimize=True)
        if buffer.tell() <= MAX_PNG_BYTES:
            break
    path.write_bytes(buffer.getvalue())
    print(f"wrote {path} ({buffer.tell() / 1000:.0f} kB)")


def shoot(page, url: str, path: Path, wait_text: str | None = None, settle_s: float = 3.0,
          click: str | None = None) -> bool:
    """Photograph a page once it shows `wait_text`; a page that never does is photographed anyway
    (with a warning) rather than losing the other pictures: look at it before committing it."""
    page.goto(url, wait_until="load", timeout=180_000)
    with contextlib.suppress(Exception):  # a page that keeps polling is never idle: go on after a while
        page.wait_for_load_state("networkidle", timeout=60_000)
    if click:  # a tab of the page (the UI may not take it from the URL)
        try:
            page.get_by_role("tab", name=click).first.click(timeout=30_000)
            page.wait_for_load_state("networkidle")
        except Exception as exc:
            print(f"warning: {url}: no tab {click!r} ({type(exc).__name__})", file=sys.stderr)
    shown = True
    if wait_text:
        try:
            page.get_by_text(wait_text).first.wait_for(timeout=90_000)
        except Exception as exc:
            print(f"warning: {url}: {wait_text!r} not shown ({type(exc).__name__})", file=sys.stderr)
            shown = False
    time.sleep(settle_s)  # charts and lazy panels finish drawing
    save_small(page.screenshot(full_page=False), path)
    return shown


def task_runs(prefect: str, flow_run_id: str) -> list[dict]:
    return api(f"{prefect}/task_runs/filter", {"task_runs": {"flow_run_id": {"any_": [flow_run_id]}}})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "images")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="cpuforge-screenshots-"))
    prefect_port, mlflow_port = free_port(), free_port()
    prefect_ui, mlflow_ui = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
    prefect = f"{prefect_ui}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_API_URL": prefect,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": prefect,
           "MLFLOW_TRACKING_URI": mlflow_ui}
    python = [sys.executable, "-m"]  # the servers and cpuforge of the environment running this script
    with server([*python, "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                f"{prefect}/health", env, tmp / "prefect.log"), \
         server([*python, "mlflow", "server", "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", str(tmp / "artifacts")],
                f"{mlflow_ui}/health", env, tmp / "mlflow.log"), \
         sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(  # a fresh profile folder, in the temporary folder
            tmp / "chromium", executable_path=args.chromium, args=CHROMIUM_FLAGS[1:], headless=True,
            viewport={"width": 1400, "height": 900})
        browser.add_init_script(MLFLOW_UI_SETTINGS)
        page = browser.new_page()
        cmd = [*python, "cpuforge.flows.cli", "run", "--profile", "tiny", "--workdir", str(tmp / "work"),
               *[a for s in RUN_SETTINGS for a in ("--set", s)]]
        print("running:", " ".join(cmd))
        with open(tmp / "run.log", "wb") as log:
            run = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            photograph(page, run, prefect, prefect_ui, mlflow_ui, tmp, args.out)
        finally:
            if run.poll() is None:  # this script failed: the run must not outlive its servers
                run.send_signal(2)
                run.wait()
            browser.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def photograph(page, run: subprocess.Popen, prefect: str, prefect_ui: str, mlflow_ui: str, tmp: Path,
               out: Path) -> None:
    # While the pipeline runs: its flow run page (the stages' artifacts on the graph), and a stage's live
    # headline. On a slow machine a page can take longer to load than a stage to finish: then the
    # headline shows the final numbers, and the next stage that reports live is tried.
    flow_run_id, flow_live, headline_live = None, False, False
    while run.poll() is None and not (flow_live and headline_live):
        time.sleep(2)
        runs = api(f"{prefect}/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
        if not runs:
            continue
        flow_run_id = runs[0]["id"]
        for task_run in task_runs(prefect, flow_run_id):
            if task_run["state_type"] != "RUNNING":
                continue
            live = {a["type"]: a for a in api(f"{prefect}/artifacts/filter",
                                              {"artifacts": {"task_run_id": {"any_": [task_run["id"]]}}})}
            if "progress" not in live or "markdown" not in live or float(live["progress"]["data"]) > 85:
                continue
            if not flow_live and task_run["name"].startswith("pretrain"):
                flow_live = shoot(page, f"{prefect_ui}/runs/flow-run/{flow_run_id}",
                                  out / "prefect-flow-run-live.png", wait_text="Running")
            elif not headline_live:
                headline_live = shoot(page, f"{prefect_ui}/artifacts/artifact/{live['markdown']['id']}",
                                      out / "prefect-live-headline.png", wait_text="time left")
            break
    if run.wait() != 0:
        print((tmp / "run.log").read_text()[-5000:], file=sys.stderr)
        raise SystemExit(f"the pipeline failed (exit {run.returncode}); servers' logs in {tmp}")
    if not (flow_live and headline_live):
        print("the run ended before every live picture was taken (see the warnings)", file=sys.stderr)

    shoot(page, f"{prefect_ui}/runs/flow-run/{flow_run_id}", out / "prefect-flow-run.png",
          wait_text="evaluate")
    final = api(f"{prefect}/artifacts/filter", {"artifacts": {"key": {"any_": ["cpuforge-pretrain"]},
                                                              "flow_run_id": {"any_": [flow_run_id]}}})
    shoot(page, f"{prefect_ui}/artifacts/artifact/{final[0]['id']}", out / "prefect-final-headline.png",
          wait_text="completed")
    summary = json.loads(next((tmp / "work" / "runs").rglob("summary.json")).read_text())
    runs_url = f"{mlflow_ui}/#/experiments/{summary['mlflow_experiment_id']}/runs"
    shoot(page, f"{runs_url}/{summary['mlflow_run_id']}", out / "mlflow-run.png", wait_text="cpuforge")
    shoot(page, f"{runs_url}/{summary['stages']['pretrain']['mlflow_run_id']}/model-metrics",
          out / "mlflow-pretrain-metrics.png", settle_s=6)
    shoot(page, f"{mlflow_ui}/#/models/cpuforge-lm", out / "mlflow-registry.png", wait_text="cpuforge-lm")


if __name__ == "__main__":
    sys.exit(main())
