"""`wattserve bench gpu`: the engine on the GPU NVML controls, checked and timed in one run.

On a machine with an NVIDIA GPU it:
- reads NVML in observe mode only (identity, limits, clocks, power, energy counter,
  clock-event reasons). It never calls a setter: no clock lock, no power limit, no MIG
  change, no reset; the daemon it starts for the serving runs has device.mode = observe
  and controller.mode = observe;
- checks the engine's greedy outputs on CUDA against HF `generate` on CUDA (SmolLM2, 20
  prompts, bf16 and fp32);
- times single-stream and batched decode (CUDA graphs on and off) on SmolLM2 and on a
  seeded random-weight model with Llama-3.2-1B's layer shapes (nothing downloaded), against
  HF `generate` (bs1) and transformers' continuous batching (`generate_batch`: same
  prompts, new tokens, dtype and KV pool size) on the same GPU;
- sets bs1 decode against the HBM roofline (bytes a step reads / peak memory bandwidth from
  NVML's memory clock and bus width);
- runs the daemon's real HTTP API on 127.0.0.1 on the GPU engine, driven by `bench serve`'s
  client (Poisson arrivals, a bounded request count), for both models: output tok/s,
  TTFT / TPOT p50 / p99, failures;
- records NVML power and energy at three fixed loads (idle, bs1 decode, batched decode) and
  beside each the virtual GPU's prediction (wattserve/daemon/device/virtual.py's power model, its
  H200 profile) for the same engine activity at the SM clock and die temperature NVML read;
- writes gpu-<date>.md (under --out-dir, default <cache>/bench/gpu/) with the figures and
  the command, and the report beside it as gpu-<date>.json, both rewritten after each
  section (a run killed later keeps them); the last line printed is the same JSON object.

Sizes (defaults; estimated, not yet run on an H200): SmolLM2 bf16 ~2 min (HF generate on
20 prompts one by one, two engines, CB warm-up and timed run, 3 x 8 s of power, a serving
run of 160 requests at 16 req/s), fp32 ~1 min, the Llama-1B-shaped model ~1.5 min, so
about 5 min in all; --max-seconds (450) skips any section (or part of one) that would
start after it, and --sections runs only the named ones. --quick is smaller still. On a
machine without a CUDA GPU it stops at once with one line on stderr and exit status 2.
--dry-run-cpu (for tests) runs every section that needs no NVML on the CPU with a tiny
random-weight model and tiny sizes, through the same functions, and writes its doc to
--out-dir (default: a new temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import gc
import json
import logging
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from wattserve.bench import output_dir

NO_GPU_EXIT = 2
SERVE_REQUEST_TIMEOUT_S = 120.0
SERVE_WARM_REQUESTS = 16  # sent at once before a serving run: captures its graph buckets

# Llama-3.2-1B's layer shapes with SmolLM2's 49,152-token vocabulary (so that its tokenizer
# detokenizes the output); the dry run's model is the same family, tiny.
LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=500000.0,
)
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


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
    from wattserve.daemon.device.nvml import import_pynvml
    from wattserve.daemon.device.protocol import NvmlUnavailableError

    try:
        nv = import_pynvml()
        nv.nvmlInit()
        nv.nvmlShutdown()
    except NvmlUnavailableError as e:
        raise NoGpuError(f"no NVML: {e}") from None
    except Exception as e:  # pynvml.NVMLError
        raise NoGpuError(f"no NVML: {e}") from None


@dataclass(frozen=True)
class Target:
    """Where a run measures: the GPU with NVML (observe only), or the CPU dry run."""

    device: torch.device
    backend: object | None  # NvmlBackend, only read(); None in the dry run
    peak_bw: float | None  # bytes/s, from NVML
    gpu_selector: str
    dry_run: bool

    @property
    def nvml_skipped(self) -> str | None:
        return "CPU dry run: no NVML" if self.backend is None else None


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

    def readings(self) -> list[tuple[float, float, float]]:
        """(time, SM clock MHz, die temperature C) of each sample that has both."""
        return [
            (s.timestamp_s, s.sm_clock_mhz, s.gpu_temp_c)
            for s in self.samples
            if s.sm_clock_mhz is not None and s.gpu_temp_c is not None
        ]

    def summary(self) -> dict:
        powers = [s.power_w for s in self.samples if s.power_w is not None]
        energy = [s.energy_j for s in self.samples if s.energy_j is not None]
        clocks = [s.sm_clock_mhz for s in self.samples if s.sm_clock_mhz is not None]
        temps = [s.gpu_temp_c for s in self.samples if s.gpu_temp_c is not None]
        span = self.samples[-1].timestamp_s - self.samples[0].timestamp_s if self.samples else 0
        reasons = sorted({r for s in self.samples for r in s.clock_event_reasons})
        return {
            "power_w_mean": _r(statistics.fmean(powers)) if powers else None,
            "power_w_max": _r(max(powers)) if powers else None,
            "energy_j": _r(energy[-1] - energy[0]) if len(energy) > 1 else None,
            "seconds": _r(span),
            "sm_clock_mhz_mean": _r(statistics.fmean(clocks), 0) if clocks else None,
            "gpu_temp_c_mean": _r(statistics.fmean(temps), 1) if temps else None,
            "clock_event_reasons": reasons,
        }


def hbm_peak_bytes_per_s(gpu_selector: str) -> float | None:
    """Peak memory bandwidth from NVML: max memory clock x bus width x 2 (DDR)."""
    from wattserve.daemon.device.nvml import import_pynvml, parse_gpu_selector

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


# ---- the virtual GPU's prediction ------------------------------------------------------


class StepLog:
    """An engine step hook that keeps (start time, EngineActivity) of each step while
    recording; the start is time.monotonic(), the clock NVML readings carry."""

    def __init__(self, engine) -> None:
        from wattserve.daemon.coupling import step_activity

        self._activity = step_activity(engine)
        self.steps: list = []
        self._recording = False
        engine.add_step_hook(self._hook)

    def _hook(self, stats) -> None:
        if self._recording:
            self.steps.append((stats.started_at_s, self._activity(stats)))

    @contextlib.contextmanager
    def record(self):
        self.steps = []
        self._recording = True
        try:
            yield self.steps
        finally:
            self._recording = False


def predict_power(steps: list, window_s: float, readings: list) -> dict:
    """The virtual GPU's power model (wattserve/daemon/device/virtual.py, default H200
    parameters) on the same engine activity. steps: (start, EngineActivity) pairs, each priced
    at its compute share (from its FLOPs and bytes) for its duration, at the SM clock and die
    temperature of the last NVML reading before it started; readings: (time, SM clock MHz,
    die temperature C) from NVML. The rest of the window is idle with a context open, at
    the readings' mean clock and temperature; without readings, the model's top clock and
    reference temperature throughout."""
    from bisect import bisect_right

    from wattserve.daemon.device.virtual import VirtualGpuParams, compute_fraction, power_w

    p = VirtualGpuParams()
    times = [t for t, _, _ in readings]
    if readings:
        idle_clock = statistics.fmean(c for _, c, _ in readings)
        idle_temp = statistics.fmean(c for _, _, c in readings)
    else:
        idle_clock, idle_temp = p.sm_clock_max_mhz, p.leakage_ref_temp_c

    def at(start_s: float) -> tuple[float, float]:
        if not readings:
            return idle_clock, idle_temp
        _, clock, temp = readings[max(bisect_right(times, start_s) - 1, 0)]
        return clock, temp

    busy_s = sum(a.step_duration_s for _, a in steps)
    window_s = max(window_s, busy_s)
    energy_j, busy_clocks, fractions = 0.0, [], []
    for start_s, a in steps:
        clock, temp = at(start_s)
        fraction = compute_fraction(p, a)
        energy_j += power_w(p, clock, temp, fraction) * a.step_duration_s
        busy_clocks.append(clock)
        fractions.append(fraction)
    idle_w = power_w(p, idle_clock, idle_temp, None)
    energy_j += idle_w * (window_s - busy_s)
    return {
        "profile": p.name,
        "sm_clock_mhz_idle": _r(idle_clock, 0),
        "sm_clock_mhz_busy_mean": _r(statistics.fmean(busy_clocks), 0) if steps else None,
        "gpu_temp_c": _r(idle_temp, 1),
        "busy_fraction": _r(busy_s / window_s, 3) if window_s > 0 else 0.0,
        "mean_compute_fraction": _r(statistics.fmean(fractions), 3) if fractions else 0.0,
        "predicted_w_mean": _r(energy_j / window_s if window_s > 0 else idle_w),
    }


# ---- workloads --------------------------------------------------------------------------


def prompts_for(tokenizer, n: int, seed: int = 21) -> list[list[int]]:
    from wattserve.bench.engine import make_workload

    return make_workload(tokenizer, n, 16, 96, seed)


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, device) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            g = model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
        out.append(g[0, len(p) :].tolist())
    return out


def ours_greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from wattserve.daemon.engine.request import SamplingParams

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
    from wattserve.bench.engine import run_ours

    secs, produced = run_ours(engine, prompts, new_tokens)
    return produced / secs


def cb_config(hf_model, kv_cache_bytes: int, max_batch_tokens: int):
    """transformers' ContinuousBatchingConfig with our engine's KV pool size and batched-token
    cap, and no prefix sharing (the engines timed here run without prefix caching; the
    batch repeats prompts). auto_switch_to_flash off where the field exists: with `kernels`
    installed it would fetch flash attention from the hub, and nothing here downloads; the
    model keeps the attention it was loaded with (SDPA), as HF `generate` does.
    transformers before 5.18 (5.17 on the GPU image) names a block's tokens `block_size`
    and has no auto_switch_to_flash (nor a switch without `kernels` or flash-attn)."""
    from dataclasses import fields

    from transformers import ContinuousBatchingConfig

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    defaults = ContinuousBatchingConfig()
    page = getattr(defaults, "page_size", None) or defaults.block_size
    block_bytes = 2 * c.num_hidden_layers * page * c.num_key_value_heads * head_dim
    block_bytes *= hf_model.dtype.itemsize
    extra = {}
    if "auto_switch_to_flash" in {f.name for f in fields(ContinuousBatchingConfig)}:
        extra["auto_switch_to_flash"] = False
    return ContinuousBatchingConfig(
        num_blocks=max(1, kv_cache_bytes // block_bytes),
        max_batch_tokens=max_batch_tokens,
        allow_block_sharing=False,
        **extra,
    )


def hf_cb_tok_s(hf_model, prompts: list[list[int]], new_tokens: int, config) -> float:
    """transformers' continuous batching on the same prompts: an untimed run keeps its
    manager (cache sized for this workload, graphs captured), the timed run reuses it."""
    from wattserve.bench.engine import run_hf_cb

    try:
        run_hf_cb(hf_model, prompts, new_tokens, config, persistent_manager=True)
        secs, produced = run_hf_cb(hf_model, prompts, new_tokens, config, persistent_manager=True)
    finally:
        hf_model.destroy_cached_continuous_batching_manager()
    return produced / secs


def build_engine(loaded, device, graphs: bool, max_num_seqs: int, kv_cache_gib: float):
    from wattserve.daemon.engine.engine import Engine, EngineOptions

    opts = EngineOptions(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        quantization_levels=(_level(loaded.dtype),),
        cuda_graphs=graphs,
        kv_cache_bytes=int(kv_cache_gib * 2**30),
        enable_prefix_caching=False,
    )
    return Engine(loaded, opts, device)


MAX_BATCHED_TOKENS = 4096


def _level(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(float(x), nd)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# ---- models -----------------------------------------------------------------------------


@functools.cache
def smollm2_tokenizer():
    """SmolLM2's tokenizer from the converted embedded model (converted once into the cache)."""
    from transformers import AutoTokenizer

    from wattserve.bench.serve import model_directory
    from wattserve.daemon.config import default_cache_dir

    path = model_directory("embedded", default_cache_dir())
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def random_llama(shape: dict, tokenizer, device, dtype: torch.dtype, name: str):
    """A Llama with `shape`, weights from seed 0 (nothing downloaded), on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from wattserve.daemon.engine.loader import LoadedModel

    cfg = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(dtype).eval()
    return LoadedModel(hf, tokenizer, name, Path("."), dtype, 0.0, False)


def load_smollm2(dtype_name: str, target: Target):
    """SmolLM2 (the embedded model) on the GPU; a tiny random model in the CPU dry run."""
    from wattserve.daemon.config import default_cache_dir
    from wattserve.daemon.engine.loader import load_model

    if target.dry_run:
        dtype = getattr(torch, dtype_name)
        return random_llama(TINY_SHAPE, smollm2_tokenizer(), target.device, dtype, "tiny-random")
    loaded = load_model("embedded", default_cache_dir(), dtype_name, "cuda")
    loaded.hf_model.to(target.device)
    return loaded


# ---- the run ----------------------------------------------------------------------------


SECTIONS = ("smollm2_bfloat16", "smollm2_float32", "llama_1b_shaped")


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or [text]}; expected some of {','.join(SECTIONS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wattserve bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="0", help="NVML GPU: index, UUID or PCI bus id")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--load-seconds", type=float, default=8.0, help="per power load")
    ap.add_argument("--serve-requests", type=int, default=160, help="per serving run")
    ap.add_argument("--serve-rate", type=float, default=16.0, help="req/s, Poisson")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, tokens and requests")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV pool per engine")
    ap.add_argument(
        "--max-seconds", type=float, default=450.0, help="skip sections that would start later"
    )
    ap.add_argument(
        "--sections",
        type=_sections,
        default=SECTIONS,
        help=f"comma-separated, of {','.join(SECTIONS)} (default: all); the others are "
        "skipped and said so in the report",
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where the doc and its JSON go, rewritten after each section "
        "(default: <cache>/bench/gpu)",
    )
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="for tests: every section that needs no NVML, on the CPU, with a tiny random "
        "model and tiny sizes; writes its doc to --out-dir (default: a temporary directory)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request drowns the rest
    args.command = shlex.join(["wattserve", "bench", "gpu", *argv])
    args.serve_prompt_len, args.serve_output_len = (64, 256), (32, 128)
    if args.quick:
        args.prompts, args.check_tokens, args.decode_tokens = 4, 16, 32
        args.batch, args.load_seconds = 16, 2.0
        args.serve_requests, args.serve_rate = 32, 8.0
    if args.dry_run_cpu:
        args.prompts, args.check_tokens, args.decode_tokens = 3, 4, 6
        args.batch, args.load_seconds, args.kv_cache_gib = 3, 0.3, 1 / 256
        args.serve_requests, args.serve_rate = 3, 20.0
        args.serve_prompt_len, args.serve_output_len = (16, 32), (2, 6)
        args.out_dir = args.out_dir or tempfile.mkdtemp(prefix="wattserve-bench-gpu-")
        return _run(args, Target(torch.device("cpu"), None, None, args.gpu, True))
    args.out_dir = args.out_dir or str(output_dir("gpu"))
    try:
        preflight()
    except NoGpuError as e:
        print(f"wattserve bench gpu: {e}; nothing measured", file=sys.stderr)
        print(json.dumps({"bench": "gpu", "ok": False, "error": str(e)}))
        return NO_GPU_EXIT
    return _run(args, None)


def _gpu_target(args: argparse.Namespace) -> Target:
    from wattserve.daemon.device.nvml import NvmlBackend
    from wattserve.daemon.engine.placement import resolve_placement

    backend = NvmlBackend(args.gpu)  # observe: only read(), limits() and identity are used
    device = resolve_placement("auto", args.gpu, "nvml").device
    return Target(device, backend, hbm_peak_bytes_per_s(args.gpu), args.gpu, False)


def _gpu_header(target: Target) -> dict:
    if target.backend is None:
        return {"name": "CPU (dry run)", "cuda_device": str(target.device), "skipped": "no NVML"}
    backend, device = target.backend, target.device
    ident, first = backend.identity, backend.read()
    props = torch.cuda.get_device_properties(device)
    return {
        "name": ident.name,
        "uuid": ident.uuid,
        "pci_bus_id": ident.pci_bus_id,
        "cuda_device": str(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "memory_gib": _r(props.total_memory / 2**30, 1),
        "power_limit_w": first.power_limit_w,
        "power_limit_range_w": [first.power_limit_min_w, first.power_limit_max_w],
        "sm_clock_max_mhz": backend.limits().sm_clock_max_mhz,
        "hbm_peak_gb_s": _r(target.peak_bw / 1e9, 0) if target.peak_bw else None,
        "clock_event_reasons_at_start": list(first.clock_event_reasons),
    }


def _run(args: argparse.Namespace, target: Target | None) -> int:
    t_start = time.perf_counter()
    args.deadline_s = t_start + args.max_seconds
    target = target or _gpu_target(args)
    report: dict = {
        "bench": "gpu",
        "ok": True,
        "dry_run_cpu": target.dry_run,
        "command": args.command,
        "gpu": _gpu_header(target),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "skipped": {},
        "errors": {},  # parts of a section that failed while the rest of it ran
        "seconds_per_section": {},
    }
    if target.nvml_skipped:
        report["skipped"]["nvml"] = (
            f"{target.nvml_skipped}: GPU identity, measured power and the roofline's peak "
            "bandwidth left out; the virtual GPU's prediction uses its top clock"
        )
    # Each section on its own: one that fails is reported, and the others still run.
    sections = {
        "smollm2_bfloat16": lambda: _smollm2("bfloat16", target, args, report),
        "smollm2_float32": lambda: _smollm2("float32", target, args, report),
        "llama_1b_shaped": lambda: _llama_1b_shaped(target, args, report),
    }
    for name, fn in sections.items():
        if name not in args.sections:
            report["skipped"][name] = "not in --sections"
            continue
        if time.perf_counter() > args.deadline_s:
            report["skipped"][name] = f"--max-seconds {args.max_seconds} spent"
            report["ok"] = False
            continue
        _section(report, name, fn)
        # The doc and its JSON so far: a run killed in a later section keeps these figures.
        report["seconds"] = _r(time.perf_counter() - t_start, 1)
        _write_doc(report, args)
    if target.backend is not None:
        target.backend.close()
    report["seconds"] = _r(time.perf_counter() - t_start, 1)
    path = _write_doc(report, args)
    report["doc"] = str(path)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def _part(report: dict, where: str, fn, args: argparse.Namespace):
    """fn(), or None when it raised (the error goes to report["errors"][where]) or when
    --max-seconds is spent (skipped); either way the run counts as failed, while the rest
    of its section still runs."""
    if time.perf_counter() > args.deadline_s:
        report["skipped"][where] = f"--max-seconds {args.max_seconds} spent"
        report["ok"] = False
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported, and the section goes on
        traceback.print_exc()
        report["errors"][where] = f"{type(e).__name__}: {e}"
        report["ok"] = False
        return None


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


def _smollm2(dtype_name: str, target: Target, args, report: dict) -> dict:
    """Greedy agreement with HF generate, decode timings against HF generate and CB, the
    roofline; in bf16 also power at three loads and a serving run."""
    from wattserve.bench.engine import single_stream_ours

    name, device = f"smollm2_{dtype_name}", target.device
    loaded = load_smollm2(dtype_name, target)
    prompts = prompts_for(loaded.tokenizer, args.prompts)
    hf = loaded.hf_model
    engine = build_engine(loaded, device, True, args.batch, args.kv_cache_gib)
    out: dict = {"model": loaded.name}
    ours = ours_greedy(engine, prompts, args.check_tokens)
    theirs = hf_greedy(hf, prompts, args.check_tokens, device)
    out["greedy_vs_hf"] = agreement(ours, theirs)
    bs1 = {}
    batch_prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    for graphs in (True, False):
        eng = (
            engine if graphs else build_engine(loaded, device, False, args.batch, args.kv_cache_gib)
        )
        single_stream_ours(eng, prompts[0], 8)  # warm-up (graphs are captured at start)
        bs1[graphs] = single_stream_ours(eng, prompts[0], args.decode_tokens)
        decode_tok_s(eng, batch_prompts, 8)  # warm-up
        out[f"batch{args.batch}_tok_s_graphs_{'on' if graphs else 'off'}"] = _r(
            decode_tok_s(eng, batch_prompts, args.decode_tokens), 1
        )
        if not graphs:
            del eng
    out["bs1_decode_tok_s_graphs_on"] = _r(bs1[True], 1)
    out["bs1_decode_tok_s_graphs_off"] = _r(bs1[False], 1)
    out.update(_hf_peers(hf, prompts[0], batch_prompts, args, device, report, name))
    out["ratio_vs_hf_continuous_batching"] = _ratio(
        out[f"batch{args.batch}_tok_s_graphs_on"], out["hf_continuous_batching_tok_s"]
    )
    out.update(_roofline(engine.model.weight_bytes(), bs1[True], target.peak_bw))
    if dtype_name == "bfloat16":
        report["power"] = _part(
            report, "power", lambda: _power_loads(target, engine, prompts, args), args
        )
        del engine
        serve = functools.partial(_serving, loaded, target, args)
        out["serving"] = _part(report, f"{name}.serving", serve, args)
    return out


def _hf_peers(hf, prompt, batch_prompts, args, device, report: dict, name: str) -> dict:
    """HF `generate` at bs1 and transformers' continuous batching on the batch: same
    prompts, new tokens, dtype and KV pool size as ours."""
    hf_greedy(hf, [prompt], 4, device)  # warm-up
    t0 = time.perf_counter()
    hf_greedy(hf, [prompt], args.decode_tokens, device)
    bs1 = args.decode_tokens / (time.perf_counter() - t0)
    kv_bytes = int(args.kv_cache_gib * 2**30)

    def cb() -> float:
        config = cb_config(hf, kv_bytes, MAX_BATCHED_TOKENS)
        return hf_cb_tok_s(hf, batch_prompts, args.decode_tokens, config)

    cb_tok_s = _part(report, f"{name}.hf_continuous_batching", cb, args)
    return {"hf_generate_bs1_tok_s": _r(bs1, 1), "hf_continuous_batching_tok_s": _r(cb_tok_s, 1)}


def _roofline(step_bytes: int, tok_s: float, peak_bw: float | None) -> dict:
    """bs1 decode against reading every weight once per token at peak HBM bandwidth."""
    out: dict = {"bs1_step_weight_bytes": step_bytes}
    if peak_bw:
        roof_s = step_bytes / peak_bw
        out["bs1_roofline_tok_s"] = _r(1 / roof_s, 0)
        out["bs1_fraction_of_roofline"] = _r(tok_s * roof_s, 3)
    return out


def _llama_1b_shaped(target: Target, args, report: dict) -> dict:
    """A random-weight model with Llama-3.2-1B's layer shapes (seeded, nothing downloaded;
    SmolLM2's 49,152-token vocabulary so that its tokenizer detokenizes the output): bs1
    decode at every quantization level the GPU runs, against the roofline; then in bf16
    batched decode against transformers' CB, bs1 against HF generate, and a serving run."""
    from wattserve.bench.engine import single_stream_ours
    from wattserve.daemon.engine.engine import Engine, EngineOptions

    shape = TINY_SHAPE if target.dry_run else LLAMA_1B_SHAPE
    name = "tiny-random" if target.dry_run else "llama-3.2-1b-shaped"
    loaded = random_llama(shape, smollm2_tokenizer(), target.device, torch.bfloat16, name)
    levels = ("bf16", "int8", "int4", "fp8")
    engine = Engine(
        loaded,
        EngineOptions(
            max_num_seqs=args.batch,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            quantization_levels=levels,
            kv_cache_bytes=int(args.kv_cache_gib * 2**30),
            enable_prefix_caching=False,
        ),
        target.device,
    )
    prompts = prompts_for(loaded.tokenizer, args.prompts)
    out: dict = {"model": name, "unavailable": engine.quant_status()["unavailable"]}
    for level in engine.quant_status()["levels"]:
        engine.set_quant_level(level)
        single_stream_ours(engine, prompts[0], 8)  # lands the level, captures its graph
        tok_s = single_stream_ours(engine, prompts[0], args.decode_tokens)
        out[level] = {"bs1_decode_tok_s": _r(tok_s, 1)} | _roofline(
            engine.model.weight_bytes(), tok_s, target.peak_bw
        )
    engine.set_quant_level("bf16")
    batch_prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    decode_tok_s(engine, batch_prompts, 8)  # warm-up
    ours = decode_tok_s(engine, batch_prompts, args.decode_tokens)
    del engine
    out[f"bf16_batch{args.batch}_tok_s"] = _r(ours, 1)
    peers = _hf_peers(
        loaded.hf_model, prompts[0], batch_prompts, args, target.device, report, "llama_1b_shaped"
    )
    out.update(peers)
    out["ratio_vs_hf_continuous_batching"] = _ratio(ours, out["hf_continuous_batching_tok_s"])
    serve = functools.partial(_serving, loaded, target, args)
    out["serving"] = _part(report, "llama_1b_shaped.serving", serve, args)
    return out


