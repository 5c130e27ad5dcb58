"""`python -m wattserve.bench.gpu_profile`: a torch.profiler trace of the engine's decode.

On the Llama-3.2-1B-shaped random model (bench gpu's), bs1 and batch-64 decode with CUDA
graphs on, traced with torch.profiler: per step, device kernel time against wall time (the
host gaps), kernel launches per step and per layer, and which attention kernel ran. One
JSON line last. `--dry-run-cpu` runs the same code on the CPU with a tiny model (CPU
activities only) so the script is rehearsed here. It reads, never sets, anything on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _events(prof) -> list:
    return [e for e in prof.events() if e.device_type.name in ("CUDA", "CPU")]


def summarize(prof, steps: int, num_layers: int, wall_s: float, on_gpu: bool) -> dict:
    """Kernel counts and times from a profile of `steps` decode steps."""
    kind = "CUDA" if on_gpu else "CPU"
    kernels = [e for e in _events(prof) if e.device_type.name == kind]
    if not on_gpu:  # CPU: the aten ops stand in for kernels
        kernels = [e for e in kernels if e.name.startswith("aten::")]
    busy_us = sum(e.device_time if on_gpu else e.cpu_time for e in kernels)
    names: dict[str, int] = {}
    for e in kernels:
        names[e.name] = names.get(e.name, 0) + 1
    attention = {n: c for n, c in names.items() if "attention" in n.lower() or "attn" in n.lower()}
    top = sorted(names.items(), key=lambda kv: -kv[1])[:15]
    per_step = len(kernels) / max(steps, 1)
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_s * 1e3 / max(steps, 1), 3),
        "device_busy_ms_per_step": round(busy_us / 1e3 / max(steps, 1), 3),
        "device_busy_fraction": round(busy_us / 1e6 / wall_s, 3) if wall_s > 0 else None,
        "kernels_per_step": round(per_step, 1),
        "kernels_per_layer": round(per_step / num_layers, 1),
        "attention_kernels": attention,
        "top_kernels": dict(top),
    }


def profile_decode(engine, prompts, batch: int, new_tokens: int, num_layers: int, on_gpu: bool):
    from torch.profiler import ProfilerActivity, profile

    from wattserve.bench.engine import run_ours

    run_ours(engine, prompts[:batch], 8)  # warm-up: graphs captured, levels landed
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        _, produced = run_ours(engine, prompts[:batch], new_tokens)
        if on_gpu:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    steps = max(1, produced // max(batch, 1))
    return summarize(prof, steps, num_layers, wall_s, on_gpu)


def main(argv: list[str] | None = None) -> int:
    from wattserve.bench.gpu import (
        LLAMA_1B_SHAPE,
        TINY_SHAPE,
        build_engine,
        prompts_for,
        random_llama,
        smollm2_tokenizer,
    )

    ap = argparse.ArgumentParser(prog="python -m wattserve.bench.gpu_profile", description=__doc__)
    ap.add_argument("--dry-run-cpu", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    on_gpu = not args.dry_run_cpu
    if on_gpu and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device (use --dry-run-cpu to rehearse)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    shape = LLAMA_1B_SHAPE if on_gpu else TINY_SHAPE
    loaded = random_llama(shape, smollm2_tokenizer(), device, torch.bfloat16, "profile")
    engine = build_engine(loaded, device, graphs=on_gpu, max_num_seqs=64, kv_cache_gib=2.0)
    prompts = prompts_for(loaded.tokenizer, 64)
    layers = shape["num_hidden_layers"]
    new_tokens = 4 if args.dry_run_cpu else args.new_tokens
    line = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)",
        "attention_backend": engine.model.attention_backend,
        "model": "llama-3.2-1b-shaped" if on_gpu else "tiny-random",
    }
    for batch in (1, 64):
        line[f"bs{batch}"] = profile_decode(engine, prompts, batch, new_tokens, layers, on_gpu)
        print(f"bs{batch}: {line[f'bs{batch}']}", flush=True)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
