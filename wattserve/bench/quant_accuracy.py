"""`wattserve bench quant --prompts-file`: each level's accuracy on a multiple-choice file.

The file is JSONL, one item a line: {"context": str, "choices": [str, ...], "answer": int}
(the index of the right choice; each choice is appended to the context as written).
`read_prompts_file` checks every line before anything is loaded and raises
PromptsFileError naming the line. The model is served by `wattserve serve` on a free
loopback port (one server; the level switched between passes with PUT
/v1/control/knobs, the daemon's own way, and read back from /v1/status), and
lm-evaluation-harness scores the items as a task through its `local-completions` client:
a log-likelihood request per (context, choice) through /v1/completions, the served model's
own tokenizer read from its directory. Per level: lm-eval's acc and acc_norm, the mean
log-likelihood of the right choices, the share of items whose chosen answer (highest
log-likelihood) is the first level's, and the item count.

It must not load the model in this process, nor download anything (the hub is off for
lm-eval and `datasets`). Plain-text items (rolling log-likelihood) are not taken: the
bench's --text perplexity already covers them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

EXAMPLE_PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "quant-prompts-example.jsonl"
EXAMPLE_ITEMS = 48
LM_EVAL_BATCH = 4  # (context, choice) pairs per /v1/completions request
SWITCH_TIMEOUT_S = 600.0  # building int4 took ~50 s on a loaded 2-core machine
TASK = "wattserve_prompts_file"


class PromptsFileError(ValueError):
    """A prompts file that cannot be scored; the message names the file and the line."""


# ---- the file ------------------------------------------------------------------------


def _check_item(item: Any) -> str | None:
    """Why one parsed line is not an item (None when it is one)."""
    if not isinstance(item, dict):
        return "not a JSON object"
    missing = [k for k in ("context", "choices", "answer") if k not in item]
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    context, choices, answer = item["context"], item["choices"], item["answer"]
    if not isinstance(context, str) or not context:
        return "context is not a non-empty string"
    if not isinstance(choices, list) or len(choices) < 2:
        return "choices is not a list of at least 2 strings"
    if not all(isinstance(c, str) and c for c in choices):
        return "choices holds something other than non-empty strings"
    if isinstance(answer, bool) or not isinstance(answer, int):
        return f"answer is not an integer: {answer!r}"
    if not 0 <= answer < len(choices):
        return f"answer {answer} is out of range for {len(choices)} choices (0-based)"
    return None


def read_prompts_file(path: Path) -> list[dict[str, Any]]:
    """The items of a JSONL prompts file (blank lines skipped), keys other than the three
    dropped; raises PromptsFileError at the first line that is not an item, or if none is."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptsFileError(f"{path}: cannot read: {e}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptsFileError(f"{path}, line {number}: not JSON: {e.msg}") from None
        why = _check_item(item)
        if why:
            raise PromptsFileError(f"{path}, line {number}: {why}")
        items.append({k: item[k] for k in ("context", "choices", "answer")})
    if not items:
        raise PromptsFileError(f"{path}: no items (one JSON object a line)")
    return items


def licence_items(
    text: str, count: int, seed: int = 0, context_words: int = 12, choice_words: int = 5
) -> list[dict[str, Any]]:
    """Up to `count` items cut from a text: a sentence's first words, its true next words
    and the words at the same place in three other sentences, shuffled (fixed seed). Builds
    the example file from the Python installation's licence text."""
    sentences = re.split(r"(?<=[.;:])\s+", " ".join(text.split()))
    long = [s.split() for s in sentences if len(s.split()) >= context_words + choice_words]

    def span(words: list[str]) -> str:
        return " " + " ".join(words[context_words : context_words + choice_words])

    by_span = {span(s): s for s in long}  # one sentence per continuation
    spans = sorted(by_span)
    rng = random.Random(seed)
    items = []
    for gold in rng.sample(spans, min(count, len(spans))):
        choices = [gold, *rng.sample([s for s in spans if s != gold], 3)]
        rng.shuffle(choices)
        context = " ".join(by_span[gold][:context_words])
        items.append({"context": context, "choices": choices, "answer": choices.index(gold)})
    return items


# ---- scoring through the API ---------------------------------------------------------


def _task_files(items: list[dict[str, Any]], workdir: Path) -> None:
    """The items and an lm-eval task over them (a YAML file; JSON is valid YAML)."""
    data = workdir / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items), encoding="utf-8")
    task = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {"test": str(data)},
            "cache_dir": str(workdir / "datasets"),
        },
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "target_delimiter": "",
        "metric_list": [
            {"metric": m, "aggregation": "mean", "higher_is_better": True}
            for m in ("acc", "acc_norm")
        ],
    }
    (workdir / f"{TASK}.yaml").write_text(json.dumps(task, indent=1), encoding="utf-8")


