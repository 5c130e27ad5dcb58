"""Connects the engine's step statistics to the device: the virtual GPU's clock stretch.

A step hook turns each StepStats into the EngineActivity the device prices (FLOPs from
the model's shape, bytes from the weights and KV read), books it, and sleeps for the
extra time a lower simulated clock costs, so the engine really slows down. It must not
schedule, sample or change any device setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from wattserve.daemon.device.protocol import EngineActivity


def step_flops(shape, stats, kv_bytes_per_token: int) -> float:
    """FLOPs of one step: 2 x linear parameters per token, the LM head per decoded token,
    and attention over the context each token reads (4 x layers x heads x head_dim each)."""
    q_dim = shape.num_heads * shape.head_dim
    kv_dim = shape.num_kv_heads * shape.head_dim
    per_layer = shape.hidden_size * (q_dim + 2 * kv_dim) + q_dim * shape.hidden_size
    per_layer += 3 * shape.hidden_size * shape.intermediate_size
    tokens = stats.prefill_tokens + stats.decode_tokens
    linear = 2.0 * shape.num_layers * per_layer * tokens
    head = 2.0 * shape.hidden_size * shape.vocab_size * max(stats.decode_tokens, 1)
    context_tokens = stats.kv_bytes_read / kv_bytes_per_token
    attention = 4.0 * shape.num_layers * q_dim * context_tokens
    return linear + head + attention


def step_activity(engine) -> Callable[[object], EngineActivity]:
    """A function from one of `engine`'s StepStats to the EngineActivity a device prices."""
    shape = engine.model.shape
    kv_bytes_per_token = engine.kv_spec.bytes_per_block // engine.kv_spec.block_size_tokens

    def activity(stats) -> EngineActivity:
        return EngineActivity(
            step_duration_s=stats.duration_s,
            prefill_tokens=stats.prefill_tokens,
            decode_tokens=stats.decode_tokens,
            weight_bytes_read=stats.weight_bytes,
            kv_bytes_read=stats.kv_bytes_read,
            flops=step_flops(shape, stats, kv_bytes_per_token),
        )

    return activity


def device_step_hook(engine, device, sleep: Callable[[float], None] = time.sleep):
    """A hook for engine.add_step_hook that books each step on `device` and waits."""
    activity = step_activity(engine)

    def hook(stats) -> None:
        extra_s = device.record_engine_step(activity(stats))
        if extra_s > 0:
            sleep(extra_s)

    return hook
