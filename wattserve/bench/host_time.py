"""Host CPU time per engine step with the model's forward stubbed (`bench host`'s host_ms).

A real Engine runs on the CPU over a one-layer random Llama whose forward is replaced by a
stub: it returns a slice of logits computed once before timing ([rows, vocab] float32,
one-hot rows that pick varied ordinary tokens, a different tensor each step of a cycle),
so the device's work costs ~nothing and what is left is the host's: intake, scheduling,
the step's input layout and its upload, the (real) sampler over those logits and its
read-back, token checks, incremental detokenization with the embedded SmolLM2 tokenizer,
and delivery through the API's own LoopDelivery onto an asyncio loop on a second thread
where one consumer task per request takes each event and keeps its text.

B sequences (1, 64, 256) decode with prompts of a few hundred distinct tokens, greedy,
ignore_eos and a max_tokens they never reach; after their prefill and warm-up steps,
windows of steps are timed with time.process_time() (the process's CPU time, every thread
included, so work moved to the delivery thread still counts), with torch on one thread
(idle OpenMP workers would spin CPU time into the figure). The figure is the median over
windows of CPU ms per step. It measures; it decides nothing and needs no GPU.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import statistics
import threading
import time
from dataclasses import dataclass

import torch

BATCHES = (1, 64, 256)
PROMPT_TOKENS = 320
WARMUP_STEPS = 20
WINDOW_STEPS = 20
WINDOWS = 12  # 240 timed steps
# The stubbed model's vocabulary: the tokenizer's first ids (SmolLM2: bytes and common
# merges), small so that the real sampler's argmax over the stub's logits is cheap.
VOCAB = 512
FIRST_ORDINARY_ID = 100  # below: special tokens and control bytes
LOGIT_CYCLE = 8  # distinct stub logits tensors, one per step in turn


@dataclass
class HostTime:
    batch: int
    ms_per_step: float  # median over windows of process CPU ms per step
    window_ms: list[float]
    steps_timed: int
    events_delivered: int  # taken by the consumer tasks, warm-up and the final aborts included
    text_chars: int  # of text those events carried


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def embedded_tokenizer():
    """SmolLM2's tokenizer, read from the embedded GGUF (no weights are loaded)."""
    from transformers import AutoTokenizer

    from wattserve.daemon.engine.loader import embedded_gguf_path

    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def stub_engine(tokenizer, max_num_seqs: int, max_model_len: int, stub=None):
    """An Engine on the CPU over a 1-layer random Llama of VOCAB ids (a tokenizer with at
    least that many) whose forward is `stub` (default: StubForward); returns
    (engine, stub). The KV pool holds max_num_seqs sequences of max_model_len tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.loader import LoadedModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_model_len,
        eos_token_id=tokenizer.eos_token_id,
    )
    loaded = LoadedModel(
        LlamaForCausalLM(cfg).eval(), tokenizer, "stub", None, torch.float32, 0.0, False
    )
    # 1 layer x 16 tokens x 1 KV head x 16 dims x K and V x 4 bytes = 4 KiB a block
    blocks = max_num_seqs * (-(-max_model_len // 16)) + 16
    options = EngineOptions(
        kv_cache_bytes=blocks * 4096,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        overlap_detokenize=True,  # the CUDA path: step N+1 launched before N's text
    )
    engine = Engine(loaded, options, "cpu")
    stub = stub or StubForward(max_num_seqs)
    engine.model.forward = stub
    return engine, stub


class StubForward:
    """Stands in for LlamaModel.forward: a slice of one of LOGIT_CYCLE [rows, VOCAB] tensors
    made up front, each row one-hot at an ordinary token id (>= FIRST_ORDINARY_ID) that
    changes from step to step and, with vary_rows, from row to row (without: every row of
    a step gets the same token, so each sequence costs the host the same)."""

    def __init__(self, max_rows: int, vary_rows: bool = True, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.logits = []
        for _ in range(LOGIT_CYCLE):
            t = torch.zeros(max_rows, VOCAB)
            picks = [rng.randrange(FIRST_ORDINARY_ID, VOCAB) for _ in range(max_rows)]
            if not vary_rows:
                picks = [picks[0]] * max_rows
            t[torch.arange(max_rows), torch.tensor(picks)] = 1.0
            self.logits.append(t)
        self.calls = 0

    def __call__(self, inp) -> torch.Tensor:
        self.calls += 1
        rows = inp.logits_indices.shape[0]
        return self.logits[self.calls % LOGIT_CYCLE][:rows]


class ApiLikeConsumers:
    """The API's delivery path without HTTP: LoopDelivery onto an asyncio loop on its own
    thread, one EventQueue (the API's GenerationStream's) and consumer task per request
    that keeps the text."""

    def __init__(self) -> None:
        from wattserve.daemon.api.generation import LoopDelivery

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.delivery = LoopDelivery(self.loop)
        self.texts: dict[str, list[str]] = {}
        self.events = 0

    def sink_for(self, rid: str):
        from wattserve.daemon.api.generation import EventQueue

        queue = EventQueue()
        self.texts[rid] = parts = []
        asyncio.run_coroutine_threadsafe(self._consume(queue, parts), self.loop)
        return queue.put_nowait

    async def _consume(self, queue, parts: list[str]) -> None:
        while True:
            out = await queue.get()
            self.events += 1
            parts.append(out.text)
            if out.finished:
                return

    def settle(self) -> None:
        """Wait (without CPU) until the loop has run what was delivered so far."""

        async def turns() -> None:
            for _ in range(3):
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(turns(), self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)


def start_sequences(engine, consumers: ApiLikeConsumers, batch: int, max_tokens: int) -> None:
    from wattserve.daemon.engine.request import SamplingParams

    rng = random.Random(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(FIRST_ORDINARY_ID, VOCAB) for _ in range(PROMPT_TOKENS)]
        rid = f"r{i}"
        engine.add_request(prompt, params, consumers.sink_for(rid), request_id=rid)


def measure_batch(tokenizer, batch: int) -> HostTime:
    steps = WARMUP_STEPS + WINDOWS * WINDOW_STEPS
    max_tokens = steps + 64
    engine, _ = stub_engine(tokenizer, batch, PROMPT_TOKENS + max_tokens + 16)
    consumers = ApiLikeConsumers()
    engine.set_delivery(consumers.delivery)
    try:
        start_sequences(engine, consumers, batch, max_tokens)
        while engine.num_waiting or engine.num_running < batch or _prefilling(engine):
            engine.step()
        for _ in range(WARMUP_STEPS):
            engine.step()
        consumers.settle()
        window_ms = []
        for _ in range(WINDOWS):
            t0 = time.process_time()
            for _ in range(WINDOW_STEPS):
                engine.step()
            consumers.settle()
            window_ms.append((time.process_time() - t0) * 1e3 / WINDOW_STEPS)
        if engine.num_running != batch:
            raise RuntimeError(f"{engine.num_running} of {batch} sequences still decoding")
    finally:
        engine.stop()
        consumers.settle()
        consumers.close()
    return HostTime(
        batch,
        statistics.median(window_ms),
        window_ms,
        WINDOWS * WINDOW_STEPS,
        consumers.events,
        sum(len(t) for parts in consumers.texts.values() for t in parts),
    )


def _prefilling(engine) -> bool:
    return any(s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running)


def measure(batches: tuple[int, ...] = BATCHES) -> dict:
    """host_ms_per_step_bs{B} for each batch and the note that says how they were taken."""
    tokenizer = embedded_tokenizer()
    out: dict = {}
    threads = torch.get_num_threads()
    # One thread: torch's CPU ops on the stub's logits (the device's work on a GPU) stay
    # small, and no idle intra-op worker spins CPU time into the figure.
    torch.set_num_threads(1)
    try:
        for b in batches:
            r = measure_batch(tokenizer, b)
            out[f"host_ms_per_step_bs{b}"] = round(r.ms_per_step, 4)
    finally:
        torch.set_num_threads(threads)
    load1, load5, _ = os.getloadavg()
    out["host_ms_note"] = (
        f"process CPU time (all threads) per engine step, median of {WINDOWS} windows of "
        f"{WINDOW_STEPS} decode steps after {WARMUP_STEPS} warm-up; forward stubbed "
        f"(precomputed [rows, {VOCAB}] logits), real sampler, SmolLM2 tokenizer "
        f"detokenizing, API delivery onto an asyncio thread; prompts {PROMPT_TOKENS} tokens; "
        f"CPU {cpu_model()} x{os.cpu_count()}, load average {load1:.2f}/{load5:.2f} (1/5 min) "
        "at the end, torch threads 1"
    )
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure()))
