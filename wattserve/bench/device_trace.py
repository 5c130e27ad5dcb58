"""`wattserve device trace`: the real engine on the virtual GPU while the SM clock sweeps.

Keeps a fixed number of requests in flight (closed loop) through the real engine,
stretched by the virtual GPU, and locks the simulated SM clock at points of its ladder
in turn. For each clock it records output tok/s, energy from the counter delta, mean
power, temperature and J/token, writes a CSV and PNG plots, and prints one JSON line
last. It runs only on the virtual GPU (a real GPU's clocks are not this tool's to set).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClockPoint:
    clock_mhz: int
    seconds: float
    tokens: int
    energy_j: float
    temp_c: float
    reasons: str

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def power_w(self) -> float:
        return self.energy_j / self.seconds

    @property
    def j_per_token(self) -> float:
        return self.energy_j / self.tokens if self.tokens else float("inf")


def sweep_clocks(ladder: tuple[int, ...], points: int) -> list[int]:
    """`points` clocks spread over the ladder, lowest and highest included."""
    if points >= len(ladder):
        return list(ladder)
    step = (len(ladder) - 1) / (points - 1)
    return sorted({ladder[round(i * step)] for i in range(points)})


def run_trace(args: argparse.Namespace) -> list[ClockPoint]:
    # Imported here so that `wattserve --help` does not pay for torch.
    from wattserve.daemon.config import DeviceConfig, default_cache_dir
    from wattserve.daemon.device import open_device
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.loader import load_model

    loaded = load_model(args.model, default_cache_dir(), "float32")
    engine = Engine(loaded, EngineOptions(max_num_seqs=args.batch, kv_cache_bytes=1 << 30))
    with tempfile.TemporaryDirectory() as state_dir:
        device = open_device(
            DeviceConfig(backend="virtual", mode="control", state_dir=Path(state_dir)),
        )
        try:
            return _sweep(args, engine, device)
        finally:
            device.close(restore=True)


def _sweep(args, engine, device) -> list[ClockPoint]:
    from wattserve.bench.engine import corpus_token_ids
    from wattserve.daemon.coupling import device_step_hook
    from wattserve.daemon.device import energy_between_j
    from wattserve.daemon.engine.request import SamplingParams

    engine.add_step_hook(device_step_hook(engine, device))
    ids = corpus_token_ids(engine.tokenizer, 4096)
    rng = random.Random(0)
    next_start = 0

    def submit() -> None:
        # Lengths vary so requests finish at different steps: a steady mix, not waves.
        nonlocal next_start
        prompt = ids[next_start : next_start + args.prompt_tokens]
        next_start = (next_start + 97) % (len(ids) - args.prompt_tokens)
        new = rng.randint(args.new_tokens // 2, args.new_tokens * 3 // 2)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params, on_output)

    def on_output(out) -> None:
        if out.finished:
            submit()  # closed loop: a finished request is replaced at once

    for _ in range(args.batch):
        submit()
    warm_until = time.monotonic() + 3.0
    while time.monotonic() < warm_until:
        engine.step()
    ladder = device.read().sm_clock_ladder_mhz
    clocks = sweep_clocks(ladder, args.points)
    per_clock_s = args.seconds / len(clocks)
    points = []
    for clock in reversed(clocks):  # from the top, as a controller would walk down
        device.lock_sm_clocks_mhz(clock, clock)
        settle_until = time.monotonic() + min(1.0, per_clock_s / 4)
        while time.monotonic() < settle_until:
            engine.step()
        before = device.read()
        tokens0 = engine.counters.generation_tokens
        t0 = time.monotonic()
        while time.monotonic() - t0 < per_clock_s:
            engine.step()
        after = device.read()
        elapsed = time.monotonic() - t0
        point = ClockPoint(
            clock_mhz=clock,
            seconds=elapsed,
            tokens=engine.counters.generation_tokens - tokens0,
            energy_j=energy_between_j(before, after),
            temp_c=after.gpu_temp_c or 0.0,
            reasons="|".join(after.clock_event_reasons),
        )
        print(
            f"{clock:5d} MHz: {point.tok_s:7.1f} tok/s, {point.power_w:6.1f} W, "
            f"{point.j_per_token:7.3f} J/token, {point.temp_c:5.1f} C {point.reasons}",
            flush=True,
        )
        points.append(point)
    engine.stop()
    return sorted(points, key=lambda p: p.clock_mhz)


def write_csv(points: list[ClockPoint], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "sm_clock_mhz",
                "seconds",
                "output_tokens",
                "tok_s",
                "energy_j",
                "power_w",
                "j_per_token",
                "gpu_temp_c",
                "clock_event_reasons",
            ]
        )
        for p in points:
            w.writerow(
                [
                    p.clock_mhz,
                    f"{p.seconds:.3f}",
                    p.tokens,
                    f"{p.tok_s:.2f}",
                    f"{p.energy_j:.2f}",
                    f"{p.power_w:.2f}",
                    f"{p.j_per_token:.4f}",
                    f"{p.temp_c:.2f}",
                    p.reasons,
                ]
            )


def write_plots(points: list[ClockPoint], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clocks = [p.clock_mhz for p in points]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    series = [
        (axes[0][0], [p.power_w for p in points], "mean power (W)"),
        (axes[0][1], [p.temp_c for p in points], "GPU temperature at end (°C)"),
        (axes[1][0], [p.tok_s for p in points], "output tok/s"),
        (axes[1][1], [p.j_per_token for p in points], "energy per output token (J)"),
    ]
    for ax, ys, label in series:
        ax.plot(clocks, ys, marker="o")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("locked SM clock (MHz)")
    best = min(points, key=lambda p: p.j_per_token)
    axes[1][1].axvline(
        best.clock_mhz, color="tab:green", linestyle="--", label=f"minimum at {best.clock_mhz} MHz"
    )
    axes[1][1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seconds", type=float, default=60.0, help="sweep length, all clocks")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the CSV and plot go (default: <cache>/bench/device-trace)",
    )
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--batch", type=int, default=16, help="requests kept in flight")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--points", type=int, default=8, help="clocks on the sweep")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wattserve device trace", description=__doc__)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from wattserve.bench import output_dir

    args.out = args.out or output_dir("device-trace")
    args.out.mkdir(parents=True, exist_ok=True)
    points = run_trace(args)
    csv_path, png_path = args.out / "device-trace.csv", args.out / "device-trace.png"
    write_csv(points, csv_path)
    write_plots(
        points,
        png_path,
        f"virtual H200, real engine, {args.batch} requests in flight, {args.seconds:.0f} s sweep",
    )
    best = min(points, key=lambda p: p.j_per_token)
    top = max(points, key=lambda p: p.clock_mhz)
    print(f"wrote {csv_path} and {png_path}")
    print(
        json.dumps(
            {
                "min_j_per_token_clock_mhz": best.clock_mhz,
                "j_per_token_at_max_clock": round(top.j_per_token, 4),
                "j_per_token_min": round(best.j_per_token, 4),
                "batch": args.batch,
                "seconds": args.seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
