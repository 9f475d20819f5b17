"""Benchmark the in-batch similarity/softmax loss: eager PyTorch vs the chunked torch path vs the CUDA kernel.

Impls: naive = what a user writes (`F.cross_entropy((q @ k.T).float() / T, labels)`, logits in the input
dtype, GPU only by default); eager = info_nce_rows' materialising path (fp32 logits); torch = the chunked
path; cuda = the extension. Ratios (t/base, mem/base) are against the first impl listed.

Times forward+backward of `info_nce_rows(q_ND, k_ND, arange(N))` (N x N logits, temperature 0.05) and
reports peak memory above the inputs:
  * CPU: every (impl, N, d) runs in a fresh subprocess; peak = ru_maxrss (the process's peak RSS,
    which includes torch's CPU allocations) minus the RSS measured just before the first call.
    The first (cold) call gives the peak; the time is the median of the following calls.
  * GPU: torch.cuda.max_memory_allocated() minus the memory allocated before the call; CUDA-event
    timing, median of `--reps` after a warm-up. TFLOP/s counts 6*N^2*d (fwd 2N^2d + bwd 4N^2d) and
    is compared with the measured rate of a large bf16 matmul.
Usage: python tools/bench_similarity.py [--device cpu|cuda] [--sizes 1024,4096,16384,65536] [--dims 256,768]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from pretrain.ops import cuda_available, info_nce_rows

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_EAGER_LIMIT_BYTES = 8 * 2**30
"""Eager keeps ~4 fp32 N x N buffers alive (logits, softmax, their gradients); skip above this."""
CPU_MAX_TFLOP = 3.0
"""Skip CPU configurations whose 8*N^2*d flops would take minutes on a few cores."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _inputs(n: int, d: int, dtype: torch.dtype, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    q = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=1).to(dtype).requires_grad_()
    k = F.normalize(torch.randn(n, d, device=device, generator=gen), dim=1).to(dtype).requires_grad_()
    return q, k, torch.arange(n, device=device)


def _step(q, k, pos, impl: str, chunk: int) -> None:
    q.grad = k.grad = None
    if impl == "naive":  # what a user writes: logits in the input dtype, upcast for the cross-entropy
        F.cross_entropy((q @ k.t()).float() * 20.0, pos, reduction="sum").backward()
        return
    info_nce_rows(q, k, pos, temperature=0.05, impl=impl, chunk_size=chunk).sum().backward()


def measure_cpu(impl: str, n: int, d: int, dtype: str, chunk: int, reps: int) -> dict:
    """One configuration, meant to run in its own process (peak RSS is per process)."""
    q, k, pos = _inputs(n, d, DTYPES[dtype], "cpu")
    base = _rss_bytes()
    t0 = time.perf_counter()
    _step(q, k, pos, impl, chunk)
    times = [time.perf_counter() - t0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        _step(q, k, pos, impl, chunk)
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times[1:] or times), "peak_bytes": peak}


def measure_cuda(impl: str, n: int, d: int, dtype: str, chunk: int, reps: int) -> dict:
    q, k, pos = _inputs(n, d, DTYPES[dtype], "cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        _step(q, k, pos, impl, chunk)
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(q, k, pos, impl, chunk)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return {"seconds": statistics.median(times), "peak_bytes": peak}


def matmul_rate(dtype: torch.dtype, size: int = 8192) -> float:
    """Measured FLOP/s of a size^3 matmul on the current GPU."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * size**3 / (time.perf_counter() - t0)


def _cpu_skip(impl: str, n: int, d: int) -> str | None:
    if impl in ("eager", "naive") and 4 * 4 * n * n > CPU_EAGER_LIMIT_BYTES:
        return f"eager needs ~{16 * n * n / 2**30:.0f} GiB"
    if 8 * n * n * d / 1e12 > CPU_MAX_TFLOP:
        return f"{8 * n * n * d / 1e12:.1f} TFLOP: minutes on CPU"
    return None


def _run_cpu_subprocess(impl: str, n: int, d: int, args) -> dict:
    cmd = [sys.executable, __file__, "--one", impl, str(n), str(d), "--dtype", args.dtype,
           "--chunk", str(args.chunk), "--reps", str(args.reps), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"skipped": f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="1024,4096,16384,65536")
    p.add_argument("--dims", default="256,768")
    p.add_argument("--impls", default=None, help="comma list; default eager,torch[,cuda]")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json-out", default="", help="also write every figure to this JSON file")
    p.add_argument("--one", nargs=3, metavar=("IMPL", "N", "D"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    torch.set_num_threads(args.threads)

    if args.one:
        impl, n, d = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(measure_cpu(impl, n, d, args.dtype, args.chunk, args.reps)))
        return

    impls = args.impls.split(",") if args.impls else (
        ["naive", "eager", "torch", "cuda"] if args.device == "cuda" else ["eager", "torch"])
    if "cuda" in impls and not cuda_available():
        print("note: CUDA extension not built; the cuda column is skipped")
        impls = [i for i in impls if i != "cuda"]
    peak_rate = matmul_rate(DTYPES[args.dtype]) if args.device == "cuda" else None
    print(f"device={args.device} dtype={args.dtype} chunk={args.chunk} threads={args.threads} "
          f"reps={args.reps}" + (f" matmul={peak_rate / 1e12:.0f} TFLOP/s" if peak_rate else ""))
    header = f"{'N':>6} {'d':>4} {'impl':>6} {'time_s':>9} {'peak_MiB':>9} {'t/base':>8} {'mem/base':>9} {'TFLOP/s':>8}  note"
    print(header)
    print("-" * len(header))
    records = []
    for n in map(int, args.sizes.split(",")):
        for d in map(int, args.dims.split(",")):
            eager = None
            for impl in impls:
                skip = _cpu_skip(impl, n, d) if args.device == "cpu" else None
                if skip:
                    res = {"skipped": skip}
                elif args.device == "cpu":
                    res = _run_cpu_subprocess(impl, n, d, args)
                else:
                    res = measure_cuda(impl, n, d, args.dtype, args.chunk, args.reps)
                records.append(dict(res, n=n, d=d, impl=impl))
                if "skipped" in res:
                    print(f"{n:>6} {d:>4} {impl:>6} {'-':>9} {'-':>9} {'-':>8} {'-':>9} {'-':>8}  skipped: {res['skipped']}")
                    continue
                if eager is None:  # the first impl listed is the baseline of the ratios
                    eager = res
                t, mem = res["seconds"], res["peak_bytes"]
                t_ratio = f"{t / eager['seconds']:.2f}" if eager else "-"
                m_ratio = f"{mem / eager['peak_bytes']:.3f}" if eager and eager["peak_bytes"] > 0 else "-"
                rate = 6 * n * n * d / t
                note = f"{100 * rate / peak_rate:.0f}% of matmul" if peak_rate else ""
                records[-1].update(tflops=rate / 1e12, frac_of_matmul=rate / peak_rate if peak_rate else None,
                                   time_vs_eager=t / eager["seconds"] if eager else None,
                                   mem_vs_eager=mem / eager["peak_bytes"] if eager and eager["peak_bytes"] > 0 else None)
                print(f"{n:>6} {d:>4} {impl:>6} {t:>9.3f} {mem / 2**20:>9.1f} {t_ratio:>8} {m_ratio:>9} "
                      f"{rate / 1e12:>8.3f}  {note}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           torch=torch.__version__, dtype=args.dtype, chunk=args.chunk, reps=args.reps,
                           matmul_tflops=peak_rate / 1e12 if peak_rate else None, rows=records), f, indent=1)


if __name__ == "__main__":
    main()