# Fitted on idle, bs1 and the full batch; the other loads are held out to test the fit.
POWER_FIT_LOADS = ("idle", "bs1", "batch")


def _power_loads(target: Target, engine, prompts, args) -> dict:
    """NVML power and energy at fixed loads (idle, bs1, batch 8 and the full batch of decode),
    each with the engine activity it saw and the virtual GPU's prediction for that activity;
    then a power calibration fitted on idle, bs1 and the full batch (written beside the
    report as power-calibration.json) and its prediction of the held-out loads."""
    from wattserve.daemon.engine.request import SamplingParams

    log = StepLog(engine)
    loads = {}
    points = {}
    batches = [("idle", 0), ("bs1", 1), ("batch8", 8), (f"batch{args.batch}", args.batch)]
    batches = list(dict(batches).items())  # batch 8 once when --batch is 8
    for name, batch in batches:
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        rng = random.Random(batch)
        produced = 0
        recorder = PowerRecorder(target.backend) if target.backend else contextlib.nullcontext()
        with recorder as rec, log.record() as steps:
            t0 = time.perf_counter()
            if not batch:
                time.sleep(args.load_seconds)
            while batch and time.perf_counter() - t0 < args.load_seconds:
                outs = engine.generate([rng.choice(prompts) for _ in range(batch)], params)
                produced += sum(o.completion_tokens for o in outs)
            window_s = time.perf_counter() - t0
        s = rec.summary() if rec else {"measured": target.nvml_skipped}
        s["tokens"] = produced
        s["tok_s"] = _r(produced / window_s, 1)
        s["steps"] = len(steps)
        s["mean_decode_batch"] = (
            _r(statistics.fmean(a.decode_tokens for _, a in steps), 2) if steps else 0.0
        )
        if s.get("energy_j"):
            s["j_per_token"] = _r(s["energy_j"] / max(produced, 1), 4)
        s["virtual_gpu"] = predict_power(steps, window_s, rec.readings() if rec else [])
        s["predicted_over_measured"] = _ratio(
            s["virtual_gpu"]["predicted_w_mean"], s.get("power_w_mean")
        )
        loads[name] = s
        points[name] = load_point(name, steps, window_s, s)
    loads["calibration"] = _calibrate(target, points, f"batch{args.batch}", args)
    return loads


