"""`wattserve bench quant`: speed and quality of each weight quantization level.

One process, one engine, the same weights switched between levels with
Engine.set_quant_level(): per level, perplexity on an English text file that the Python
installation ships (read at run time and named in the output; nothing is downloaded or
kept in the repo), greedy agreement with the full-precision level over 32 prompts x 64
tokens, prefill tok/s (the perplexity passes, 512 tokens each), decode tok/s
single-stream and at batch 16 (levels interleaved over rounds, best round kept), and
the level's weight bytes. With --prompts-file, also each level's accuracy on a
multiple-choice file, served through the daemon's HTTP API and scored by
lm-evaluation-harness (wattserve/bench/quant_accuracy.py). The table is saved in the cache
directory, where the daemon reads it for the controller (wattserve/daemon/quant_table.py stores and
reads it); the last line printed is one JSON object. This module's top level imports no torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

from wattserve.bench.quant_accuracy import (
    EXAMPLE_PROMPTS_FILE,
    PromptsFileError,
    accuracy_by_level,
    read_prompts_file,
)
from wattserve.daemon.quant_table import (
    QUALITY_TABLE_VERSION,
    quality_table_path,
    save_quality_table,
)

DEFAULT_LEVELS = ("fp32", "bf16", "int8", "int4", "int4-g128")
PPL_WINDOW_TOKENS = 512


# ---- measurements --------------------------------------------------------------------


def eval_text_file() -> Path:
    """An English text the Python installation ships (its licence file)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = [
        stdlib / "LICENSE.txt",
        Path(sys.base_prefix) / "LICENSE.txt",
        stdlib / "idlelib" / "NEWS.txt",
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError("no licence or NEWS text in this Python installation; use --text")


def sequence_logits(model, ids: list[int]):
    """float32 logits [T, vocab] of every position of one sequence run from position 0.

    Runs the model's own prepare/forward (so the active level's kernels are what is
    measured) over blocks 0.. of its KV cache: only for an idle engine.
    """
    import dataclasses

    import torch

    from wattserve.daemon.engine.scheduler import ScheduledChunk, Sequence

    chunk = ScheduledChunk(Sequence("ppl", list(ids)), 0, len(ids), True)
    table = list(range(-(-len(ids) // model.block_size)))
    inputs = model.prepare([chunk], {"ppl": table})
    inputs = dataclasses.replace(inputs, logits_indices=torch.arange(len(ids)))
    return model.forward(inputs)


def perplexity(model, ids: list[int], window: int = PPL_WINDOW_TOKENS) -> float:
    """exp(mean next-token NLL) over non-overlapping windows, each from position 0."""
    import torch

    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        logits = sequence_logits(model, chunk)  # [T, vocab]
        targets = torch.tensor(chunk[1:], dtype=torch.long)
        nll += torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy_outputs(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, _params(new_tokens))]


def greedy_agreement_pct(reference: list[list[int]], outputs: list[list[int]]) -> float:
    """Share of generated tokens before each output's first divergence from the reference."""
    agree = total = 0
    for ref, out in zip(reference, outputs, strict=True):
        total += len(ref)
        for a, b in zip(ref, out, strict=False):
            if a != b:
                break
            agree += 1
    return 100.0 * agree / total


class DecodeTimer:
    """A step hook that, while armed, records the steps that only decode a full batch."""

    def __init__(self) -> None:
        self.batch = 0
        self.steps: list[tuple[float, float, int]] = []  # (start_s, duration_s, tokens)

    def __call__(self, stats) -> None:
        if self.batch and stats.prefill_tokens == 0 and stats.decode_tokens == self.batch:
            self.steps.append((stats.started_at_s, stats.duration_s, stats.decode_tokens))


def decode_tok_s(engine, timer: DecodeTimer, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tok/s over the steps that only decode (every prompt admitted and prefilled),
    wall clock from the end of the first such step to the end of the last one."""
    timer.batch, timer.steps = len(prompts), []
    try:
        engine.generate(prompts, _params(new_tokens))
    finally:
        timer.batch = 0
    steps = timer.steps
    if len(steps) < 2:
        return float("nan")
    span = steps[-1][0] + steps[-1][1] - (steps[0][0] + steps[0][1])
    return sum(n for _, _, n in steps[1:]) / span


def measure_quality(engine, level: str, ppl_ids, prompts, new_tokens: int) -> dict:
    """Switch to `level` (building it) and measure perplexity and greedy outputs."""
    t0 = time.perf_counter()
    engine.set_quant_level(level)
    prepare_s = time.perf_counter() - t0
    engine.generate([prompts[0][:8]], _params(4))  # applies the level; warms it up
    t0 = time.perf_counter()
    ppl = perplexity(engine.model, ppl_ids)
    prefill_tok_s = len(ppl_ids) / (time.perf_counter() - t0)
    return {
        "ppl": ppl,
        "outputs": greedy_outputs(engine, prompts, new_tokens),
        "prefill_tok_s": prefill_tok_s,
        "prepare_s": prepare_s,
    }


def measure_speed(engine, timer, levels, prompts, new_tokens: int, rounds: int) -> dict:
    """Decode tok/s per level at batch 1 and 16: levels interleaved round by round, the
    best round kept, so that load from other processes on the machine, which comes and
    goes, does not land on one level more than on another."""
    best = {lvl: {"decode_tok_s_bs1": 0.0, "decode_tok_s_bs16": 0.0} for lvl in levels}
    batches = {"decode_tok_s_bs1": [prompts[0]], "decode_tok_s_bs16": prompts[:16]}
    for r in range(rounds):
        for level in levels:
            engine.set_quant_level(level)
            engine.generate([prompts[0][:8]], _params(2))  # applies the level
            got = {k: decode_tok_s(engine, timer, b, new_tokens) for k, b in batches.items()}
            for key, value in got.items():
                best[level][key] = max(best[level][key], value)
            print(
                f"  speed round {r + 1}/{rounds} {level:>9}: "
                + ", ".join(
                    f"{k.removeprefix('decode_tok_s_')} {v:.1f} tok/s" for k, v in got.items()
                ),
                flush=True,
            )
    return best


def _params(n: int):
    from wattserve.daemon.engine.request import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="wattserve bench quant", description=__doc__)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--levels", default=",".join(DEFAULT_LEVELS))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=None, help="cap on perplexity tokens")
    ap.add_argument("--text", type=Path, default=None, help="perplexity text file")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds")
    ap.add_argument("--no-save", action="store_true", help="do not write the quality table")
    ap.add_argument(
        "--prompts-file",
        type=Path,
        nargs="?",
        const=EXAMPLE_PROMPTS_FILE,
        default=None,
        metavar="JSONL",
        help="multiple-choice items to score each level on through the HTTP API "
        "(docs/quant.md); without a path, the example shipped in wattserve/bench/data",
    )
    ap.add_argument(
        "--accuracy-only",
        action="store_true",
        help="with --prompts-file: only the accuracy pass (no perplexity, greedy or speed "
        "measurements; no table saved)",
    )
    return ap


def _error(message: str) -> int:
    print(f"wattserve bench quant: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    import torch

    from wattserve.daemon.config import default_cache_dir
    from wattserve.kernels.quant import full_precision_level

    args = build_parser().parse_args(argv)
    items = None
    if args.accuracy_only and args.prompts_file is None:
        return _error("--accuracy-only needs --prompts-file")
    if args.prompts_file is not None:
        try:
            items = read_prompts_file(args.prompts_file)
        except PromptsFileError as e:
            return _error(str(e))
        if importlib.util.find_spec("lm_eval") is None:
            return _error(
                "--prompts-file needs lm-evaluation-harness: pip install 'wattserve[bench]'"
            )
    if args.threads:
        torch.set_num_threads(args.threads)

    cache_dir = default_cache_dir()
    full = full_precision_level(getattr(torch, args.dtype))
    levels = [full] + [lv for lv in args.levels.split(",") if lv and lv != full]
    if args.accuracy_only:
        table = {
            "model": args.model,
            "full_precision": full,
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
        }
    else:
        table = levels_table(args, cache_dir, levels)  # its engine is freed on return
    if items is not None:
        from wattserve.bench.serve import model_directory

        t0 = time.perf_counter()
        served, accuracy = accuracy_by_level(
            items,
            levels,
            args.model,
            model_directory(args.model, cache_dir),
            args.dtype,
            torch.get_num_threads(),
            log=lambda line: print(line, flush=True),
        )
        if args.accuracy_only:
            table["model"] = served  # the name the server gives the model
        table["accuracy"] = {
            "prompts_file": str(args.prompts_file),
            "items": len(items),
            "reference_level": levels[0],
            "levels": accuracy,
            "elapsed_s": round(time.perf_counter() - t0, 1),  # server start included
        }
    if not (args.no_save or args.accuracy_only):
        path = quality_table_path(cache_dir, table["model"])
        save_quality_table(path, table)
        table["table_path"] = str(path)
    print(json.dumps(table))
    return 0


def levels_table(args: argparse.Namespace, cache_dir: Path, levels: list[str]) -> dict:
    """The speed and quality table of `levels` (the full-precision level first)."""
    import torch

    from wattserve.bench.engine import make_workload
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.loader import load_model

    loaded = load_model(args.model, cache_dir, args.dtype)
    tok = loaded.tokenizer
    full = levels[0]
    text_path = args.text or eval_text_file()
    ppl_ids = tok.encode(text_path.read_text(errors="replace"), add_special_tokens=False)
    ppl_ids = ppl_ids[: args.ppl_tokens] if args.ppl_tokens else ppl_ids
    prompts = make_workload(tok, args.prompts, 16, 64, args.seed)
    engine = Engine(
        loaded,
        EngineOptions(
            max_num_seqs=max(64, args.prompts),
            max_num_batched_tokens=2048,
            kv_cache_bytes=2**28,
            quantization_levels=tuple(levels),
        ),
    )
    print(
        f"perplexity text: {text_path} ({len(ppl_ids)} tokens, windows of {PPL_WINDOW_TOKENS}); "
        f"greedy: {len(prompts)} prompts x {args.new_tokens} tokens; {args.dtype}, "
        f"{torch.get_num_threads()} threads; levels {', '.join(levels)}",
        flush=True,
    )
    timer = DecodeTimer()
    engine.add_step_hook(timer)
    rows: dict[str, dict] = {}
    reference: list[list[int]] | None = None
    for level in levels:
        m = measure_quality(engine, level, ppl_ids, prompts, args.new_tokens)
        reference = reference or m["outputs"]
        base_ppl = rows[full]["ppl"] if rows else m["ppl"]
        rows[level] = {
            "ppl": round(m["ppl"], 4),
            "ppl_increase_pct": round(100.0 * (m["ppl"] / base_ppl - 1.0), 3),
            "greedy_agreement_pct": round(greedy_agreement_pct(reference, m["outputs"]), 2),
            "weight_mb": round(engine.model.level_bytes(level) / 1e6, 2),
            "prefill_tok_s": round(m["prefill_tok_s"], 1),
        }
        r = rows[level]
        print(
            f"{level:>9}: ppl {r['ppl']:.3f} ({r['ppl_increase_pct']:+.2f}%), greedy agreement "
            f"{r['greedy_agreement_pct']:.1f}%, weights {r['weight_mb']:.1f} MB, prefill "
            f"{r['prefill_tok_s']:.0f} tok/s (built in {m['prepare_s']:.1f} s)",
            flush=True,
        )
    speed = measure_speed(engine, timer, levels, prompts, args.new_tokens, args.rounds)
    base = speed[full]["decode_tok_s_bs1"]
    for level, row in rows.items():
        row.update({k: round(v, 2) for k, v in speed[level].items()})
        row["speedup_bs1"] = round(row["decode_tok_s_bs1"] / base, 3)
        print(
            f"{level:>9}: decode {row['decode_tok_s_bs1']:.1f} tok/s bs1 "
            f"(x{row['speedup_bs1']:.2f}), {row['decode_tok_s_bs16']:.1f} tok/s bs16",
            flush=True,
        )
    table = {
        "version": QUALITY_TABLE_VERSION,
        "model": loaded.name,
        "full_precision": full,
        "text_file": str(text_path),
        "ppl_tokens": len(ppl_ids),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "speed_rounds": args.rounds,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "levels": rows,
    }
    return table


if __name__ == "__main__":
    raise SystemExit(main())
