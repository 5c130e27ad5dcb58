"""`wattserve bench gpu`: the engine on the GPU NVML controls, checked and timed in one run.

On a machine with an NVIDIA GPU: reads NVML in observe mode only (identity, limits, clocks,
power, energy counter, clock-event reasons; it never calls a setter and never resets);
checks the engine's greedy outputs on CUDA against HF `generate` on CUDA (SmolLM2, 20
prompts, bf16 and fp32); times single-stream and batched decode (CUDA graphs on and off)
against HF `generate` on the same GPU; sets bs1 decode against the HBM roofline (bytes a
step reads / peak memory bandwidth from NVML's memory clock and bus width); records NVML
power and energy at three fixed loads (idle, bs1 decode, batched decode); and writes
docs/gpu-<date>.md with the figures and the command. Sized to finish in a few minutes on
an H200 (--quick: less). On a machine without a CUDA GPU it stops at once with one line
on stderr and exit status 2. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import random
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

NO_GPU_EXIT = 2


class NoGpuError(RuntimeError):
    """This machine has no CUDA GPU this torch can use, or no NVML."""


def preflight() -> None:
    """Raise NoGpuError with the reason when there is nothing to measure here."""
    if torch.version.cuda is None:
        raise NoGpuError(
            f"no GPU: torch {torch.__version__} is a CPU-only build (a GPU box installs the "
            "CUDA build of the same version from PyPI)"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise NoGpuError("no GPU: CUDA sees no device (driver missing, or CUDA_VISIBLE_DEVICES)")
    from daemon.device.nvml import import_pynvml
    from daemon.device.protocol import NvmlUnavailableError

    try:
        nv = import_pynvml()
        nv.nvmlInit()
        nv.nvmlShutdown()
    except NvmlUnavailableError as e:
        raise NoGpuError(f"no NVML: {e}") from None
    except Exception as e:  # pynvml.NVMLError
        raise NoGpuError(f"no NVML: {e}") from None


# ---- NVML, observe only ---------------------------------------------------------------


class PowerRecorder:
    """Samples an NvmlBackend's telemetry on a thread; read-only."""

    def __init__(self, backend, period_s: float = 0.1) -> None:
        self.backend = backend
        self.period_s = period_s
        self.samples: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PowerRecorder:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.backend.read())
            self._stop.wait(self.period_s)

    def summary(self) -> dict:
        powers = [s.power_w for s in self.samples if s.power_w is not None]
        energy = [s.energy_j for s in self.samples if s.energy_j is not None]
        span = self.samples[-1].timestamp_s - self.samples[0].timestamp_s if self.samples else 0
        reasons = sorted({r for s in self.samples for r in s.clock_event_reasons})
        return {
            "power_w_mean": _r(statistics.fmean(powers)) if powers else None,
            "power_w_max": _r(max(powers)) if powers else None,
            "energy_j": _r(energy[-1] - energy[0]) if len(energy) > 1 else None,
            "seconds": _r(span),
            "sm_clock_mhz": [s.sm_clock_mhz for s in self.samples][-1:],
            "clock_event_reasons": reasons,
        }


def hbm_peak_bytes_per_s(gpu_selector: str) -> float | None:
    """Peak memory bandwidth from NVML: max memory clock x bus width x 2 (DDR)."""
    from daemon.device.nvml import import_pynvml, parse_gpu_selector

    nv = import_pynvml()
    nv.nvmlInit()
    try:
        kind, key = parse_gpu_selector(gpu_selector)
        get = {
            "index": nv.nvmlDeviceGetHandleByIndex,
            "uuid": nv.nvmlDeviceGetHandleByUUID,
            "pci_bus_id": nv.nvmlDeviceGetHandleByPciBusId,
        }[kind]
        h = get(key)
        mem_mhz = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)
        bus_bits = nv.nvmlDeviceGetMemoryBusWidth(h)
        return mem_mhz * 1e6 * 2 * bus_bits / 8
    except Exception:  # noqa: BLE001 - an older driver: no roofline, said in the report
        return None
    finally:
        nv.nvmlShutdown()


# ---- workloads --------------------------------------------------------------------------


def prompts_for(tokenizer, n: int, seed: int = 21) -> list[list[int]]:
    from bench.engine import make_workload

    return make_workload(tokenizer, n, 16, 96, seed)


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, device) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            g = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
        out.append(g[0, len(p) :].tolist())
    return out


def ours_greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from daemon.engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), len(x))
        prefix.append(k)
    return {
        "identical": same,
        "of": len(a),
        "min_common_prefix": min(prefix),
        "mean_common_prefix": _r(statistics.fmean(prefix), 1),
    }