def load_point(name: str, steps: list, window_s: float, summary: dict):
    """A window's LoadPoint: NVML's mean power and clock, the engine's achieved utilisation
    against the virtual GPU profile's peaks (the simulator's own definitions); None without
    a power reading (the CPU dry run)."""
    from wattserve.daemon.device.power_calibration import LoadPoint
    from wattserve.daemon.device.virtual import VirtualGpuParams

    if summary.get("power_w_mean") is None or window_s <= 0:
        return None
    p = VirtualGpuParams()
    busy_s = sum(a.step_duration_s for _, a in steps)
    window_s = max(window_s, busy_s)
    return LoadPoint(
        label=name,
        power_w=summary["power_w_mean"],
        busy_fraction=busy_s / window_s,
        memory_utilization=min(
            1.0,
            sum(a.bytes_read for _, a in steps) / window_s / p.peak_memory_bandwidth_bytes_per_s,
        ),
        compute_utilization=min(1.0, sum(a.flops for _, a in steps) / window_s / p.peak_flops),
        sm_clock_mhz=summary.get("sm_clock_mhz_mean") or p.sm_clock_max_mhz,
        gpu_temp_c=summary.get("gpu_temp_c_mean"),
    )


def _calibrate(target: Target, points: dict, full_batch: str, args) -> dict:
    """Fit on idle, bs1 and the full batch; predict the others; write the file."""
    from wattserve.daemon.device.power_calibration import fit_power_calibration
    from wattserve.daemon.device.virtual import VirtualGpuParams, fv_squared

    fit_names = ("idle", "bs1", full_batch)
    fit_points = [points[n] for n in fit_names if points.get(n) is not None]
    if len(fit_points) < len(fit_names):
        return {"skipped": "no NVML power reading"}
    p = VirtualGpuParams()
    clock = fit_points[0].sm_clock_mhz
    cal = fit_power_calibration(
        fit_points,
        gpu_name=getattr(getattr(target.backend, "identity", None), "name", "unknown"),
        prior_memory_w=p.memory_full_bandwidth_w,
        prior_compute_w=p.compute_w_per_ghz_v2 * fv_squared(p, clock),
        source=args.command,
    )
    path = Path(args.out_dir) / "power-calibration.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.to_json() + "\n")
    out = {
        "path": str(path),
        "fitted_on": list(fit_names),
        "idle_w": _r(cal.idle_w),
        "active_w": _r(cal.active_w),
        "memory_w": _r(cal.memory_w),
        "compute_w": _r(cal.compute_w),
    }
    for name, pt in points.items():
        if pt is None:
            continue
        predicted = cal.predict_w(pt.busy_fraction, pt.memory_utilization, pt.compute_utilization)
        role = "fit" if name in fit_names else "held_out"
        out[f"{role}.{name}.predicted_over_measured"] = _ratio(predicted, pt.power_w)
    return out


