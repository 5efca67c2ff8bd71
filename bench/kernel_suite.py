"""Issue 4's benchmark: h3kernels' fused kernels against the copy ceiling, attention against SDPA, and one block.

    python bench/kernel_suite.py --json $OUT/kernels.json        # on the H200: about 1.5-3 minutes
    python bench/kernel_suite.py --skip-attention --skip-block   # the bandwidth part only
    python bench/kernel_suite.py --smoke                         # CPU, TRITON_INTERPRET=1, tiny shapes: every code path

Sections (each prints a progress line as it finishes; ONE table with every number comes last):
1. copy: `y.copy_(x)` on 4 GiB bf16 (smoke: 4 MiB); bandwidth = bytes read + bytes written over the median time.
   This is the ceiling (ENVIRONMENT.md measured ~4.0 TB/s on the H200).
2. kernels, bf16 at the real widths (preset `block`: H 5376, 56 x 128, F 14336, E 2688), S = 16384, T = 2
   timesteps (table [3T, 6H] fp32 for the candidate, bf16 for diffusers), the real packed layout's adaln indices
   and rotary cos/sin ([S, 96] fp32): rms_norm_modulate, gated_residual, rms_norm, qk_norm_rope (q [S, 56, 128]),
   swiglu ([S, 2F]) and adaln_table (the GEMV over weight [18H, E]), forward and backward. Achieved bandwidth =
   the fewest bytes the op must move (each input read once, each output written once; `BYTES` below says which
   tensors) over the median time; % of the measured copy bandwidth (target 85%). The baseline is the same op as
   diffusers computes it, `h3kernels.reference.*` in bf16, timed the same way; speedup = baseline / candidate.
   Forward: the op called with grad enabled (what training runs). Backward: `torch.autograd.grad` of a retained
   graph with a seeded output gradient, so it excludes the forward. A 256 MiB buffer is zeroed before each timed
   call (outside the events) so that no input is served from the 60 MB L2.
3. attention fwd/bwd TFLOP/s, h3kernels vs SDPA flash and cuDNN at S = 4096, 16384, 32768 (56 x 128, B=1), through
   bench/attention.py's own `_sdpa` wrappers and `_time_ms` timer, measured as its `_measure` does (forward; backward
   of a retained graph); the same FLOP convention: fwd 4*NH*S^2*D, bwd 2.5x.
4. block: bench/block.py (diffusers default BF16 provider vs the bound candidate, fwd+bwd ms at S = 4096 and 16384,
   and the adaln_proj weight-gradient relative L2 to the FP32 block; see its docstring).
Timing: warmup 3, median of 10 (kernels: 20) CUDA event pairs (bench/block.py's time_ms: a ~1 ms GPU wait before
each start event keeps the host's launch work out of the timed region); torch.cuda.synchronize around every timed
region.
A section that fails prints its traceback to stderr, shows FAILED in the table, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels then run on CPU tensors

import torch  # noqa: E402

from bench import block as block_bench  # noqa: E402
from bench.block import HEADER, free, sync, table, time_ms  # noqa: E402

# Copy ceiling: 4 GiB of bf16 per tensor (two tensors: 8 GiB resident), far past any cache.
COPY_BYTES = 4 << 30
COPY_BYTES_SMOKE = 4 << 20
# L2 eviction buffer zeroed before each timed kernel call (H200 L2 is 60 MB; 256 MiB as triton's do_bench uses).
FLUSH_BYTES = 256 << 20
# Kernel timing: warmup 3 (the brief), median of 20 (each call is ~0.1-1 ms, so 20 costs nothing).
KERNEL_WARMUP, KERNEL_ITERS = 3, 20
BANDWIDTH_TARGET = 0.85  # fraction of the measured copy bandwidth
ATTENTION_SEQLENS = (4096, 16384, 32768)
BLOCK_SEQLENS = (4096, 16384)
# Which tensors count toward each op's fewest bytes (read once + written once; small side tensors included).
BYTES = {
    "rms_norm_modulate": ("fwd: x, weight, table, idx -> y", "bwd: dy, x, weight, table, idx -> dx, dweight, dtable"),
    "gated_residual": ("fwd: x, branch, table, idx -> y", "bwd: dy, branch, table, idx -> dbranch, dtable (dx = dy)"),
    "rms_norm": ("fwd: x, weight -> y", "bwd: dy, x, weight -> dx, dweight"),
    "qk_norm_rope": ("fwd: q, weight, cos, sin -> y", "bwd: dy, q, weight, cos, sin -> dq, dweight"),
    "swiglu": ("fwd: proj [S,2F] -> y [S,F]", "bwd: dy, proj -> dproj"),
    "adaln_table": ("fwd: temb, weight, bias -> table", "bwd: dtable, temb, weight -> dweight, dbias, dtemb"),
}


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------------------------ 1. copy


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, Any]:
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)  # random, not zeros (METHOD.md)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=10)
    ok = bool(torch.equal(dst, src))
    src = dst = None  # noqa: F841 (drop the 8 GiB before the next section)
    free(device)
    return {"bytes_per_tensor": nbytes, "ms": ms, "GBps": 2 * nbytes / ms / 1e6, "verified": ok}


# ------------------------------------------------------------------------------------------------ 2. kernels


@dataclass
class Case:
    """One op: candidate and baseline callables on their own inputs, the differentiable inputs, the byte counts."""

    name: str
    cand: Callable[[], torch.Tensor]
    base: Callable[[], torch.Tensor]
    cand_grads: tuple[torch.Tensor, ...]
    base_grads: tuple[torch.Tensor, ...]
    fwd_bytes: int
    bwd_bytes: int


def _leaf(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).clone().requires_grad_(True)


def kernel_cases(preset: str, S: int, device: torch.device) -> list[Callable[[], Case]]:
    """Builders (lazy, so one case's tensors live at a time) for the six ops at the preset's widths."""
    from h3kernels import reference as R
    from h3kernels.modulation import MODALITY_NUM, adaln_table
    from h3kernels.norm import rms_norm, rms_norm_modulate
    from h3kernels.qk_norm_rope import qk_norm_rope
    from h3kernels.residual import gated_residual
    from h3kernels.swiglu import swiglu

    cfg = block_bench.block_config(preset)
    H, NH, D, F, E = (cfg[k] for k in ("hidden_size", "num_attention_heads", "attention_head_dim", "ffn_dim",
                                       "time_embed_dim"))
    idx_cpu, cos_cpu, sin_cpu, T = block_bench.layout(preset, S)
    bf16, f32, eps = torch.bfloat16, torch.float32, 1e-5
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = bf16, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device, dtype=f32) * std).to(dtype)

    idx = idx_cpu.to(device)

    def table() -> torch.Tensor:
        return randn(T * MODALITY_NUM, 6 * H, dtype=f32, std=0.1)  # modulation values of AdaLN size

    def norm_modulate() -> Case:
        x, w, tab = randn(S, H), 1 + randn(H, std=0.02), table()
        xc, wc, tc = _leaf(x), _leaf(w), _leaf(tab)
        xb, wb, tb = _leaf(x), _leaf(w), _leaf(tab, bf16)  # diffusers' table is bf16 (the projection dtype)
        return Case("rms_norm_modulate", lambda: rms_norm_modulate(xc, wc, tc, idx, 0, 1, eps),
                    lambda: R.rms_norm_modulate(xb, wb, tb, idx, 0, 1, eps), (xc, wc, tc), (xb, wb, tb),
                    _nbytes(x, w, tab, idx, x), _nbytes(x, x, w, tab, idx, x, w, tab))

    def gated() -> Case:
        x, b, tab = randn(S, H), randn(S, H), table()
        xc, bc, tc = _leaf(x), _leaf(b), _leaf(tab)
        xb, bb, tb = _leaf(x), _leaf(b), _leaf(tab, bf16)
        return Case("gated_residual", lambda: gated_residual(xc, bc, tc, idx, 2),
                    lambda: R.gated_residual(xb, bb, tb, idx, 2), (xc, bc, tc), (xb, bb, tb),
                    _nbytes(x, b, tab, idx, x), _nbytes(x, b, tab, idx, b, tab))

    def norm() -> Case:
        x, w = randn(S, H), 1 + randn(H, std=0.02)
        xc, wc, xb, wb = _leaf(x), _leaf(w), _leaf(x), _leaf(w)
        return Case("rms_norm", lambda: rms_norm(xc, wc, eps), lambda: R.rms_norm(xb, wb, eps), (xc, wc), (xb, wb),
                    _nbytes(x, w, x), _nbytes(x, x, w, x, w))

    def qk() -> Case:
        q, w = randn(S, NH, D), 1 + randn(D, std=0.02)
        cos, sin = cos_cpu.to(device), sin_cpu.to(device)  # fp32, as the model's rope buffer gives them
        qc, wc, qb, wb = _leaf(q), _leaf(w), _leaf(q), _leaf(w)
        return Case("qk_norm_rope", lambda: qk_norm_rope(qc, wc, cos, sin, eps),
                    lambda: R.qk_norm_rope(qb, wb, cos, sin, eps), (qc, wc), (qb, wb),
                    _nbytes(q, w, cos, sin, q), _nbytes(q, q, w, cos, sin, q, w))

    def swi() -> Case:
        p = randn(S, 2 * F)
        pc, pb = _leaf(p), _leaf(p)
        y_bytes = S * F * p.element_size()
        return Case("swiglu", lambda: swiglu(pc), lambda: R.swiglu(pb), (pc,), (pb,),
                    _nbytes(p) + y_bytes, y_bytes + 2 * _nbytes(p))

    def adaln() -> Case:
        C = 6 * H * MODALITY_NUM
        temb, w, b = randn(T, E, dtype=f32), randn(C, E, std=0.02), randn(C, std=0.02)
        tc, wc, bc = _leaf(temb), _leaf(w), _leaf(b)
        tb, wb, bb = _leaf(temb), _leaf(w), _leaf(b)
        out_bytes = T * C * 4
        return Case("adaln_table", lambda: adaln_table(tc, wc, bc), lambda: R.adaln_table(tb, wb, bb),
                    (tc, wc, bc), (tb, wb, bb), _nbytes(temb, w, b) + out_bytes,
                    out_bytes + _nbytes(temb, w) + _nbytes(w, b, temb))

    return [norm_modulate, gated, norm, qk, swi, adaln]


def _fwd_bwd(fn: Callable[[], torch.Tensor], grads: tuple[torch.Tensor, ...], device: torch.device,
             flush: torch.Tensor | None, warmup: int, iters: int) -> tuple[float, float]:
    fwd_ms = time_ms(fn, device, warmup, iters, flush)
    out = fn()
    dout = torch.randn(out.shape, device=device, dtype=torch.float32).to(out.dtype)
    bwd_ms = time_ms(lambda: torch.autograd.grad(out, grads, dout, retain_graph=True), device, warmup, iters, flush)
    return fwd_ms, bwd_ms


def _check_close(case: Case, device: torch.device) -> float:
    """Largest relative L2 of the candidate's output and gradients vs the bf16 baseline (a sanity check only)."""
    out_c, out_b = case.cand(), case.base()
    dout = torch.randn(out_c.shape, device=device, dtype=torch.float32)
    gc_ = torch.autograd.grad(out_c, case.cand_grads, dout.to(out_c.dtype))
    gb_ = torch.autograd.grad(out_b, case.base_grads, dout.to(out_b.dtype))
    pairs = [(out_c, out_b), *zip(gc_, gb_, strict=True)]
    return max(block_bench.rel_l2(a.float(), b.float()) for a, b in pairs)


def run_kernels(preset: str, S: int, device: torch.device, copy_GBps: float, warmup: int, iters: int,
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    flush = torch.empty(FLUSH_BYTES // 4, device=device, dtype=torch.float32) if device.type == "cuda" else None
    results = []
    for build in kernel_cases(preset, S, device):
        name = build.__name__
        try:
            case = build()
            name = case.name
            diff = _check_close(case, device)
            rec: dict[str, Any] = {"op": name, "S": S, "max_rel_l2_vs_bf16_baseline": diff,
                                   "bytes_counted": BYTES[name]}
            for label, fn, grads in (("candidate", case.cand, case.cand_grads), ("baseline", case.base,
                                                                                 case.base_grads)):
                fwd_ms, bwd_ms = _fwd_bwd(fn, grads, device, flush, warmup, iters)
                rec[label] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                              "fwd_GBps": case.fwd_bytes / fwd_ms / 1e6, "bwd_GBps": case.bwd_bytes / bwd_ms / 1e6}
            rec["fwd_bytes"], rec["bwd_bytes"] = case.fwd_bytes, case.bwd_bytes
            for d in ("fwd", "bwd"):
                rec[f"{d}_pct_copy"] = rec["candidate"][f"{d}_GBps"] / copy_GBps
                rec[f"{d}_speedup"] = rec["baseline"][f"{d}_ms"] / rec["candidate"][f"{d}_ms"]
            log(f"kernel {name}: fwd {rec['candidate']['fwd_ms']:.3f} ms ({rec['fwd_pct_copy']:.0%} of copy), "
                f"bwd {rec['candidate']['bwd_ms']:.3f} ms ({rec['bwd_pct_copy']:.0%}); rel-L2 vs bf16 torch {diff:.1e}")
            del case
        except Exception as err:  # noqa: BLE001 (one op failing must not lose the others)
            traceback.print_exc()
            rec = {"op": name, "S": S, "error": f"{type(err).__name__}: {err}"}
            log(f"kernel {name}: FAILED {rec['error']}")
        results.append(rec)
        free(device)
    del flush
    free(device)
    return results


def kernel_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in results:
        if "error" in r:
            out.append(["kernels", r["op"], "-", "FAILED", r["error"][:80], ""])
            continue
        for d in ("fwd", "bwd"):
            c, b = r["candidate"], r["baseline"]
            pct = r[f"{d}_pct_copy"]
            out.append(["kernels", f"{r['op']} S={r['S']}", d,
                        f"{c[f'{d}_ms']:.3f} ms {c[f'{d}_GBps']:.0f} GB/s {pct:.0%}",
                        f"torch {b[f'{d}_ms']:.3f} ms {b[f'{d}_GBps']:.0f} GB/s",
                        f"speedup {r[f'{d}_speedup']:.2f}x; {'ok' if pct >= BANDWIDTH_TARGET else 'under'} "
                        f"(target {BANDWIDTH_TARGET:.0%} of copy)"])
    return out


# ------------------------------------------------------------------------------------------------ 3. attention


def run_attention(seqlens: tuple[int, ...], heads: int, head_dim: int, device: torch.device, warmup: int, iters: int,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    from torch.nn.attention import SDPBackend

    from bench import attention as attention_bench
    from h3kernels import attention as A

    # bench/attention.py's CUDA-event timer on the GPU (its own warmup/median discipline); the host clock in smoke.
    def timer(fn: Callable[[], object], w: int, i: int) -> float:
        return attention_bench._time_ms(fn, w, i) if device.type == "cuda" else time_ms(fn, device, w, i)

    def measure(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                do: torch.Tensor) -> tuple[float, float, list[torch.Tensor]]:
        # As bench/attention.py's _measure (whose return shape is still changing): forward, then the backward of a
        # retained graph, then the outputs for the cross-check.
        fwd_ms = timer(lambda: fn(q, k, v), warmup, iters)
        o = fn(q, k, v)
        bwd_ms = timer(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup, iters)
        return fwd_ms, bwd_ms, [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]

    providers = {
        "h3kernels": lambda q, k, v: A.attention(q, k, v),
        "sdpa-flash": attention_bench._sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": attention_bench._sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    results = []
    for S in seqlens:
        g = torch.Generator(device=device).manual_seed(0)
        shape = (1, S, heads, head_dim)
        q, k, v = (torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        do = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        fwd_flop = 4.0 * heads * S * S * head_dim
        rec: dict[str, Any] = {"S": S, "heads": heads, "head_dim": head_dim}
        ref = None
        for name, fn in providers.items():
            try:
                fwd_ms, bwd_ms, res = measure(fn, q, k, v, do)
                rec[name] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_TFLOPs": fwd_flop / fwd_ms / 1e9,
                             "bwd_TFLOPs": 2.5 * fwd_flop / bwd_ms / 1e9}
                if name == "h3kernels":
                    ref = res
                else:
                    rec[name]["max_abs_diff_vs_h3kernels"] = (
                        max(float((a.float() - b.float()).abs().max()) for a, b in zip(res, ref, strict=True))
                        if ref is not None else None)
                del res
            except RuntimeError as err:  # a backend this torch build or device lacks (cuDNN on the CPU)
                rec[name] = {"error": str(err).splitlines()[0][:100]}
            sync(device)
        if "fwd_ms" in rec["h3kernels"]:
            h = rec["h3kernels"]
            log(f"attention S={S}: h3kernels fwd {h['fwd_TFLOPs']:.0f} / bwd {h['bwd_TFLOPs']:.0f} TFLOP/s")
        results.append(rec)
        del q, k, v, do, ref
        free(device)
    return results


def attention_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in results:
        h = r["h3kernels"]
        for d in ("fwd", "bwd"):
            def cell(p: dict[str, Any], d: str = d) -> str:
                if "error" in p:
                    return "n/a: " + p["error"][:24]
                return f"{p[f'{d}_ms']:.2f} ms {p[f'{d}_TFLOPs']:.0f} TFLOP/s"

            base = f"flash {cell(r['sdpa-flash'])}; cudnn {cell(r['sdpa-cudnn'])}"
            if "error" in h:
                out.append(["attention", f"S={r['S']}", d, f"FAILED {h['error'][:40]}", base, ""])
                continue
            ratios = [f"{h[f'{d}_TFLOPs'] / r[p][f'{d}_TFLOPs']:.2f}x {p[5:]}"
                      for p in ("sdpa-flash", "sdpa-cudnn") if "error" not in r[p]]
            out.append(["attention", f"S={r['S']} {r['heads']}x{r['head_dim']}", d, cell(h), base,
                        "rate " + ", ".join(ratios)])
    return out


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes (every path)")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-block", action="store_true")
    parser.add_argument("--seqlen", type=int, default=None, help="kernel S (default 16384; smoke 96)")
    parser.add_argument("--attention-seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--block-seqlens", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    smoke = args.smoke
    device = block_bench.bench_device(smoke, "bench/kernel_suite.py")
    if device is None:
        return 0
    preset = "tiny" if smoke else "block"
    warmup, iters, kiters = (1, 2, 2) if smoke else (block_bench.WARMUP, block_bench.ITERS, KERNEL_ITERS)
    kwarmup = 1 if smoke else KERNEL_WARMUP

    def log(line: str) -> None:
        print(line, flush=True)

    t_start = time.perf_counter()
    info = block_bench.machine()
    log(block_bench.machine_line(info, "SMOKE (CPU interpreter, tiny shapes: numbers mean nothing)" if smoke else ""))
    doc: dict[str, Any] = {"machine": info, "smoke": smoke}
    rows: list[list[str]] = []
    failed = False

    def section(name: str, fn: Callable[[], None]) -> None:
        nonlocal failed
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (a failed section must not lose the others)
            traceback.print_exc()
            failed = True
            doc[f"{name}_error"] = f"{type(err).__name__}: {err}"
            rows.append([name, "-", "-", "FAILED", doc[f"{name}_error"][:80], ""])
        doc.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        log(f"[{name}: {time.perf_counter() - t0:.1f} s]")
        free(device)

    copy_GBps = 4000.0  # ENVIRONMENT.md's H200 figure, used only if the copy section is skipped or fails

    def do_copy() -> None:
        nonlocal copy_GBps
        doc["copy"] = copy_bandwidth(device, COPY_BYTES_SMOKE if smoke else COPY_BYTES)
        copy_GBps = doc["copy"]["GBps"]
        c = doc["copy"]
        rows.append(["copy", f"y.copy_(x) {c['bytes_per_tensor'] / 2**30:.3g} GiB bf16", "-",
                     f"{c['ms']:.3f} ms {c['GBps']:.0f} GB/s", "", f"the ceiling (read+write); equal: {c['verified']}"])
        log(f"copy: {c['GBps']:.0f} GB/s")

    def do_kernels() -> None:
        S = args.seqlen or (96 if smoke else 16384)
        doc["kernels"] = run_kernels(preset, S, device, copy_GBps, kwarmup, kiters, log)
        doc["copy_GBps_used"] = copy_GBps
        rows.extend(kernel_rows(doc["kernels"]))
        if any("error" in r for r in doc["kernels"]):
            raise RuntimeError("a kernel case failed (see its row)")

    def do_attention() -> None:
        cfg = block_bench.block_config(preset)
        seqlens = tuple(args.attention_seqlens or ((64,) if smoke else ATTENTION_SEQLENS))
        heads, head_dim = (2, 32) if smoke else (cfg["num_attention_heads"], cfg["attention_head_dim"])
        doc["attention"] = run_attention(seqlens, heads, head_dim, device, warmup, iters, log)
        rows.extend(attention_rows(doc["attention"]))

    def do_block() -> None:
        seqlens = args.block_seqlens or ([96] if smoke else list(BLOCK_SEQLENS))
        doc["block"] = block_bench.run(preset, seqlens, device, warmup=warmup, iters=iters, log=log)
        rows.extend(block_bench.rows(doc["block"]))
        if any("error" in e for e in doc["block"]["per_seqlen"].values()):
            raise RuntimeError("a block run failed (see its rows)")

    for name, fn, skip in (("copy", do_copy, args.skip_copy), ("kernels", do_kernels, args.skip_kernels),
                           ("attention", do_attention, args.skip_attention), ("block", do_block, args.skip_block)):
        if not skip:
            section(name, fn)
    doc["total_seconds"] = time.perf_counter() - t_start
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    log("\n" + block_bench.machine_line(info, f"total {doc['total_seconds']:.0f} s", "SMOKE" if smoke else ""))
    print(table(rows, HEADER))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
