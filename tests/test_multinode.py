"""Two machines for real, inside this one: two network namespaces joined by a veth pair.

Each namespace has its own network stack (its own loopback and one private address), so torchrun's
c10d rendezvous, the workers' TCP store and gloo must all cross the veth link as they would cross a
network; the work folder is shared (namespaces share the filesystem), as NFS would be. Node A runs
the stage's own launcher (training_run.execute), node B joins with `python -m cpuforge.tasks.engine.training_run
<launch.json>`, as a second machine would. Needs root (`ip netns add`); skipped where refused.
Also: Dask tokenization against a `dask scheduler` and `dask worker`s started as separate processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from cpuforge.models.checkpoint import load_model
from cpuforge.tasks.config.settings import load_config
from cpuforge.tasks.engine.data import open_shards
from cpuforge.tasks.engine.rendezvous import torchrun_command
from cpuforge.tasks.engine.training_run import TrainingSpec, run_training
from cpuforge.tasks.records.errors import ConfigError
from cpuforge.tasks.stages.tokenize import tokenize
from tests.test_pretrain import shards  # noqa: F401  (the shared fixture: tokenized tiny shards)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DASK = Path(sys.executable).with_name("dask")


@dataclass(frozen=True)
class Node:
    netns: str
    address: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def nodes():
    """(A, B): two namespaces with 10.250.X.1/30 and .2/30 on a veth pair; always deleted afterwards."""
    pid = os.getpid()
    subnet = f"10.250.{pid % 250 + 1}"
    a, b = Node(f"cpf-{pid}-a", f"{subnet}.1"), Node(f"cpf-{pid}-b", f"{subnet}.2")
    created = []
    try:
        for node in (a, b):
            try:
                _ip("netns", "add", node.netns)
            except (OSError, subprocess.CalledProcessError) as exc:
                pytest.skip(f"cannot create a network namespace: {getattr(exc, 'stderr', None) or exc}")
            created.append(node.netns)
        # Both ends are created inside the namespaces: nothing is added to this machine's own network.
        _ip("link", "add", f"cpf{pid}a", "netns", a.netns, "type", "veth",
            "peer", "name", f"cpf{pid}b", "netns", b.netns)
        for node, dev in ((a, f"cpf{pid}a"), (b, f"cpf{pid}b")):
            _ip("-n", node.netns, "addr", "add", f"{node.address}/30", "dev", dev)
            _ip("-n", node.netns, "link", "set", dev, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for name in created:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def in_netns(node: Node, *python_args: str, log: Path) -> subprocess.Popen:
    """Run python in the node's namespace, in a session of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",  # torchrun's agent logs
           # each machine has its own training slots (its own /tmp)
           "CPUFORGE_LOCK_DIR": str(log.parent / f"locks-{node.netns}")}
    return subprocess.Popen(["ip", "netns", "exec", node.netns, sys.executable, *python_args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


START = ("-c", "import logging, sys; from cpuforge.tasks.engine.training_run import TrainingSpec, execute; "
         "logging.basicConfig(level=logging.INFO); execute(TrainingSpec.model_validate_json(open(sys.argv[1]).read()))")
JOIN = ("-m", "cpuforge.tasks.engine.training_run")  # what the docs tell a second machine to run


def stop(*procs: subprocess.Popen) -> None:
    """Kill what is left of the nodes' processes: the launcher, torchrun and its workers (own sessions)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait()


def two_nodes(nodes, shards: Path, out: Path, port: int, *overrides: str, kill_worker_after: str | None = None) -> dict:
    """Train with node A's stage launcher and node B joining; optionally SIGKILL B's worker once the named
    checkpoint exists. Returns what is needed to check the run."""
    a, b = nodes
    cfg = load_config("tiny", overrides=["train.max_minutes=null", "train.threads=1", "train.nnodes=2",
                                         "train.nproc_per_node=1", f"train.rdzv_endpoint={a.address}:{port}",
                                         "train.eval_interval=6", "train.checkpoint_every_steps=6", *overrides])
    out.mkdir(parents=True)
    vocab = open_shards(shards, cfg.model.block_size).vocab_size
    spec = TrainingSpec(kind="pretrain", train=cfg.train, model=cfg.model.shape(vocab), tokenize_dir=str(shards),
                        out_dir=str(out), threads=1, peak_flops=1e12)
    (out.parent / f"{out.name}-spec.json").write_text(spec.model_dump_json())
    node_a = in_netns(a, *START, str(out.parent / f"{out.name}-spec.json"), log=out.parent / f"{out.name}-a.log")
    node_b = None
    killed = None
    try:
        deadline = time.time() + 60
        while not (out / "launch.json").exists():  # written by node A's launcher before it starts torchrun
            assert time.time() < deadline and node_a.poll() is None, (out.parent / f"{out.name}-a.log").read_text()
            time.sleep(0.05)
        node_b = in_netns(b, *JOIN, str(out / "launch.json"), log=out.parent / f"{out.name}-b.log")
        if kill_worker_after:
            killed = _kill_worker_when(node_b, out / "checkpoints" / kill_worker_after)
        deadline = time.time() + 240
        while node_a.poll() is None or node_b.poll() is None:  # either failing ends the wait
            assert time.time() < deadline and node_a.returncode in (None, 0) and node_b.returncode in (None, 0), \
                [(out.parent / f"{out.name}-{n}.log").read_text()[-3000:] for n in "ab"]
            time.sleep(0.1)
        codes = node_a.returncode, node_b.returncode
    finally:
        stop(node_a, *([node_b] if node_b else []))
    logs = [(out.parent / f"{out.name}-{n}.log").read_text() for n in "ab"]
    assert codes == (0, 0), logs
    return {"logs": logs, "result": json.loads((out / "result.json").read_text()), "killed": killed,
            "history": [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]}


def _kill_worker_when(node: subprocess.Popen, marker: Path) -> int:
    """SIGKILL the node's training worker (not torchrun's agent) once marker exists; returns its pid."""
    deadline = time.time() + 180
    while not marker.exists():
        assert time.time() < deadline and node.poll() is None, "no checkpoint to resume from appeared"
        time.sleep(0.02)
    workers = [p for p in psutil.Process(node.pid).children(recursive=True)
               if "cpuforge.tasks.engine.distributed" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]
    assert len(workers) == 1, workers
    workers[0].send_signal(signal.SIGKILL)
    return workers[0].pid


def worker_groups(log: str, field: str) -> list[str]:
    """A value torchrun's agent logs each time it starts its worker group (e.g. "  global_ranks=[1]")."""
    return [line.split(f"{field}=")[1] for line in log.splitlines() if f"  {field}=" in line]


def test_ddp_across_two_namespaces(nodes, shards, tmp_path):
    run = two_nodes(nodes, shards, tmp_path / "pretrain-ddp.partial", 29511, "train.max_steps=12")
    a, b = run["logs"]
    assert sorted(worker_groups(a, "global_ranks") + worker_groups(b, "global_ranks")) == ["[0]", "[1]"]
    assert worker_groups(a, "global_world_sizes") == worker_groups(b, "global_world_sizes") == ["[2]"]
    # The rendezvous id comes from the stage folder; node B read it from launch.json.
    assert "--rdzv_id=pretrain-ddp " in a and "--rdzv_id=pretrain-ddp " in b
    assert run["result"]["steps"] == 12 and run["result"]["tokens"] == 12 * 8 * 64 * 2  # both nodes' batches
    assert run["history"][-1]["loss"] < run["history"][0]["loss"]
    out = tmp_path / "pretrain-ddp.partial"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000006", "step-00000012"]
    assert load_model(out / "model").cfg.d_model == 64  # written once, by rank 0, and it loads


def test_fsdp_across_two_namespaces_resumes_in_one_process(nodes, shards, tmp_path):
    out = tmp_path / "pretrain-fsdp.partial"
    run = two_nodes(nodes, shards, out, 29512, "train.max_steps=18", "train.strategy=fsdp")
    assert run["result"]["steps"] == 18 and run["result"]["tokens"] == 18 * 8 * 64 * 2
    assert run["history"][-1]["loss"] < run["history"][0]["loss"] - 0.3
    last = out / "checkpoints" / "step-00000018"
    assert len(list((last / "shards").glob("*.distcp"))) == 2  # one part from each node's rank
    assert "model.embed_tokens.weight" in load_file(str(out / "model" / "model.safetensors"))  # transformers names

    alone = tmp_path / "alone"
    shutil.copytree(out / "checkpoints", alone / "checkpoints")
    shutil.rmtree(alone / "checkpoints" / "step-00000018")
    spec = TrainingSpec.model_validate_json((out / "launch.json").read_text())
    train = spec.train.model_copy(update={"nnodes": 1, "strategy": "ddp"})
    result = run_training(spec.model_copy(update={"train": train, "out_dir": str(alone)}))
    assert result.resumed_from == 12 and result.steps == 18


def test_a_killed_worker_is_restarted_by_torchrun_and_resumes(nodes, shards, tmp_path):
    out = tmp_path / "pretrain-elastic.partial"
    run = two_nodes(nodes, shards, out, 29513, "train.max_steps=60", "train.max_restarts=2",
                    kill_worker_after="step-00000012")
    assert not psutil.pid_exists(run["killed"])
    assert "--max-restarts=2" in run["logs"][0] and "will restart worker group" in run["logs"][1]
    # Both agents started their worker group a second time (a new rendezvous round) after the kill.
    assert [len(worker_groups(log, "global_ranks")) for log in run["logs"]] == [2, 2], run["logs"]
    assert run["result"]["resumed_from"] >= 12 and run["result"]["steps"] == 60
    assert len(run["history"]) == 60 and run["history"][-1]["loss"] < run["history"][0]["loss"]


def test_torchrun_command_for_a_rendezvous_on_this_machine_and_a_bad_endpoint(tmp_path):
    """Without namespaces: the endpoint's own machine hosts the store and advertises the endpoint's address."""
    cfg = load_config("tiny", overrides=["train.nnodes=2", "train.rdzv_endpoint=127.0.0.1:29555",
                                         "train.max_restarts=0"])
    cmd, env = torchrun_command(cfg.train, tmp_path / "launch.json", "pretrain-abc")
    assert {"--rdzv_conf=is_host=true", "--local_addr=127.0.0.1", "--rdzv_id=pretrain-abc", "--max-restarts=0",
            "--nnodes=2", "--rdzv_backend=c10d"} <= set(cmd)
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    with pytest.raises(ConfigError, match="is not host:port"):
        torchrun_command(cfg.train.model_copy(update={"rdzv_endpoint": "nohost"}), tmp_path / "launch.json", "x")


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dask_tokenization_on_a_separately_started_scheduler_and_workers(tmp_path, text_corpus, prefect_server):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the workers unpickle tasks.* functions
    logs = tmp_path / "dask-logs"
    logs.mkdir()
    procs = [subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard"], cwd=ROOT, env=env, stdout=(logs / "scheduler.log").open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)]
    try:
        for i in range(2):
            procs.append(subprocess.Popen([str(DASK), "worker", address, "--nthreads", "1", "--nworkers", "1",
                                           "--no-dashboard", "--name", f"w{i}"], cwd=ROOT, env=env,
                                          stdout=(logs / f"worker{i}.log").open("w"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            assert len(client.scheduler_info()["workers"]) == 2

        outputs = {}
        for name, extra in (("single", ["data.encode_runner=single"]), ("dask", [f"data.dask_address={address}"])):
            out = tmp_path / name
            out.mkdir()
            cfg = load_config("tiny", overrides=[f"data.source={text_corpus}", "data.piece_bytes=4096", *extra])
            tokenize(cfg.data, cfg.tokenizer, out, tmp_path / "cache")
            outputs[name] = out
        for file in ("train.bin", "val.bin", "tokenizer.json"):
            assert (outputs["dask"] / file).read_bytes() == (outputs["single"] / file).read_bytes(), file
        meta = [json.loads((outputs[name] / "meta.json").read_text()) for name in ("dask", "single")]
        assert meta[0]["splits"] == meta[1]["splits"]
        assert os.path.getsize(outputs["single"] / "train.bin") > 4 * 4096  # several pieces were really made
        with Client(address, timeout=60) as client:  # the pieces were encoded on these workers, not here
            executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
        assert len(executed) == 2 and sum(executed.values()) >= 4, executed
    finally:
        for proc in reversed(procs):  # workers first, then the scheduler
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