def _serving(loaded, target: Target, args) -> dict:
    """The daemon's HTTP API on 127.0.0.1 serving a fresh engine (the daemon's engine
    defaults, our KV pool size) on the target, driven by `bench serve`'s client: Poisson
    arrivals of a bounded request count, after one untimed burst of other prompts."""
    from wattserve.bench.serve import (
        build_workload,
        count_tokens_with,
        in_process_daemon,
        run_workload,
        saturation_workload,
        summarize,
    )
    from wattserve.daemon.config import load_config
    from wattserve.daemon.engine.engine import Engine, EngineOptions

    count = count_tokens_with(loaded.tokenizer)
    lens = (args.serve_prompt_len, args.serve_output_len)
    specs = build_workload(args.serve_requests, *lens, args.serve_rate, 0, count)
    warm = min(SERVE_WARM_REQUESTS, args.serve_requests)
    warm_specs = saturation_workload(build_workload(warm, *lens, args.serve_rate, 1, count))
    with tempfile.TemporaryDirectory(prefix="wattserve-bench-gpu-state-") as state_dir:
        cfg = load_config(
            None,
            {
                "server": {"host": "127.0.0.1", "port": 0, "log_level": "warning"},
                "engine": {"kv_cache_bytes": int(args.kv_cache_gib * 2**30)},
                "device": {
                    "backend": "virtual" if target.backend is None else "nvml",
                    "mode": "observe",
                    "gpu": target.gpu_selector,
                    "state_dir": state_dir,
                },
                "controller": {"mode": "observe"},
                "mqtt": {"enabled": False},
            },
        )

        def build() -> Engine:
            return Engine(loaded, EngineOptions.from_config(cfg.engine), target.device)

        with in_process_daemon(cfg, build) as (daemon, url):
            model = daemon.state.served_model_name
            timeout_s = SERVE_REQUEST_TIMEOUT_S
            asyncio.run(run_workload(url, model, warm_specs, None, timeout_s))
            results, duration_s = asyncio.run(run_workload(url, model, specs, None, timeout_s))
    s = summarize(results, duration_s, cfg.controller.ttft_slo_ms, cfg.controller.tpot_slo_ms)
    return {
        "requests": args.serve_requests,
        "request_rate": args.serve_rate,
        "prompt_len": list(args.serve_prompt_len),
        "output_len": list(args.serve_output_len),
        "device_backend": cfg.device.backend,
        "completed": s["completed"],
        "failed": s["failed"],
        "errors": s["errors"],
        "duration_s": s["duration_s"],
        "output_tok_s": s["output_throughput_tok_s"],
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p99")},
        "tpot_ms": {k: s["tpot_ms"][k] for k in ("p50", "p99")},
    }


