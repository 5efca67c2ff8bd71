"""The ``h3gate`` command (typer, as Prefect's own CLI uses).

Exit codes: 0 success (or pass), 1 a numerical fail (gates), 2 any error, printed as one line that
names the object at fault. Store options: ``--store URL`` / ``$H3GATE_STORE`` and
``--storage-options JSON`` / ``$H3GATE_STORAGE_OPTIONS`` (never echoed: they may hold secrets).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

# Before Prefect is imported: the ephemeral API's first start on a fresh home takes ~19 s, close to
# the 20 s default timeout, and telemetry only produces DNS errors on closed networks.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Without a GPU the candidate's Triton kernels run in Triton's interpreter (read when kernels are defined).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

app = typer.Typer(
    help="h3gate: qualify MiniMax-H3 candidate kernels against the diffusers reference, with evidence.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

T = TypeVar("T")

StoreOpt = Annotated[str | None, typer.Option("--store", help="Store URL; default $H3GATE_STORE or ./h3store")]
OptionsOpt = Annotated[
    str | None,
    typer.Option("--storage-options", help="fsspec storage options as JSON (default $H3GATE_STORAGE_OPTIONS)"),
]
PresetOpt = Annotated[str, typer.Option("--preset", help="tiny | small | block | full")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Preset override key=value (model config or sample field); repeatable")
]
CheckpointOpt = Annotated[
    str | None, typer.Option("--checkpoint", help="Real checkpoint: diffusers folder or .safetensors (path or URL)")
]
CaptureOpt = Annotated[str, typer.Option("--capture", help="blocks (default) or nodes")]
ProvidersOpt = Annotated[str | None, typer.Option("--providers", help="Comma-separated BF16 providers")]
SplitOpt = Annotated[str, typer.Option(
    "--split", help="Split each model over devices: cuda:0,cuda:1 (even) or cuda:0=26,cuda:1=24 (blocks each)")]
GpusPerRunOpt = Annotated[int, typer.Option(
    "--gpus-per-run", min=1, help="With --device cuda: split each model over this many GPUs; runs fan out per group")]


def _run(body: Callable[[], T]) -> T:
    """Run a command body: any failure becomes one line on stderr and exit code 2."""
    try:
        return body()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        typer.echo("error: interrupted; rerun the same command to resume (present blobs are skipped)", err=True)
        raise typer.Exit(2) from None
    except Exception as exc:  # noqa: BLE001 - the CLI's contract is one line and exit 2 for every error
        typer.echo(f"error: {type(exc).__name__}: {_one_line(exc)}", err=True)
        raise typer.Exit(2) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:500] if text else repr(exc)


def _apply_storage_options(storage_options: str | None) -> None:
    """Hand storage options to the store through the environment, never as flow parameters."""
    if storage_options is None:
        return
    try:
        parsed = json.loads(storage_options)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--storage-options is not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(parsed, dict):
        raise ValueError("--storage-options must be a JSON object")
    os.environ["H3GATE_STORAGE_OPTIONS"] = storage_options


def _store(store: str | None, storage_options: str | None) -> Any:
    from tasks.store import Store

    _apply_storage_options(storage_options)
    return Store.from_env(store)


def _common(store: str | None, preset: str, overrides: list[str] | None, device: str, checkpoint: str | None,
            capture: str, split: str = "", gpus_per_run: int = 1) -> dict[str, Any]:
    from tasks.model import parse_overrides

    return dict(store=store, preset=preset, overrides=parse_overrides(overrides), device=device,
                checkpoint=checkpoint, capture=capture, split=split, gpus_per_run=gpus_per_run)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@app.command()
def reference(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    providers: ProvidersOpt = None,
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    capture: CaptureOpt = "blocks",
    force: Annotated[bool, typer.Option("--force", help="Re-capture runs the store already holds")] = False,
    split: SplitOpt = "",
    gpus_per_run: GpusPerRunOpt = 1,
) -> None:
    """Make (or reuse) the FP32 + BF16-provider reference of a preset and store it, hashed."""

    def body() -> None:
        from flows.reference import ReferenceParams, reference_flow

        _apply_storage_options(storage_options)
        params = ReferenceParams(**_common(store, preset, overrides, device, checkpoint, capture, split, gpus_per_run),
                                 providers=_split(providers), force=force)
        with _console():
            info = reference_flow(params)
        typer.echo(f"reference {info.reference_id}  (inventory sha256 {info.inventory_sha})")
        runs = {"fp32": info.fp32_run, "fp32-alt": info.fp32_alt_run, **info.provider_runs}
        width = max(len(name) for name in runs)
        for name, run in runs.items():
            typer.echo(f"  {name:<{width}}  {run}")

    _run(body)


@app.command()
def verify(
    run: Annotated[str | None, typer.Option("--run", help="Run id (default: every run in the store)")] = None,
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
) -> None:
    """Re-hash every blob of a run (or of every run) and report missing or tampered blobs."""

    def body() -> None:
        s = _store(store, storage_options)
        runs = [run] if run else s.list_runs()
        if not runs:
            raise LookupError(f"the store {s.url} holds no runs")
        bad = None
        for run_id in runs:
            report = s.verify_run(run_id)
            status = "ok" if report.ok else "FAILED"
            typer.echo(f"{status:<6} {run_id}  ({report.ok_count} ok)")
            if not report.ok and bad is None:
                bad = report
        if bad is not None:
            bad.raise_for_errors()

    _run(body)


@app.command()
def diff(
    run_a: Annotated[str, typer.Argument(help="First run id")],
    run_b: Annotated[str, typer.Argument(help="Second run id")],
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    show: Annotated[int, typer.Option("--show", help="How many differing tensors to list")] = 20,
) -> None:
    """Compare two runs name by name: byte-identical blobs, and relative_l2/max_abs for the rest."""

    def body() -> None:
        from tasks.compare import diff_runs

        result = diff_runs(_store(store, storage_options), run_a, run_b)
        typer.echo(f"{result.identical} identical, {len(result.differing)} differing, "
                   f"{len(result.only_a)} only in {run_a}, {len(result.only_b)} only in {run_b}")
        for cmp in result.differing[:show]:
            typer.echo(f"  {cmp.name:<70} rel_l2 {cmp.relative_l2:.3e}  max_abs {cmp.max_abs:.3e}")
        for name in result.only_a[:show]:
            typer.echo(f"  only in A: {name}")
        for name in result.only_b[:show]:
            typer.echo(f"  only in B: {name}")

    _run(body)


ReferenceOpt = Annotated[str | None, typer.Option("--reference", help="Reference id (default: the preset's current)")]


def _echo_spread(spread: dict[str, dict[str, Any]], top: int = 5) -> None:
    """The widest-spread tensors: where the providers disagree most."""
    widest = sorted(spread.items(), key=lambda item: (-float(item[1]["ratio"]), item[0]))[:top]
    typer.echo(f"widest provider spread (max/min relative_l2), top {top}:")
    for name, row in widest:
        typer.echo(f"  {name:<64} ratio {float(row['ratio']):8.3f}  max {float(row['max']):.3e} "
                   f"({row['outlier']})  min {float(row['min']):.3e}")


@app.command()
def spread(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    reference_id: ReferenceOpt = None,
) -> None:
    """Every BF16 provider against FP32, per tensor (report.json each), and their spread."""

    def body() -> None:
        from flows.spread import SpreadParams, spread_flow

        _apply_storage_options(storage_options)
        result = spread_flow(SpreadParams(store=store, preset=preset, device=device, reference_id=reference_id))
        typer.echo(f"reference {result['reference'].reference_id}: {len(result['reports'].reports)} providers, "
                   f"{len(result['spread'])} tensors")
        _echo_spread(result["spread"])

    _run(body)


@app.command()
def calibrate(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    reference_id: ReferenceOpt = None,
) -> None:
    """Calibrate the ensemble rule (k by leave-one-out, floor from FP32 noise) on a stored reference."""

    def body() -> None:
        from flows.calibrate import CalibrateParams, calibrate_flow

        _apply_storage_options(storage_options)
        result = calibrate_flow(CalibrateParams(store=store, preset=preset, device=device, reference_id=reference_id))
        rule = result["rule"].rule
        typer.echo(f"reference {result['reference'].reference_id}")
        typer.echo(f"k = {rule.k:.4f} (raw {rule.k_raw:.4f})   floor = {rule.floor:.3e}   [{rule.floor_method}]")
        typer.echo("held-out worst ratios:")
        for provider, entry in sorted(rule.leave_one_out.items()):
            twins = f"  (twins left out: {', '.join(entry['twins'])})" if entry.get("twins") else ""
            typer.echo(f"  {provider:<20} {float(entry['ratio']):8.4f}  on {entry['tensor']}{twins}")
        _echo_spread(result["spread"])
        typer.echo(f"ensemble-rule.json sha256 {result['rule'].rule_sha}")

    _run(body)


NodesOpt = Annotated[str | None, typer.Option("--nodes", help="Comma-separated candidate nodes (default: all)")]
KeepOpt = Annotated[bool, typer.Option("--keep-candidate", help="Also store the candidate's tensors")]


def _echo_gate(result: Any) -> None:
    """The verdict in a few lines; exit 0 on pass, 1 on a numerical fail."""
    if result.stage == "golden":
        typer.echo(f"FAIL at the golden tests: {', '.join(result.golden_failed[:10])}")
        raise typer.Exit(1)
    typer.echo(f"{'PASS' if result.passed else 'FAIL'}  gate {result.gate_id}")
    if result.worst:
        typer.echo(f"  worst       {result.worst['tensor']}  ({float(result.worst['ratio']):.3f} x its bound)")
    if result.first_drift:
        typer.echo(f"  first drift {result.first_drift['tensor']}  (order {result.first_drift['order']})")
    if result.failures:
        typer.echo(f"  {len(result.failures)} failing tensors, first: {', '.join(result.failures[:5])}")
    if result.ledger_missing:
        typer.echo(f"  candidate nodes that never ran: {', '.join(result.ledger_missing[:10])}")
    typer.echo(f"  report      {result.report_url}")
    if not result.passed:
        raise typer.Exit(1)


@app.command()
def gate(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    reference_id: ReferenceOpt = None,
    nodes: NodesOpt = None,
    keep_candidate: KeepOpt = False,
    split: SplitOpt = "",
    gpus_per_run: GpusPerRunOpt = 1,
) -> None:
    """Gate the candidate kernels against a stored, calibrated reference. Exit 0 pass, 1 fail, 2 error."""

    def body() -> None:
        from flows.gate import GateParams, gate_flow

        _apply_storage_options(storage_options)
        params = GateParams(**_common(store, preset, overrides, device, checkpoint, "blocks", split, gpus_per_run),
                            reference_id=reference_id, nodes=_split(nodes), keep_candidate=keep_candidate)
        with _console():
            result = gate_flow(params)
        _echo_gate(result)

    _run(body)


@app.command()
def qualify(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    providers: ProvidersOpt = None,
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    capture: CaptureOpt = "blocks",
    nodes: NodesOpt = None,
    keep_candidate: KeepOpt = False,
    split: SplitOpt = "",
    gpus_per_run: GpusPerRunOpt = 1,
) -> None:
    """Reference (reused if stored) -> calibrate -> gate. Exit 0 pass, 1 numerical fail, 2 error."""

    def body() -> None:
        from flows.qualify import QualifyParams, qualify_flow

        _apply_storage_options(storage_options)
        params = QualifyParams(**_common(store, preset, overrides, device, checkpoint, capture, split, gpus_per_run),
                               providers=_split(providers), nodes=_split(nodes), keep_candidate=keep_candidate)
        with _console():
            result = qualify_flow(params)
        _echo_gate(result)

    _run(body)


@app.command()
def golden(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    reference_id: ReferenceOpt = None,
    out: Annotated[str | None, typer.Option("--out", help="Also write tests.json here")] = None,
) -> None:
    """Block-0 golden tests: each candidate node on the exact inputs of the FP32 reference. Exit 1 on a fail."""

    def body() -> None:
        from tasks import golden as golden_lib
        from tasks import model as model_lib
        from tasks.reference import current_reference, load_reference

        s = _store(store, storage_options)
        preset_obj = model_lib.get_preset(preset, model_lib.parse_overrides(overrides))
        reference = (load_reference(s, reference_id) if reference_id
                     else current_reference(s, preset, torch_device_type(device)))
        ckpt = (model_lib.open_real_checkpoint(s, checkpoint, preset_obj) if checkpoint
                else model_lib.write_synthetic_checkpoint(s, preset_obj))
        result = golden_lib.run_golden(s, reference, preset_obj, ckpt, device=device)
        if out:
            Path(out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        for test in result["tests"]:
            if test["outcome"] != "passed":
                typer.echo(f"FAILED {test['name']}: candidate {test['candidate_relative_l2']} > limit {test['limit']}")
        passed = sum(t["outcome"] == "passed" for t in result["tests"])
        typer.echo(f"{passed} passed, {len(result['tests']) - passed} failed")
        if not result["passed"]:
            raise typer.Exit(1)

    _run(body)


@app.command()
def evidence(
    run: Annotated[str, typer.Option("--run", help="Gate id (runs/<gate_id>/verdict.json in the store)")],
    out: Annotated[str, typer.Option("--out", help="Folder for the bundle (new or empty)")],
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
) -> None:
    """Evidence bundle of a gate for a PR: tests.json, redaction.json, SHA256SUMS, report, verdict, SUMMARY.md."""

    def body() -> None:
        from flows.evidence import collect
        from tasks.evidence import build_bundle

        s = _store(store, storage_options)
        flow_runs, logs = collect(run)  # flow-run links and logs when a Prefect server is in use
        result = build_bundle(s, run, out, flow_runs=flow_runs, logs=logs)
        typer.echo(f"{'PASS' if result['passed'] else 'FAIL'}  gate {run}: {len(result['files'])} files in {out}")
        typer.echo(f"  redacted {result['redaction']['total']} items; SHA256SUMS sha256 {result['sums_sha256']}")
        typer.echo(f"  check: cd {out} && sha256sum -c SHA256SUMS; paste {out}/SUMMARY.md into the PR")

    _run(body)


@app.command()
def selftest(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    providers: ProvidersOpt = None,
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    mutants: Annotated[str | None, typer.Option("--mutants", help="Comma-separated mutants (default: all)")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Sample seed of the second-seed probe; -1 skips it")] = 1,
) -> None:
    """Gate power: mutants must be caught, correct implementations must pass. Exit 1 if a must-catch escapes."""

    def body() -> None:
        from flows.selftest import SelftestParams, selftest_flow

        _apply_storage_options(storage_options)
        params = SelftestParams(**_common(store, preset, overrides, device, checkpoint, "blocks"),
                                providers=_split(providers), mutants=_split(mutants),
                                seed=None if seed < 0 else seed)
        with _console():
            result = selftest_flow(params)
        s = result.summary
        typer.echo(f"self-test {result.reference_id}: {s['caught']}/{s['mutants']} mutants caught "
                   f"({s['must_catch_caught']}/{s['must_catch']} must-catch), localised {s['localised']}/"
                   f"{s['caught']}, false rejects {s['false_rejects']}/{s['probes']}")
        for m in result.mutants:
            ratio = "n/a" if m["worst_ratio"] is None else f"{float(m['worst_ratio']):.3g}"
            typer.echo(f"  {'caught ' if m['caught'] else 'ESCAPED'} {m['name']:<26} ratio {ratio:>7}  "
                       f"first drift {m['first_drift']}{'' if m['localised'] else ' (not localised)'}")
        for p in result.probes:
            typer.echo(f"  {'pass    ' if p['passed'] else 'REJECTED'} {p['name']}")
        for finding in result.findings:
            typer.echo(f"  ! {finding}")
        typer.echo(f"  report {result.report_url}")
        if result.must_catch_escaped:
            raise typer.Exit(1)

    _run(body)


@app.command()
def generate(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    reference_id: ReferenceOpt = None,
    nodes: NodesOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="Schedule points (set_timesteps); steps - 1 evaluations")] = 30,
) -> None:
    """Generation gate: a full FL2VA trajectory after the numerical gate passed. Exit 0 pass, 1 fail, 2 error."""

    def body() -> None:
        from flows.generate import GenerateParams, generate_flow

        _apply_storage_options(storage_options)
        params = GenerateParams(**_common(store, preset, overrides, device, checkpoint, "blocks"),
                                reference_id=reference_id, nodes=_split(nodes), steps=steps)
        with _console():
            result = generate_flow(params)
        typer.echo(f"{'PASS' if result.passed else 'FAIL'}  generate {result.generate_id}")
        if result.worst_step:
            worst = result.worst_step
            typer.echo(f"  worst step  {worst['tensor']}  ({float(worst['ratio']):.3f} x its bound)")
        if result.first_failure:
            typer.echo(f"  first failure {result.first_failure} ({len(result.failures)} failing tensors)")
        for name, m in result.final.items():
            typer.echo(f"  {name:<20} rel_l2 {float(m['relative_l2']):.3e}  PSNR {float(m['psnr_db']):.2f} dB  "
                       f"cosine {float(m['cosine']):.8f}")
        if not result.deterministic:
            typer.echo(f"  NOT deterministic: first differs at step {result.first_mismatch['step']}, "
                       f"{result.first_mismatch['tensor']}")
        typer.echo(f"  report      {result.report_url}")
        if not result.passed:
            raise typer.Exit(1)

    _run(body)


@app.command()
def diagnose(
    preset: PresetOpt = "tiny",
    store: StoreOpt = None,
    storage_options: OptionsOpt = None,
    device: DeviceOpt = "cpu",
    overrides: SetOpt = None,
    checkpoint: CheckpointOpt = None,
    reference_id: ReferenceOpt = None,
    auto: Annotated[bool, typer.Option("--auto", help="Bisect blocks, node groups, nodes to the smallest fix")] = False,
    replace: Annotated[list[str] | None, typer.Option("--replace", help="Node group, node or 'all' to run as the "
                                                      "reference; repeatable")] = None,
    blocks: Annotated[str | None, typer.Option("--blocks", help="Transformer blocks '0-1', '0,2' or module names")]
    = None,
    provider_variant: Annotated[str | None, typer.Option("--provider-variant", help="Provider for --provider-nodes")]
    = None,
    provider_nodes: Annotated[list[str] | None, typer.Option("--provider-nodes", help="Node group or node run as the "
                                                             "reference under --provider-variant; repeatable")] = None,
    no_conditioning: Annotated[bool, typer.Option("--no-conditioning", help="Skip the attention conditioning")] = False,
) -> None:
    """Where does the candidate's error come from: replace nodes by the reference, localise, isolate. Exit 0/2."""

    def body() -> None:
        from flows.diagnose import DiagnoseParams, diagnose_flow
        from tasks.report_figures import fmt

        _apply_storage_options(storage_options)
        params = DiagnoseParams(**_common(store, preset, overrides, device, checkpoint, "blocks"),
                                reference_id=reference_id, auto=auto, replace=replace or [], blocks=blocks,
                                provider_variant=provider_variant, provider_nodes=provider_nodes or [],
                                conditioning=not no_conditioning)
        with _console():
            result = diagnose_flow(params)
        for r in [result.baseline, *result.configurations, *(result.localisation or {}).get("steps", [])]:
            typer.echo(f"  {'pass' if r['passed'] else 'FAIL'}  worst ratio {fmt(r['worst_ratio'], '.4g'):>8}  "
                       f"failing {r['failing']:>4}  first drift {r['first_drift']}  <- {r['label']}")
        loc = result.localisation
        if loc is not None:
            typer.echo(f"localised: {', '.join(loc['nodes'])} in {', '.join(loc['blocks'])}" if loc.get("found")
                       else f"not localised: {loc.get('why')}")
        for block in result.isolation:
            creators = [n["node"] for n in block["nodes"] if n["creates"]]
            typer.echo(f"isolation {block['block']}: " + (f"creates error: {', '.join(creators)}" if creators
                                                          else "no node creates error (it carries it)"))
        typer.echo(f"diagnose {result.run_id}\n  report {result.report_url}")

    _run(body)