def decode_tok_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tokens per second of a batch decoded together (prefill included)."""
    from bench.engine import run_ours

    secs, produced = run_ours(engine, prompts, new_tokens)
    return produced / secs


def build_engine(loaded, device, graphs: bool, max_num_seqs: int, kv_cache_gib: float):
    from daemon.engine.engine import Engine, EngineOptions

    opts = EngineOptions(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=4096,
        quantization_levels=(_level(loaded.dtype),),
        cuda_graphs=graphs,
        kv_cache_bytes=int(kv_cache_gib * 2**30),
        enable_prefix_caching=False,
    )
    return Engine(loaded, opts, device)


def _level(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(float(x), nd)


# ---- the run ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="0", help="NVML GPU: index, UUID or PCI bus id")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--load-seconds", type=float, default=8.0, help="per power load")
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV pool per engine")
    ap.add_argument("--out-dir", default="docs")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.check_tokens, args.decode_tokens = 4, 16, 32
        args.batch, args.load_seconds = 16, 2.0
    try:
        preflight()
    except NoGpuError as e:
        print(f"wattserve bench gpu: {e}; nothing measured", file=sys.stderr)
        print(json.dumps({"bench": "gpu", "ok": False, "error": str(e)}))
        return NO_GPU_EXIT
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from daemon.device.nvml import NvmlBackend
    from daemon.engine.placement import resolve_placement

    t_start = time.perf_counter()
    backend = NvmlBackend(args.gpu)  # observe: only read() and identity are used
    ident = backend.identity
    first = backend.read()
    placement = resolve_placement("auto", args.gpu, "nvml")
    device = placement.device
    props = torch.cuda.get_device_properties(device)
    peak_bw = hbm_peak_bytes_per_s(args.gpu)
    report: dict = {
        "bench": "gpu",
        "ok": True,
        "gpu": {
            "name": ident.name,
            "uuid": ident.uuid,
            "pci_bus_id": ident.pci_bus_id,
            "cuda_device": str(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "memory_gib": _r(props.total_memory / 2**30, 1),
            "power_limit_w": first.power_limit_w,
            "power_limit_range_w": [first.power_limit_min_w, first.power_limit_max_w],
            "sm_clock_max_mhz": backend.limits().sm_clock_max_mhz,
            "hbm_peak_gb_s": _r(peak_bw / 1e9, 0) if peak_bw else None,
            "clock_event_reasons_at_start": list(first.clock_event_reasons),
        },
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds_per_section": {},
    }
    # Each section on its own: one that fails is reported, and the others still run.
    for dtype_name in ("bfloat16", "float32"):
        _section(report, f"smollm2_{dtype_name}", lambda d=dtype_name: _smollm2(
            d, device, backend, peak_bw, args, report
        ))
    _section(report, "llama_1b_shaped", lambda: _llama_1b_shaped(device, peak_bw, args))
    backend.close()
    report["seconds"] = _r(time.perf_counter() - t_start, 1)
    path = _write_doc(report, args)
    report["doc"] = str(path)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def _section(report: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on
        traceback.print_exc()
        report[name] = {"error": f"{type(e).__name__}: {e}"}
        report["ok"] = False
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    report["seconds_per_section"][name] = _r(time.perf_counter() - t0, 1)


def _smollm2(dtype_name: str, device, backend, peak_bw, args, report: dict) -> dict:
    """Greedy agreement with HF generate, decode timings, roofline (and power, in bf16)."""
    from bench.engine import single_stream_ours
    from daemon.config import default_cache_dir
    from daemon.engine.loader import load_model

    loaded = load_model("embedded", default_cache_dir(), dtype_name, "cuda")
    prompts = prompts_for(loaded.tokenizer, args.prompts)
    hf = loaded.hf_model.to(device)
    engine = build_engine(loaded, device, True, args.batch, args.kv_cache_gib)
    out: dict = {}
    ours = ours_greedy(engine, prompts, args.check_tokens)
    theirs = hf_greedy(hf, prompts, args.check_tokens, device)
    out["greedy_vs_hf"] = agreement(ours, theirs)
    bs1 = {}
    batch_prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    for graphs in (True, False):
        eng = engine if graphs else build_engine(
            loaded, device, False, args.batch, args.kv_cache_gib
        )
        single_stream_ours(eng, prompts[0], 8)  # warm-up (captures bucket 1 with graphs)
        bs1[graphs] = single_stream_ours(eng, prompts[0], args.decode_tokens)
        decode_tok_s(eng, batch_prompts, 8)  # warm-up
        out[f"batch{args.batch}_tok_s_graphs_{'on' if graphs else 'off'}"] = _r(
            decode_tok_s(eng, batch_prompts, args.decode_tokens), 1
        )
        if not graphs:
            del eng
    out["bs1_decode_tok_s_graphs_on"] = _r(bs1[True], 1)
    out["bs1_decode_tok_s_graphs_off"] = _r(bs1[False], 1)
    t0 = time.perf_counter()
    hf_greedy(hf, prompts[:1], args.decode_tokens, device)
    out["hf_generate_bs1_tok_s"] = _r(args.decode_tokens / (time.perf_counter() - t0), 1)
    out.update(_roofline(engine.model.weight_bytes(), bs1[True], peak_bw))
    if dtype_name == "bfloat16":
        report["power"] = _power_loads(backend, engine, prompts, args)
    return out


def _roofline(step_bytes: int, tok_s: float, peak_bw: float | None) -> dict:
    """bs1 decode against reading every weight once per token at peak HBM bandwidth."""
    out: dict = {"bs1_step_weight_bytes": step_bytes}
    if peak_bw:
        roof_s = step_bytes / peak_bw
        out["bs1_roofline_tok_s"] = _r(1 / roof_s, 0)
        out["bs1_fraction_of_roofline"] = _r(tok_s * roof_s, 3)
    return out


def _llama_1b_shaped(device, peak_bw, args) -> dict:
    """A random-weight model with Llama-3.2-1B's layer shapes (seeded, nothing downloaded;
    SmolLM2's 49,152-token vocabulary so that its tokenizer detokenizes the output): bs1
    decode at every quantization level the GPU runs, against the roofline."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.engine import single_stream_ours
    from daemon.config import default_cache_dir
    from daemon.engine.engine import Engine, EngineOptions
    from daemon.engine.loader import LoadedModel, load_model

    tok = load_model("embedded", default_cache_dir(), "bfloat16", "cuda").tokenizer
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    loaded = LoadedModel(hf, tok, "llama-3.2-1b-shaped", Path("."), torch.bfloat16, 0.0, False)
    levels = ("bf16", "int8", "int4", "fp8")
    engine = Engine(
        loaded,
        EngineOptions(
            max_num_seqs=args.batch,
            max_num_batched_tokens=4096,
            quantization_levels=levels,
            kv_cache_bytes=int(args.kv_cache_gib * 2**30),
            enable_prefix_caching=False,
        ),
        device,
    )
    prompt = prompts_for(tok, 1)[0]
    out: dict = {"unavailable": engine.quant_status()["unavailable"]}
    for level in engine.quant_status()["levels"]:
        engine.set_quant_level(level)
        single_stream_ours(engine, prompt, 8)  # lands the level, captures its graph
        tok_s = single_stream_ours(engine, prompt, args.decode_tokens)
        out[level] = {"bs1_decode_tok_s": _r(tok_s, 1)} | _roofline(
            engine.model.weight_bytes(), tok_s, peak_bw
        )
    return out