def _write_doc(report: dict, args: argparse.Namespace) -> Path:
    day = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    stem = "gpu-dry-run" if report["dry_run_cpu"] else "gpu"
    path = Path(args.out_dir) / f"{stem}-{day}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    g = report["gpu"]
    lines = [
        f"# wattserve on {g['name']} ({day})",
        "",
        f"Command: `{report['command']}` (torch {report['torch']}, CUDA {report['cuda']}); "
        + (
            "a CPU dry run with a tiny random model: it exercises the code and measures "
            "nothing about a GPU; "
            if report["dry_run_cpu"]
            else "NVML observe only; "
        )
        + f"{report.get('seconds')} s in all.",
        "",
    ]
    if "uuid" in g:
        lines += [
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
    lines += [
        "## Power at three loads (NVML, SmolLM2 bf16) and the virtual GPU's prediction",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in _flat(report.get("power", {}))]
    lines += ["", f"Skipped: {report['skipped'] or 'nothing'}", ""]
    lines += [f"Failed parts: {report['errors'] or 'none'}", ""]
    lines += [f"Seconds per section: {report['seconds_per_section']}", ""]
    path.write_text("\n".join(lines))
    path.with_suffix(".json").write_text(json.dumps(report | {"doc": str(path)}, indent=1) + "\n")
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