@app.command()
def plan(
    preset: PresetOpt = "tiny",
    device: DeviceOpt = "cpu",
    overrides: SetOpt = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16")] = "bfloat16",
    provider: Annotated[str | None, typer.Option("--provider", help="Provider (its attention kind)")] = None,
    split: SplitOpt = "",
    gpus: Annotated[int, typer.Option("--gpus", min=0, help="Plan an even split over cuda:0..N-1 (no GPU needed "
                                      "with --memory)")] = 0,
    memory: Annotated[str | None, typer.Option("--memory", help="Memory per device, e.g. 141GB or 80GiB "
                                               "(default: ask each device)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
) -> None:
    """The per-device memory plan of one run, before anything is allocated. Exit 0 fits, 1 does not fit, 2 error."""

    def body() -> None:
        from tasks.memory_plan import parse_bytes, plan_memory
        from tasks.model import get_preset, parse_overrides
        from tasks.placement import Placement
        from tasks.providers import resolve_provider

        chosen = get_preset(preset, parse_overrides(overrides))
        layers = chosen.config["num_layers"]
        if gpus and split:
            raise ValueError("give --gpus or --split, not both")
        placement = (Placement.even([f"cuda:{i}" for i in range(gpus)], layers) if gpus
                     else Placement.parse(split, layers) if split else Placement.single(device, layers))
        capacities = dict.fromkeys(placement.devices, parse_bytes(memory)) if memory else None
        runner = resolve_provider(provider, placement.main_device) if provider else None
        result = plan_memory(chosen, dtype, placement, provider=runner, capacities=capacities)
        typer.echo(json.dumps(result.to_json(), indent=2) if as_json else
                   f"{chosen.name} {dtype} S={result.seq_len}, {'fused' if result.fused_attention else 'math'} "
                   f"attention, GiB\n{result.table()}")
        if not all(d.fits for d in result.devices):
            raise typer.Exit(1)

    _run(body)


def torch_device_type(device: str) -> str:
    return device.split(":")[0]


def _console() -> Any:
    from flows.console import console_progress

    return console_progress()


def main() -> None:
    """Console-script entry point."""
    app(prog_name="h3gate")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
