"""One chat through the whole stack with the real SmolLM2-135M-Instruct model.

The official openai client asks a question with a one-word answer that this small model
gets right; greedy decoding makes the answer reproducible.
"""

from __future__ import annotations

import openai
import pytest

from tests.api_server import api_config, running_server

pytestmark = pytest.mark.real_model


def test_real_model_answers_sensibly(real_model) -> None:
    cfg = api_config(engine={"kv_cache_bytes": 64 << 20, "max_model_len": 1024})
    with running_server(cfg, real_model) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        text = answer.choices[0].message.content
        assert "Paris" in text, text
        assert answer.choices[0].finish_reason in ("stop", "length")
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == text
