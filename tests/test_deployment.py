"""deployments/prefect.yaml end to end: a real Prefect server, a deploy, a UI-style run, a real process worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.host import quick_cpu_providers

REPO = Path(__file__).resolve().parent.parent
PREFECT = [sys.executable, "-m", "prefect"]
pytestmark = pytest.mark.service


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server at {url} not healthy after {timeout} s")


def _stop(proc: subprocess.Popen, sig: signal.Signals, times: int = 1, wait: float = 30) -> None:
    """Stop a process we started, by its PID."""
    if proc.poll() is not None:
        return
    for _ in range(times):
        os.kill(proc.pid, sig)
        time.sleep(1)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_prefect_yaml_is_site_neutral():
    doc = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    names = {d["name"]: d for d in doc["deployments"]}
    assert {"nightly-gate", "regenerate-reference", "calibrate", "qualify", "qualify-tiny-cpu"} <= set(names)
    assert names["nightly-gate"]["schedules"][0]["cron"] and not names["regenerate-reference"]["schedules"]
    for d in doc["deployments"]:
        path, func = d["entrypoint"].split(":")
        assert func in (REPO / path).read_text()
    assert names["qualify-tiny-cpu"]["work_pool"]["name"] == "h3-cpu"
    assert names["nightly-gate"]["work_pool"]["name"] == "h3-gpu"
    text = (REPO / "deployments" / "prefect.yaml").read_text()
    for bad in ("/home/", "/root", "/work", "AKIA", "password", socket.gethostname()):
        assert bad not in text


def test_deploy_run_and_worker_end_to_end(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    store = tmp_path / "store"
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_LOGGING_LEVEL="INFO",
               PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
               H3GATE_PROJECT_DIR=str(REPO), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("H3GATE_STORE", None)
    started = time.monotonic()
    server = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
                              env=env, stdout=open(tmp_path / "server.log", "wb"), stderr=subprocess.STDOUT)
    worker = None
    try:
        _wait_healthy(api, server)

        # `prefect deploy` resolves {{ $VAR }} from its own environment when VAR is set there: deploy without
        # H3GATE_PROJECT_DIR so the pull step stays templated and each worker resolves it
        cli_env = {k: v for k, v in env.items() if k != "H3GATE_PROJECT_DIR"}

        def prefect(*args: str) -> str:
            out = subprocess.run([*PREFECT, *args], env=cli_env, cwd=REPO, capture_output=True, text=True,
                                 timeout=120)
            assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
            return out.stdout

        prefect("work-pool", "create", "h3-cpu", "--type", "process")
        prefect("--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "qualify-tiny-cpu")
        # As the UI would: the whole params form, one field changed (only 3 providers, to keep it fast)
        params = {"preset": "tiny", "store": str(store), "device": "cpu", "capture": "blocks",
                  "providers": quick_cpu_providers()}
        out = prefect("deployment", "run", "h3-qualify/qualify-tiny-cpu", "--param", f"params={json.dumps(params)}")
        assert "Created flow run" in out

        worker = subprocess.Popen([*PREFECT, "worker", "start", "--pool", "h3-cpu", "--run-once"], env=env,
                                  cwd=tmp_path, stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT)
        worker.wait(240)
        log = (tmp_path / "worker.log").read_text(errors="replace")
        deployment, flow_run, artifacts = asyncio.run(_read_back(env))
        # the pull step stays templated on the server and resolves on the worker (its cwd is elsewhere)
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {
            "directory": "{{ $H3GATE_PROJECT_DIR }}"}}]
        assert flow_run.state_name == "Completed", log[-4000:]
        assert flow_run.parameters["params"]["providers"] == params["providers"]
        keys = {a.key for a in artifacts}
        assert {"gate-tiny-cpu-verdict", "gate-tiny-cpu-worst-tensors", "gate-tiny-cpu-report"} <= keys
        verdict = next(a for a in artifacts if a.key == "gate-tiny-cpu-verdict")
        assert "PASS" in verdict.data
        assert list(store.glob("runs/*-gate-*/verdict.json")), "the gate wrote no verdict into the store"
    finally:
        if worker is not None:
            _stop(worker, signal.SIGINT, times=2)
        _stop(server, signal.SIGTERM)
    assert time.monotonic() - started < 240


async def _read_back(env: dict[str, str]):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, DeploymentFilter
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        async with get_client() as client:
            deployment = await client.read_deployment_by_name("h3-qualify/qualify-tiny-cpu")
            runs = await client.read_flow_runs(deployment_filter=DeploymentFilter(id={"any_": [deployment.id]}))
            assert len(runs) == 1
            run = runs[0]
            children = await client.read_flow_runs()
            ids = [r.id for r in children if r.id == run.id or r.parent_task_run_id is not None]
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
            return deployment, run, artifacts