def _power_loads(backend, engine, prompts, args) -> dict:
    """NVML power and energy at three fixed loads: idle, bs1 decode, batched decode."""
    from daemon.engine.request import SamplingParams

    loads = {}
    with PowerRecorder(backend) as rec:
        time.sleep(args.load_seconds)
    loads["idle"] = rec.summary()
    for name, batch in (("bs1", 1), (f"batch{args.batch}", args.batch)):
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        rng = random.Random(batch)
        produced = 0
        with PowerRecorder(backend) as rec:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.load_seconds:
                outs = engine.generate([rng.choice(prompts) for _ in range(batch)], params)
                produced += sum(o.completion_tokens for o in outs)
        s = rec.summary()
        s["tokens"] = produced
        if s["energy_j"]:
            s["j_per_token"] = _r(s["energy_j"] / max(produced, 1), 4)
        loads[name] = s
    return loads


def _write_doc(report: dict, args: argparse.Namespace) -> Path:
    day = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    path = Path(args.out_dir) / f"gpu-{day}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    g = report["gpu"]
    lines = [
        f"# wattserve on {g['name']} ({day})",
        "",
        f"Command: `{' '.join(['wattserve bench gpu', *sys.argv[3:]])}`"
        + f" (torch {report['torch']}, CUDA {report['cuda']}); NVML observe only; "
        f"{report.get('seconds')} s in all.",
        "",
        f"GPU {g['uuid']} at {g['pci_bus_id']} ({g['cuda_device']}), compute capability "
        f"{g['capability']}, {g['memory_gib']} GiB, power limit {g['power_limit_w']} W, "
        f"HBM peak {g['hbm_peak_gb_s']} GB/s (NVML: max memory clock x bus width x 2).",
        "",
    ]
    for name in ("smollm2_bfloat16", "smollm2_float32", "llama_1b_shaped"):
        lines += [f"## {name}", "", "| figure | value |", "|---|---|"]
        for key, value in _flat(report.get(name, {})):
            lines.append(f"| {key} | {value} |")
        lines.append("")
    lines += ["## Power at three loads (NVML, SmolLM2 bf16)", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _flat(report.get("power", {}))]
    lines += ["", f"Seconds per section: {report['seconds_per_section']}", ""]
    path.write_text("\n".join(lines))
    return path


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += _flat(value, name + ".")
        else:
            out.append((name, value))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
