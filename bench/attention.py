"""Benchmark h3kernels.attention against torch SDPA (flash and cuDNN backends), forward and backward, bf16.

    python bench/attention.py                               # S = 4096, 16384, 32768; 56 heads x 128; B = 1
    python bench/attention.py --seqlens 16384 --config "fwd_n=128" --config "fwd_warps=4,fwd_stages=2"
    python bench/attention.py --sweep bench/attention_sweep.txt          # tuning sweep on the H200, ~2-4 min
    python bench/attention.py --compile-only --sweep bench/attention_sweep.txt   # no GPU: sm_90 regs/spills/smem

Each --config (or non-comment line of a --sweep file) is a set of AttnConfig field overrides over the table entry
(see h3kernels/attention.py) and gets its own row; without either the table entry (plus $H3KERNELS_ATTN_CONFIG) runs.
Layout [B, S, NH, D] as diffusers passes it; SDPA gets the same tensors as [B, NH, S, D] transposed views, as
diffusers' native backend does.

FLOPs (non-causal): forward 4 * B * NH * S^2 * D (QK^T and PV); backward 2.5x forward (five S x S x D matmuls, the
FlashAttention-2 convention). Times are medians of per-iteration torch.cuda.Event pairs after warmup; the backward is
torch.autograd.grad over a retained graph, so it excludes the forward. max|diff| is the largest difference from the
flash backend's o / dq / dk / dv (a tuning that breaks results shows there); det says whether two backward runs gave
byte-identical dq/dk/dv.

--sweep compiles every config first in parallel worker processes (one small run each fills Triton's on-disk cache;
a config that fails to compile or launch is skipped with its error), times each at --sweep-seqlen (16384) only, also
times the fastest forward, dK/dV and dQ settings of any rows combined, prints the rows sorted by backward TFLOP/s,
then the fastest forward and the BEST (least forward + backward time), times the best at 4096 and 32768 and prints
it as an AttnConfig literal for h3kernels/attention.py's CONFIGS table. --budget-s stops timing further configs in time.

--compile-only needs no GPU: it compiles each config's kernels for sm_90 (triton's bundled ptxas) with the
specialisation real H3 launches get (16-byte aligned pointers and strides; S a multiple of 16 when no tail tile) and
prints registers, spill bytes (stack), shared memory and CTAs per SM for each kernel. --json prints it as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere in the checkout

SM90_REGS, SM90_SMEM = 65536, 228 * 1024  # per multiprocessor (H100/H200); a block may take 227 KiB of the 228


def _time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _sdpa(backend: object) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import sdpa_kernel

    def run(q_BSND: torch.Tensor, k_BSND: torch.Tensor, v_BSND: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            o_BNSD = torch.nn.functional.scaled_dot_product_attention(
                q_BSND.transpose(1, 2), k_BSND.transpose(1, 2), v_BSND.transpose(1, 2))
        return o_BNSD.transpose(1, 2)

    return run


class _KernelClock:
    """Brackets every launch of h3kernels.attention's dK/dV and dQ kernels with CUDA events while active, so one
    backward timing also gives each kernel's time (the launchers look the kernels up as module globals). With
    dq_fused the dQ column times the fixed-point finish kernel instead (dQ's matmul is inside dK/dV then)."""

    NAMES = ("_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dq_finish_kernel")

    def __init__(self) -> None:
        from h3kernels import attention as A

        self.mod, self.log = A, {n: [] for n in self.NAMES}
        self.kernels = {n: getattr(A, n) for n in self.NAMES}

    def _wrap(self, name: str) -> object:
        clock = self

        class Launch:
            def __getitem__(self, grid: object) -> Callable[..., None]:
                def run(*args: object, **kwargs: object) -> None:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    clock.kernels[name][grid](*args, **kwargs)
                    end.record()
                    clock.log[name].append((start, end))
                return run

        return Launch()

    def __enter__(self) -> _KernelClock:
        for name in self.NAMES:
            setattr(self.mod, name, self._wrap(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, kernel in self.kernels.items():
            setattr(self.mod, name, kernel)

    def medians(self, last: int) -> tuple[float, float]:
        """(dK/dV ms, dQ or finish ms): medians over the last `last` launches of each."""
        torch.cuda.synchronize()
        ms = {n: statistics.median(s.elapsed_time(e) for s, e in log[-last:]) for n, log in self.log.items() if log}
        return ms[self.NAMES[0]], ms.get(self.NAMES[1], ms.get(self.NAMES[2], float("nan")))


def _measure(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
             warmup: int, iters: int, per_kernel: bool) -> tuple[float, float, tuple, list[torch.Tensor], bool]:
    fwd_ms = _time_ms(lambda: fn(q, k, v), warmup, iters)
    o = fn(q, k, v)
    split: tuple = ()
    with _KernelClock() if per_kernel else contextlib.nullcontext() as clock:
        bwd_ms = _time_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup, iters)
        split = clock.medians(iters) if per_kernel else ()
    grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    again = torch.autograd.grad(o, (q, k, v), do)
    det = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(grads, again, strict=True))
    return fwd_ms, bwd_ms, split, [o.detach(), *grads], det


def _inputs(S: int, args: argparse.Namespace, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, S, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    return [q, k, v, torch.randn(shape, generator=g, device="cuda", dtype=dtype)]


@dataclasses.dataclass
class Row:
    bwd_tf: float  # -1 when the provider failed
    text: str
    ok: bool = False  # ran, and two backward runs were byte-identical
    split: tuple = ()  # (dK/dV kernel ms, dQ kernel ms) for h3kernels rows
    fwd_ms: float = float("inf")
    bwd_ms: float = float("inf")


def _row(S: int, args: argparse.Namespace, fn: Callable[..., torch.Tensor], tensors: list[torch.Tensor],
         ref: list[torch.Tensor] | None, warmup: int, iters: int,
         per_kernel: bool = False) -> tuple[Row, list[torch.Tensor] | None]:
    """One provider at one S, and its results (None when it failed: the row's text says why)."""
    fwd_flop = 4.0 * args.batch * args.heads * S * S * args.head_dim
    try:
        fwd_ms, bwd_ms, split, res, det = _measure(fn, *tensors, warmup, iters, per_kernel)
    except Exception as err:  # noqa: BLE001 - a backend this build lacks, or a config that cannot launch
        return Row(-1.0, f"n/a: {type(err).__name__}: {' '.join(str(err).split())[:100]}"), None
    diff = " ".join(f"{float((a.float() - b.float()).abs().max()):.1e}" for a, b in zip(res, ref or res, strict=True))
    bwd_tf = 2.5 * fwd_flop / bwd_ms / 1e9
    kernels = "  ".join(f"{ms:7.3f}" for ms in split) if split else f"{'-':>7}  {'-':>7}"
    text = (f"{fwd_ms:8.3f}  {fwd_flop / fwd_ms / 1e9:11.1f}  {bwd_ms:8.3f}  {bwd_tf:11.1f}  {kernels}  "
            f"{'yes' if det else 'NO':>4}  {diff if ref is not None else 'n/a'}")
    return Row(bwd_tf, text, det, split, fwd_ms, bwd_ms), res


_HEADER = (f"{'fwd ms':>8}  {'fwd TFLOP/s':>11}  {'bwd ms':>8}  {'bwd TFLOP/s':>11}  {'dkdv ms':>7}  {'dq ms':>7}  "
           f"{'det':>4}  max|diff| vs flash")


def _table(args: argparse.Namespace, seqlens: list[int], providers: dict[str, Callable[..., torch.Tensor]],
           warmup: int, iters: int) -> None:
    """The plain benchmark: every provider at every S, in the order given, flash measured first (the reference)."""
    width = max(len(n) for n in providers)
    print(f"{'S':>6}  {'provider':<{width}}  {_HEADER} (o dq dk dv)")
    for S in seqlens:
        tensors, rows, ref = _inputs(S, args, torch.bfloat16), {}, None
        for name in sorted(providers, key=lambda n: n != "sdpa-flash"):  # flash first: it is the diff reference
            rows[name], res = _row(S, args, providers[name], tensors, ref, warmup, iters, name.startswith("h3"))
            ref = res if name == "sdpa-flash" else ref
            del res
        for name in providers:
            print(f"{S:>6}  {name:<{width}}  {rows[name].text}", flush=True)
        del tensors, ref
        torch.cuda.empty_cache()


def _warm(spec: str, heads: int, head_dim: int, S: int) -> str:
    """Worker: one forward + backward with `spec` at sequence length S, filling Triton's on-disk cache. Returns ''
    or the error."""
    try:
        from h3kernels import attention as A

        cfg = A.resolve_config(head_dim, torch.bfloat16, spec)
        q, k, v = (torch.randn(1, S, heads, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        A.attention(q, k, v, config=cfg).backward(torch.randn_like(q))
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # noqa: BLE001 - reported per config
        return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _sweep_specs(path: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return [line.replace(" ", "") for line in lines if line]


def _sweep(args: argparse.Namespace, specs: list[str]) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from h3kernels import attention as A

    t0, D, dtype = time.monotonic(), args.head_dim, torch.bfloat16
    configs: dict[str, object] = {}
    for spec in dict.fromkeys(specs):
        try:
            configs[spec] = A.resolve_config(D, dtype, spec)
        except ValueError as err:
            print(f"skip [{spec}]: {err}")
    workers = max(1, min(len(configs), os.cpu_count() or 1, 16))
    # S=2048 compiles exactly what any multiple of 2048 runs: no tail tile in any kernel, S and strides multiples of 16.
    S = args.sweep_seqlen
    n, warm_s = len(configs), 2048 if S % 2048 == 0 else S
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            errors = dict(zip(configs, pool.map(_warm, configs, [args.heads] * n, [D] * n, [warm_s] * n),
                              strict=True))
    except Exception as err:  # noqa: BLE001 - e.g. a worker killed mid-compile: compile on first use instead
        print(f"parallel precompile failed ({type(err).__name__}: {err}); configs compile when first timed")
        errors = dict.fromkeys(configs, "")
    for spec, err in errors.items():
        if err:
            print(f"skip [{spec}]: {err}")
            del configs[spec]
    print(f"compiled {len(configs)} configs with {workers} workers in {time.monotonic() - t0:.0f} s", flush=True)

    rows = {}
    tensors = _inputs(S, args, dtype)
    flash, ref = _row(S, args, _sdpa_backend("FLASH_ATTENTION"), tensors, None, args.warmup, args.iters)
    cudnn, _ = _row(S, args, _sdpa_backend("CUDNN_ATTENTION"), tensors, ref, args.warmup, args.iters)

    def run(spec: str, cfg: object) -> None:
        if time.monotonic() - t0 > args.budget_s:
            print(f"skip [{spec}]: time budget of {args.budget_s:.0f} s spent")
            return
        fn = lambda q, k, v: A.attention(q, k, v, config=cfg)  # noqa: E731
        rows[spec], _ = _row(S, args, fn, tensors, ref, args.warmup, args.iters, per_kernel=True)
        print(f"  {rows[spec].bwd_tf:6.1f} TFLOP/s bwd  [{spec}]", flush=True)

    for spec, cfg in configs.items():
        run(spec, cfg)
    # The forward, dK/dV and dQ kernels are separate launches on independent tiles, so the fastest settings of each
    # (taken from any rows) compose; time that combination too when no line had it.
    # A fused-dQ row's dK/dV kernel also does dQ's matmul and its dQ column is the finish kernel, so the combination
    # is of separate-dQ rows only (fused rows compete whole, in BEST below).
    timed = {s: r for s, r in rows.items() if r.ok}
    separate_dq = [s for s in timed if not configs[s].dq_fused]
    if timed and separate_dq:
        fastest_of = {"fwd_": configs[min(timed, key=lambda s: timed[s].fwd_ms)],
                "dq_": configs[min(separate_dq, key=lambda s: timed[s].split[1])]}
        combo = configs[min(separate_dq, key=lambda s: timed[s].split[0])]  # the dK/dV fields (dq_fused=0)
        for prefix, cfg in fastest_of.items():
            combo = dataclasses.replace(combo, **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__
                                                  if f.startswith(prefix)})
        if combo not in configs.values():
            base = A.CONFIGS[(D, dtype)]
            spec = ",".join(f"{f}={getattr(combo, f)}" for f in combo.__dataclass_fields__
                            if getattr(combo, f) != getattr(base, f)) or "table"
            configs[spec] = combo
            run(spec, combo)
    tensors.clear()
    ref = None
    torch.cuda.empty_cache()
    width = max([len(s) for s in rows] + [10])
    print(f"\nS={S}, sorted by bwd TFLOP/s (best last); each config overrides {A.CONFIGS[(D, dtype)]}")
    print(f"{'config':<{width}}  {_HEADER}")
    print(f"{'sdpa-flash':<{width}}  {flash.text}\n{'sdpa-cudnn':<{width}}  {cudnn.text}")
    for spec in sorted(rows, key=lambda s: rows[s].bwd_tf):
        print(f"{spec:<{width}}  {rows[spec].text}")
    good = [s for s, r in rows.items() if r.ok]
    if not good:
        print("no config ran deterministically")
        return
    best = min(good, key=lambda s: rows[s].fwd_ms + rows[s].bwd_ms)  # what a training step pays
    fastest = min(good, key=lambda s: rows[s].fwd_ms)
    print(f"\nFASTEST FORWARD [{fastest}]: {rows[fastest].fwd_ms:.3f} ms at S={S} (sdpa-cudnn {cudnn.fwd_ms:.3f})")
    winner = configs[best]
    print(f"BEST [{best}]: fwd+bwd {rows[best].fwd_ms + rows[best].bwd_ms:.3f} ms, bwd {rows[best].bwd_tf:.1f} "
          f"TFLOP/s at S={S} (sdpa-cudnn {cudnn.fwd_ms + cudnn.bwd_ms:.3f} ms, {cudnn.bwd_tf:.1f})")
    fields = ", ".join(str(getattr(winner, f)) for f in winner.__dataclass_fields__)
    print(f"CONFIGS line for h3kernels/attention.py: ({D}, torch.bfloat16): AttnConfig({fields}),", flush=True)
    _table(args, [s for s in args.winner_seqlens if s != S],
           {f"h3kernels[{best}]": lambda q, k, v: A.attention(q, k, v, config=winner),
            "sdpa-flash": _sdpa_backend("FLASH_ATTENTION"), "sdpa-cudnn": _sdpa_backend("CUDNN_ATTENTION")},
           args.warmup, args.iters)
    print(f"sweep done in {time.monotonic() - t0:.0f} s")


def _sdpa_backend(name: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend

    return _sdpa(getattr(SDPBackend, name))


# ---------------------------------------------------------------------------------------------------------------------
# --compile-only: sm_90 compiles without a GPU (triton ships ptxas and cuobjdump).
# ---------------------------------------------------------------------------------------------------------------------
def _compile_one(fn: object, const: dict[str, object], warps: int, stages: int, wd: str, s_div16: bool,
                 out_dir: str, desc_rows: dict[str, int] | None = None) -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tensors = ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ")
    sig = {a: "constexpr" if a in const else "*fp32" if a in ("LSE", "DELTA", "VK", "BOUND") else "*i32"
           if a == "DQACC" else "*" + wd if a in tensors else "fp32" if "scale" in a or a == "fix_one" else "i32"
           for a in fn.arg_names}
    for a, rows in (desc_rows or {}).items():  # tma=1: these operands are [B, S, NH, D] tensor descriptors
        if a in sig:
            sig[a] = f"tensordesc<{wd}[1,{rows},1,{const['D']}]>"
    # What the JIT launcher specialises for H3 tensors: 16-byte aligned pointers and strides (NH*D, D multiples of
    # 16), S when it is a multiple of 16; NH=56 is not. Without these hints the loads are not pipelined (no cp.async).
    aligned = [i for i, a in enumerate(fn.arg_names) if a not in const and (sig[a].startswith("*") or (
        re.fullmatch(r"s[a-z]+_[bsh]", a) is not None) or (a == "S" and s_div16))]
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const,
                                     attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as e:  # noqa: BLE001 - reported per kernel
        return {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
    path = os.path.join(out_dir, f"k{len(os.listdir(out_dir))}.cubin")
    Path(path).write_bytes(k.asm["cubin"])
    objdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([objdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    if not m:
        return {"error": "no resource usage: " + usage[:500]}
    regs, smem = int(m.group(1)), k.metadata.shared
    ctas = min(SM90_REGS // (-(-regs // 8) * 8 * 32 * warps), SM90_SMEM // (smem + 1024), 64 // warps)
    return {"regs": regs, "stack": int(m.group(2)), "smem": smem, "ctas_per_sm": ctas}


def compile_report(cfg: object, D: int, dtype: torch.dtype, tails: tuple[bool, ...] = (True, False)) -> dict:
    """{kernel name: {regs, stack, smem, ctas_per_sm} or {error}} for every kernel `cfg` launches at head dim D."""
    from h3kernels import attention as A

    wd = "bf16" if dtype == torch.bfloat16 else "fp32"
    flags = dict(D=D, UPCAST=False, PREC="ieee" if wd == "fp32" else "tf32")

    def rows(tma: int, q: int, kv: int) -> dict[str, int] | None:  # *_tma=1: the streamed operands' descriptor rows
        return (dict(K=kv, V=kv) if kv else dict(Q=q, DO=q)) if tma else None

    fused = bool(cfg.dq_fused)
    jobs = [("delta", A._attn_bwd_delta_kernel, dict(D=D, BLOCK_M=A._DELTA_M, FUSED_DQ=fused), 4, 1, True, None)]
    if fused:
        jobs.append(("dq finish", A._attn_bwd_dq_finish_kernel, dict(D=D, BLOCK_M=A._DELTA_M), 4, 1, True, None))
    for tail in tails:
        jobs += [(f"fwd tail={tail}", A._attn_fwd_kernel, dict(flags, TAIL=tail, BLOCK_M=cfg.fwd_m,
                  BLOCK_N=cfg.fwd_n, TMA=bool(cfg.fwd_tma)), cfg.fwd_warps, cfg.fwd_stages, not tail,
                  rows(cfg.fwd_tma, 0, cfg.fwd_n)),
                 (f"dkdv tail={tail}", A._attn_bwd_dkdv_kernel, dict(flags, TAIL=tail, TAIL_N=tail, BLOCK_M=cfg.dkdv_m,
                  BLOCK_N=cfg.dkdv_n, DP_FIRST=bool(cfg.dkdv_dp_first), TMA=bool(cfg.dkdv_tma), FUSED_DQ=fused),
                  cfg.dkdv_warps, cfg.dkdv_stages, not tail, rows(cfg.dkdv_tma, cfg.dkdv_m, 0))]
        if not fused:  # fused: dQ comes out of the dK/dV kernel and the finish
            jobs.append((f"dq tail={tail}", A._attn_bwd_dq_kernel, dict(flags, TAIL=tail, BLOCK_M=cfg.dq_m,
                         BLOCK_N=cfg.dq_n, DP_FIRST=bool(cfg.dq_dp_first), TMA=bool(cfg.dq_tma)), cfg.dq_warps,
                         cfg.dq_stages, not tail, rows(cfg.dq_tma, 0, cfg.dq_n)))
    with tempfile.TemporaryDirectory() as out_dir:
        return {f"{name} D={D} {wd}": _compile_one(fn, const, warps, stages, wd, s16, out_dir, desc)
                for name, fn, const, warps, stages, s16, desc in jobs}


def _compile_only(args: argparse.Namespace, specs: list[str]) -> int:
    from h3kernels import attention as A
    from h3kernels._common import is_interpreting

    if is_interpreting():
        print("--compile-only needs TRITON_INTERPRET unset or 0 (interpreted kernels are never compiled)")
        return 2
    if args.table:
        jobs = [(f"table D={D} {str(dt).removeprefix('torch.')}", cfg, D, dt, (True, False))
                for (D, dt), cfg in A.CONFIGS.items()]
    else:  # sweep candidates run at S = 4096..32768: no tail tile
        jobs = [(spec or "table", A.resolve_config(args.head_dim, torch.bfloat16, spec), args.head_dim,
                 torch.bfloat16, (False,)) for spec in specs or [""]]
    report = {}
    for label, cfg, D, dt, tails in jobs:
        rep = compile_report(cfg, D, dt, tails)
        report[label] = rep
        if not args.json:
            print(f"[{label}]")
            for name, r in rep.items():
                print(f"    {name:<24} " + (r["error"][:200] if "error" in r else
                      f"regs {r['regs']:3d}  stack {r['stack']:4d}  smem {r['smem'] // 1024:3d} KiB  "
                      f"ctas/SM {r['ctas_per_sm']}" + ("   <-- SPILLS" if r["stack"] else "")), flush=True)
    if args.json:
        print(json.dumps(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (3 with --sweep)")
    parser.add_argument("--iters", type=int, default=None, help="default 20 (10 with --sweep)")
    parser.add_argument("--config", action="append", default=None, help="AttnConfig overrides, e.g. fwd_m=64,fwd_n=64")
    parser.add_argument("--sweep", default=None, help="file of config override lines ('#' comments)")
    parser.add_argument("--sweep-seqlen", type=int, default=16384)
    parser.add_argument("--winner-seqlens", type=int, nargs="*", default=[4096, 32768])
    parser.add_argument("--budget-s", type=float, default=210.0, help="--sweep: stop timing new configs after this")
    parser.add_argument("--compile-only", action="store_true", help="no GPU: sm_90 compile report per config")
    parser.add_argument("--table", action="store_true", help="--compile-only: every CONFIGS entry, tails too")
    parser.add_argument("--json", action="store_true", help="--compile-only: print the report as JSON")
    args = parser.parse_args(argv)
    specs = (args.config or []) + (_sweep_specs(args.sweep) if args.sweep else [])
    if args.compile_only:
        return _compile_only(args, specs)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA device and found none; nothing measured.")
        return 0
    args.warmup = args.warmup if args.warmup is not None else (3 if args.sweep else 5)
    args.iters = args.iters if args.iters is not None else (10 if args.sweep else 20)

    import triton

    from h3kernels import attention as A

    D = args.head_dim
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16 "
          f"B={args.batch} NH={args.heads} D={D} | warmup {args.warmup}, median of {args.iters}", flush=True)
    if args.sweep:
        _sweep(args, specs)
        return 0
    configs = {f"h3kernels[{spec}]": A.resolve_config(D, torch.bfloat16, spec) for spec in specs}
    configs = configs or {"h3kernels": A.resolve_config(D, torch.bfloat16)}
    for name, cfg in configs.items():
        print(f"{name}: {cfg}")
    providers: dict[str, Callable[..., torch.Tensor]] = {
        name: (lambda c: lambda q, k, v: A.attention(q, k, v, config=c))(cfg) for name, cfg in configs.items()}
    providers["sdpa-flash"] = _sdpa_backend("FLASH_ATTENTION")
    providers["sdpa-cudnn"] = _sdpa_backend("CUDNN_ATTENTION")
    _table(args, args.seqlens, providers, args.warmup, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