@contextmanager
def _quiet_offline() -> Iterator[None]:
    """For lm-eval and `datasets`: no hub, and warnings only in the log (restored after)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    saved_env = {name: os.environ.get(name) for name in names}
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval", "httpx", "datasets")]
    saved_levels = [lg.level for lg in loggers]
    os.environ.update({name: "1" for name in names})
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for lg, level in zip(loggers, saved_levels, strict=True):
            lg.setLevel(level)


def score_items(
    base_url: str,
    model_name: str,
    tokenizer_dir: Path,
    items: list[dict[str, Any]],
    max_length: int,
) -> dict[str, Any]:
    """lm-eval's local-completions over the items against one server: acc, acc_norm,
    the mean log-likelihood of the right choices and the chosen answer of each item."""
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(
        base_url=base_url + "/v1/completions",
        model=model_name,
        tokenizer=str(tokenizer_dir),  # the served model's own files: never the hub
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        batch_size=LM_EVAL_BATCH,
        max_length=max_length,
        max_retries=1,
    )
    with tempfile.TemporaryDirectory(prefix="wattserve-quant-acc-") as tmp, _quiet_offline():
        _task_files(items, Path(tmp))
        out = simple_evaluate(
            model=lm,
            tasks=[TASK],
            task_manager=TaskManager(include_path=tmp, include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
    metrics = out["results"][TASK]
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    if len(samples) != len(items):
        raise RuntimeError(f"lm-eval scored {len(samples)} of {len(items)} items")
    chosen, gold_ll = [], []
    for sample, item in zip(samples, items, strict=True):
        lls = [float(resp[0][0]) for resp in sample["resps"]]
        chosen.append(max(range(len(lls)), key=lls.__getitem__))
        gold_ll.append(lls[item["answer"]])
    return {
        "acc": float(metrics["acc,none"]),
        "acc_norm": float(metrics["acc_norm,none"]),
        "gold_loglikelihood_mean": sum(gold_ll) / len(gold_ll),
        "chosen": chosen,
    }


# ---- the server ----------------------------------------------------------------------


class LevelServer:
    """`wattserve serve` on loopback holding the levels asked for; set_level switches."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self._auth = {"Authorization": f"Bearer {token}"}

    def info(self) -> tuple[str, int]:
        card = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]
        return card["id"], int(card["max_model_len"])

    def level(self) -> str:
        status = httpx.get(self.url + "/v1/status", timeout=30).json()
        return status["engine"]["quantization"]["level"]

    def set_level(self, level: str) -> None:
        """PUT the level, then one request so the engine's next step applies it; check it."""
        r = httpx.put(
            self.url + "/v1/control/knobs",
            json={"quant_level": level},
            headers=self._auth,
            timeout=SWITCH_TIMEOUT_S,
        )
        if r.status_code != 200:
            raise RuntimeError(f"switching to {level}: HTTP {r.status_code} {r.text[:300]}")
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=SWITCH_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"request after switching to {level}: HTTP {r.status_code}")
        if (now := self.level()) != level:
            raise RuntimeError(f"the server runs {now} after switching to {level}")


@contextmanager
def serving(model: str, dtype: str, threads: int, levels: list[str]) -> Iterator[LevelServer]:
    """One `wattserve serve` subprocess allowed `levels`, starting at the first."""
    from wattserve.bench.serve import ManagedServer, _env, free_port

    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="wattserve-quant-acc-") as tmp:
        config = Path(tmp) / "serve.toml"
        config.write_text(
            "[engine]\n"
            f"quantization_levels = {json.dumps(levels)}\n"
            f"quantization_level = {json.dumps(levels[0])}\n"
            "[controller]\n"
            'mode = "observe"\n'  # nothing but set_level changes the level
        )
        port = free_port()
        argv = [sys.executable, "-m", "wattserve.daemon.cli", "serve", "--config", str(config)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--model", model]
        argv += ["--dtype", dtype, "--threads", str(threads)]
        env = {**_env(threads), "WATTSERVE_API_TOKEN": token}
        server = ManagedServer("quant-accuracy", argv, port, env)
        try:
            server.wait_ready("/ready")
            yield LevelServer(server.url, token)
        finally:
            server.stop()


def accuracy_by_level(
    items: list[dict[str, Any]],
    levels: list[str],
    model: str,
    tokenizer_dir: Path,
    dtype: str,
    threads: int,
    log: Callable[[str], None] = print,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """The served model's name and, per level: acc, acc_norm, gold log-likelihood,
    agreement with levels[0], items."""
    rows: dict[str, dict[str, Any]] = {}
    reference: list[int] | None = None
    with _quiet_offline(), serving(model, dtype, threads, levels) as server:
        served, max_length = server.info()
        for level in levels:
            server.set_level(level)
            got = score_items(server.url, served, tokenizer_dir, items, max_length)
            reference = reference or got["chosen"]
            same = sum(a == b for a, b in zip(reference, got["chosen"], strict=True))
            rows[level] = {
                "acc": round(got["acc"], 4),
                "acc_norm": round(got["acc_norm"], 4),
                "gold_loglikelihood_mean": round(got["gold_loglikelihood_mean"], 4),
                "agreement_pct": round(100.0 * same / len(items), 2),
                "items": len(items),
            }
            r = rows[level]
            log(
                f"{level:>9}: accuracy {r['acc']:.3f} (normalised {r['acc_norm']:.3f}), "
                f"gold log-likelihood {r['gold_loglikelihood_mean']:.3f}, same answer as "
                f"{levels[0]} on {r['agreement_pct']:.1f}% of {len(items)} items"
            )
    return served, rows


def main(argv: list[str] | None = None) -> int:
    """`python -m wattserve.bench.quant_accuracy OUT`: write the example file from the licence
    text."""
    from wattserve.bench.quant import eval_text_file

    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else EXAMPLE_PROMPTS_FILE
    items = licence_items(eval_text_file().read_text(errors="replace"), count=EXAMPLE_ITEMS)
    out.write_text("".join(json.dumps(it) + "\n" for it in items), encoding="utf-8")
    print(f"{out}: {len(items)} items")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
