"""vLLM's sampling parameters, logprobs, echo, n, batched prompts and /tokenize on a real
server with the tiny random model, through the official openai client (streamed and not).

Logprobs are checked against a direct forward of the same HF model on the same token ids;
penalties, bias, min_tokens and stop ids against what plain greedy decoding does.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.api_server import api_config, running_server

PROMPT = [5, 17, 42, 99, 7, 23]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(api_config(), tiny_llama) as srv:
        yield srv


class _Endpoint:
    """An openai resource whose create() fills in the served model's name."""

    def __init__(self, resource, model: str) -> None:
        self._resource, self._model = resource, model

    def create(self, **kwargs):
        return self._resource.create(model=self._model, **kwargs)


class _Client:
    def __init__(self, base_url: str, model: str) -> None:
        raw = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        self.completions = _Endpoint(raw.completions, model)
        self.chat = type("Chat", (), {"completions": _Endpoint(raw.chat.completions, model)})


@pytest.fixture(scope="module")
def oai(server):
    return _Client(server.base_url, server.engine.model_name)


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def _hf_logprobs(tiny_llama, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-softmax of the HF model's logits at each position (fp32)."""
    with torch.no_grad():
        logits = tiny_llama.hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _hf_greedy(tiny_llama, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = list(ids)
    out, rows = [], []
    for _ in range(steps):
        row = _hf_logprobs(tiny_llama, ids)[-1]
        tok = int(row.argmax())
        out.append(tok)
        rows.append(row)
        ids.append(tok)
    return out, rows


def test_vllm_bench_default_body_is_accepted(client) -> None:
    body = {
        "model": None,
        "prompt": "abc",
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 4,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "best_of": 1,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "early_stopping": False,
        "spaces_between_special_tokens": True,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "min_tokens": 0,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }
    body.pop("model")
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.text.endswith("data: [DONE]\n\n")
    r = client.post("/v1/completions", json={**body, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_completion_logprobs_match_a_direct_forward(oai, tiny_llama) -> None:
    want_ids, rows = _hf_greedy(tiny_llama, PROMPT, 6)
    for stream in (False, True):
        kwargs = dict(
            prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5, extra_body={"ignore_eos": True}
        )
        if stream:
            parts = list(oai.completions.create(stream=True, **kwargs))
            lp = {"token_logprobs": [], "top_logprobs": [], "tokens": [], "text_offset": []}
            for p in parts:
                for c in p.choices:
                    if c.logprobs is not None:
                        for k in lp:
                            lp[k] += getattr(c.logprobs, k)
            text = "".join(c.text for p in parts for c in p.choices)
        else:
            comp = oai.completions.create(**kwargs)
            lp = comp.choices[0].logprobs.model_dump()
            text = comp.choices[0].text
        assert len(lp["token_logprobs"]) == 6
        for i, row in enumerate(rows):
            assert lp["token_logprobs"][i] == pytest.approx(float(row[want_ids[i]]), abs=1e-4)
            # A dict keyed by text: tokens that decode alike (partial UTF-8) share a key.
            want = torch.topk(row, 5).values.tolist()
            top = lp["top_logprobs"][i]
            assert max(top.values()) == pytest.approx(want[0], abs=1e-4)
            assert all(any(abs(v - w) < 1e-4 for w in want) for v in top.values())
        assert lp["tokens"] == [tiny_llama.tokenizer.decode([t]) for t in want_ids]
        assert lp["text_offset"][0] == 0
        assert "".join(lp["tokens"]) == text


def test_chat_logprobs_shape_and_values(oai, tiny_llama) -> None:
    messages = [{"role": "user", "content": "abc de"}]
    prompt = tiny_llama.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    ids = tiny_llama.tokenizer.encode(prompt, add_special_tokens=False)
    want_ids, rows = _hf_greedy(tiny_llama, ids, 4)
    for stream in (False, True):
        kwargs = dict(
            messages=messages,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        if stream:
            content = [
                e
                for p in oai.chat.completions.create(stream=True, **kwargs)
                for c in p.choices
                if c.logprobs is not None
                for e in c.logprobs.content
            ]
        else:
            content = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
        assert len(content) == 4
        for e, tok, row in zip(content, want_ids, rows, strict=True):
            assert e.token == tiny_llama.tokenizer.decode([tok])
            assert e.bytes == list(e.token.encode())
            assert e.logprob == pytest.approx(float(row[tok]), abs=1e-4)
            assert len(e.top_logprobs) == 3
            assert e.top_logprobs[0].logprob == pytest.approx(float(row.max()), abs=1e-4)


def test_logprob_limits(client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_echo_returns_prompt_logprobs(oai, tiny_llama) -> None:
    full = _hf_logprobs(tiny_llama, PROMPT)
    prompt_text = tiny_llama.tokenizer.decode(PROMPT)
    comp = oai.completions.create(prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = comp.choices[0]
    assert c.text == prompt_text
    assert c.finish_reason == "length"
    assert comp.usage.completion_tokens == 0 and comp.usage.prompt_tokens == len(PROMPT)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.token_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        want = float(full[i - 1, PROMPT[i]])
        assert c.logprobs.token_logprobs[i] == pytest.approx(want, abs=1e-4)
    # With generation, streamed: the prompt comes first, then the generated tokens.
    parts = list(
        oai.completions.create(
            prompt=PROMPT,
            max_tokens=3,
            echo=True,
            logprobs=0,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.text for p in parts for ch in p.choices)
    assert text.startswith(prompt_text) and len(text) > len(prompt_text)
    values = [
        v for p in parts for ch in p.choices if ch.logprobs for v in ch.logprobs.token_logprobs
    ]
    assert len(values) == len(PROMPT) + 3 and values[0] is None


def test_prompt_logprobs_survive_chunked_prefill_and_batching(tiny_llama) -> None:
    from wattserve.daemon.engine.engine import Engine, EngineOptions
    from wattserve.daemon.engine.request import SamplingParams

    engine = Engine(
        tiny_llama,
        EngineOptions(kv_cache_bytes=4 << 20, max_model_len=256, max_num_batched_tokens=7),
    )
    long_prompt = [(i * 37) % 400 + 3 for i in range(23)]  # four chunks of at most 7 tokens
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    outs = engine.generate(
        [long_prompt, PROMPT],
        [SamplingParams(**{**params.__dict__, "prompt_logprobs": 3}), params],
    )
    full = _hf_logprobs(tiny_llama, long_prompt + outs[0].token_ids)
    got = outs[0].prompt_logprobs
    assert got is not None and len(got) == len(long_prompt) and got[0] is None
    for i in range(1, len(long_prompt)):
        assert got[i].token_id == long_prompt[i]
        assert got[i].logprob == pytest.approx(float(full[i - 1, long_prompt[i]]), abs=1e-4)
        assert len(got[i].top) == 3
    for j, lp in enumerate(outs[0].logprobs):
        pos = len(long_prompt) - 1 + j
        assert lp.logprob == pytest.approx(float(full[pos, outs[0].token_ids[j]]), abs=1e-4)
    assert outs[1].prompt_logprobs is None and len(outs[1].logprobs) == 3


def test_max_tokens_zero_needs_echo(client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _greedy(oai, max_tokens: int = 16, **extra):
    return oai.completions.create(
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    ).choices[0]


def test_penalties_stop_greedy_repetition(oai, tiny_llama) -> None:
    plain = _hf_greedy(tiny_llama, PROMPT, 24)[0]
    first_repeat = next(i for i, t in enumerate(plain) if t in plain[:i])
    assert first_repeat < 10, "greedy decoding of this prompt repeats a token early"
    plain_tokens = [tiny_llama.tokenizer.decode([t]) for t in plain]
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        for stream in (False, True):
            kwargs = dict(
                prompt=PROMPT,
                max_tokens=24,
                temperature=0,
                logprobs=0,
                **{k: v for k, v in extra.items() if k != "extra_body"},
                extra_body={"ignore_eos": True, **extra.get("extra_body", {})},
            )
            if stream:
                tokens = [
                    t
                    for p in oai.completions.create(stream=True, **kwargs)
                    for c in p.choices
                    if c.logprobs
                    for t in c.logprobs.tokens
                ]
            else:
                tokens = oai.completions.create(**kwargs).choices[0].logprobs.tokens
            assert len(tokens) == 24
            # Same as greedy up to the first repeat, which the penalty prevents.
            assert tokens[:first_repeat] == plain_tokens[:first_repeat], extra
            assert tokens.count(plain_tokens[first_repeat]) == 1, extra


def test_logit_bias_bans_a_token(oai, tiny_llama) -> None:
    plain, _ = _hf_greedy(tiny_llama, PROMPT, 8)
    banned = plain[0]
    for stream in (False, True):
        kwargs = dict(
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logit_bias={str(banned): -100},
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        if stream:
            toks = [
                t
                for p in oai.completions.create(stream=True, **kwargs)
                for c in p.choices
                if c.logprobs
                for t in c.logprobs.tokens
            ]
        else:
            toks = oai.completions.create(**kwargs).choices[0].logprobs.tokens
        assert tiny_llama.tokenizer.decode([banned]) not in toks
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(prompt=PROMPT, max_tokens=2, logit_bias={"999999": 5})
    assert e.value.param == "logit_bias"


def test_min_tokens_delays_eos_and_stop_token_ids_stop(oai, tiny_llama) -> None:
    eos = tiny_llama.tokenizer.eos_token_id
    bias = {str(eos): 100}
    first = oai.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias)
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens == 1
    for stream in (False, True):
        kwargs = dict(
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            logit_bias=bias,
            extra_body={"min_tokens": 5},
            stream=stream,
        )
        if stream:
            kwargs["stream_options"] = {"include_usage": True}
            parts = list(oai.completions.create(**kwargs))
            usage = parts[-1].usage
            reasons = [c.finish_reason for p in parts for c in p.choices if c.finish_reason]
        else:
            comp = oai.completions.create(**kwargs)
            usage, reasons = comp.usage, [comp.choices[0].finish_reason]
        assert usage.completion_tokens == 6 and reasons == ["stop"]
    plain, _ = _hf_greedy(tiny_llama, PROMPT, 6)
    stop_at = plain[3]
    k = plain.index(stop_at)
    comp = oai.completions.create(
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [stop_at], "ignore_eos": True},
    )
    assert comp.choices[0].finish_reason == "stop"
    assert comp.usage.completion_tokens == k + 1


def test_stop_string_can_stay_in_the_output(oai) -> None:
    text = _greedy(oai, 12).text
    stop = text[3:5]
    at = text.index(stop)
    cut = oai.completions.create(
        prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    kept = oai.completions.create(
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert cut.choices[0].text == text[:at]
    assert kept.choices[0].text == text[: at + len(stop)]


def test_skip_special_tokens_false_shows_them(oai, tiny_llama) -> None:
    special = tiny_llama.tokenizer.convert_tokens_to_ids("<|im_start|>")
    kwargs = dict(prompt=PROMPT, max_tokens=2, temperature=0, logit_bias={str(special): 100})
    hidden = oai.completions.create(**kwargs, extra_body={"ignore_eos": True})
    shown = oai.completions.create(
        **kwargs, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert "<|im_start|>" not in hidden.choices[0].text
    assert shown.choices[0].text == "<|im_start|><|im_start|>"


def test_n_choices_are_seeded_samples(oai) -> None:
    kwargs = dict(
        prompt="abc", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    comp = oai.completions.create(n=3, best_of=3, **kwargs)
    assert [c.index for c in comp.choices] == [0, 1, 2]
    assert comp.usage.completion_tokens == 18
    single = [
        oai.completions.create(**{**kwargs, "seed": 11 + i}).choices[0].text for i in range(3)
    ]
    assert [c.text for c in comp.choices] == single
    assert comp.usage.prompt_tokens == oai.completions.create(**kwargs).usage.prompt_tokens
    parts = list(oai.completions.create(n=3, stream=True, **kwargs))
    texts = {i: "".join(c.text for p in parts for c in p.choices if c.index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == single
    chat = oai.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=4,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 8


def test_batched_prompts_index_choices_across_prompts(oai) -> None:
    prompts = ["abc", "de fg"]
    kwargs = dict(max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    comp = oai.completions.create(prompt=prompts, n=2, **kwargs)
    assert [c.index for c in comp.choices] == [0, 1, 2, 3]
    each = [oai.completions.create(prompt=p, **kwargs) for p in prompts]
    assert [c.text for c in comp.choices] == [each[0].choices[0].text] * 2 + [
        each[1].choices[0].text
    ] * 2
    assert comp.usage.prompt_tokens == sum(e.usage.prompt_tokens for e in each)
    ids = oai.completions.create(prompt=[[5, 6, 7], [8, 9]], **kwargs)
    assert [c.index for c in ids.choices] == [0, 1]


def test_tokenize_and_detokenize(client, tiny_llama) -> None:
    r = client.post("/tokenize", json={"prompt": "abc de"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tiny_llama.tokenizer.encode("abc de", add_special_tokens=False)
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": "abc de"}
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/tokenize", json={"messages": messages})
    text = tiny_llama.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert r.json()["tokens"] == tiny_llama.tokenizer.encode(text, add_special_tokens=False)
    r = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert r.json()["count"] < len(tiny_llama.tokenizer.encode(text, add_special_tokens=False))
    r = client.post("/detokenize", json={"tokens": [10**8]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = client.post("/tokenize", json={"prompt": "a", "bogus": 1})
    assert r.status_code == 400
    # vLLM's benchmark client aligns its prompts with this body (model, prompt, false).
    vllm_body = {"model": None, "prompt": "abc de", "add_special_tokens": False}
    assert client.post("/tokenize", json=vllm_body).json()["tokens"] == ids
    r = client.post("/tokenize", json={**vllm_body, "add_special_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_prompt_logprobs_of_a_prompt_whose_prefix_is_cached(oai, tiny_llama) -> None:
    # The first request leaves the prompt's full KV blocks in the prefix cache; a request
    # for prompt logprobs must still compute (and score) every prompt position.
    prompt = (PROMPT * 8)[:40]  # two full 16-token blocks and a tail
    full = _hf_logprobs(tiny_llama, prompt)
    oai.completions.create(prompt=prompt, max_tokens=1, temperature=0)
    comp = oai.completions.create(prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    values = comp.choices[0].logprobs.token_logprobs
    assert len(values) == len(prompt) and values[0] is None
    for i in range(1, len(prompt)):
        assert values[i] == pytest.approx(float(full[i - 1, prompt[i]]), abs=1e-4)
