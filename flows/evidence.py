"""The evidence flow: a self-verifying bundle of one gate for a pull request (tasks/evidence.py writes it).

When a Prefect server is in use (PREFECT_API_URL), the gate's flow runs are found through its verdict
artifact, their URLs go into SUMMARY.md (PREFECT_UI_URL, else the API URL's host) and their logs into logs/,
redacted. Without a server the bundle is built from the store alone.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow, task
from pydantic import Field

from flows.common import StoreParams
from tasks import evidence as evidence_lib
from tasks.store import Store


class EvidenceParams(StoreParams):
    run: str = Field(description="Gate id (runs/<gate_id>/verdict.json in the store)")
    out: str = Field(description="Folder to write the bundle into (must be empty or new)")


def ui_base() -> str | None:
    """Where flow runs are shown: PREFECT_UI_URL, else the API URL without /api; None without a server."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    ui, api = PREFECT_UI_URL.value(), PREFECT_API_URL.value()
    if not api:
        return None
    return (ui or api.removesuffix("/").removesuffix("/api")).rstrip("/")


async def prefect_evidence(gate_id: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(label -> flow-run URL, log name -> lines) of the flow runs that published this gate's verdict."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, LogFilter
    from prefect.client.schemas.sorting import LogSort

    base = ui_base()
    if base is None:
        return {}, {}
    links: dict[str, str] = {}
    logs: dict[str, list[str]] = {}
    async with get_client() as client:
        artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="gate-")))
        run_ids = list(dict.fromkeys(a.flow_run_id for a in artifacts
                                     if a.flow_run_id and gate_id in str(a.data or "")))
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id={"any_": run_ids})) if run_ids else []
        parents = [r.parent_task_run_id for r in runs if r.parent_task_run_id]
        for parent in parents:  # the qualify flow above a gate subflow
            task_run = await client.read_task_run(parent)
            if task_run.flow_run_id:
                runs += await client.read_flow_runs(flow_run_filter=FlowRunFilter(id={"any_": [task_run.flow_run_id]}))
        for r in runs:
            label = f"{r.name} ({r.state_name})"
            links[label] = f"{base}/runs/flow-run/{r.id}"
            records = await client.read_logs(log_filter=LogFilter(flow_run_id={"any_": [r.id]}),
                                             sort=LogSort.TIMESTAMP_ASC)
            logs[f"prefect-{r.name}"] = [f"{x.timestamp.isoformat()} {x.level} {x.name}: {x.message}" for x in records]
    return links, logs


@task(name="build-evidence")
def build_evidence(store_url: str | None, gate_id: str, out: str, flow_runs: dict[str, str],
                   logs: dict[str, list[str]]) -> dict[str, Any]:
    """Write the evidence bundle of one gate (tests, redaction, hashes, report, verdict, ledger, summary)."""
    return evidence_lib.build_bundle(Store.from_env(store_url), gate_id, out, flow_runs=flow_runs, logs=logs)


def collect(gate_id: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """prefect_evidence from synchronous code (empty without a server)."""
    import asyncio

    if not os.environ.get("PREFECT_API_URL"):
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():
            return {}, {}
    return asyncio.run(prefect_evidence(gate_id))


@flow(name="h3-evidence", log_prints=True)
def evidence_flow(params: EvidenceParams) -> dict[str, Any]:
    """Bundle the evidence of one gate for a pull request."""
    # Prefect side: flow-run links and logs of the gate (the evidence flow's own run excluded)
    from prefect.utilities.asyncutils import run_coro_as_sync

    flow_runs, logs = run_coro_as_sync(prefect_evidence(params.run))

    # Bundle: store documents, redacted, hashed
    result = build_evidence(params.store, params.run, params.out, flow_runs, logs)
    print(f"evidence for {params.run}: {len(result['files'])} files in {params.out}, "
          f"SHA256SUMS {result['sums_sha256']}")
    return result
