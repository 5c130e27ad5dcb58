"""lm-evaluation-harness as a real client of the completions API (`local-completions`).

A small multiple-choice task is built from the licence text the Python installation
ships as `wattserve bench quant`'s example is (wattserve.bench.quant_accuracy.licence_items): each
item is the start of a sentence, its true next words and three spans from other
sentences. lm-eval's own LocalCompletionsAPI scores every (context, choice) pair
through /v1/completions (token-id prompts, echo, logprobs) with the served model's
tokenizer read from its local directory (HF_HUB_OFFLINE: never the hub); the sums must
equal those from a direct transformers forward of the same model within 1e-4 (fp32).
The same items then run as a task through lm-eval's evaluator, from a local JSON file,
and its accuracy must be the one the direct log-likelihoods give.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.api_server import api_config, running_server
from wattserve.bench.quant import eval_text_file
from wattserve.bench.quant_accuracy import licence_items

ITEMS = 8
CONTEXT_WORDS = 8


def _items() -> list[dict]:
    """[{context, choices, answer}] from the installation's licence text, fixed seed."""
    text = eval_text_file().read_text()
    return licence_items(text, ITEMS, seed=0, context_words=CONTEXT_WORDS, choice_words=5)


def _hf_loglikelihood(loaded, context: str, continuation: str) -> float:
    """Sum of the continuation tokens' log-probabilities, split as lm-eval splits."""
    tok = loaded.tokenizer
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_context = len(tok.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logits = loaded.hf_model(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(n_context, len(whole)))


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(api_config(engine={"max_model_len": 512}), tiny_llama) as srv:
        yield srv


@pytest.fixture()
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _lm(server, tiny_dirs):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=server.base_url + "/v1/completions",
        model=server.engine.model_name,
        tokenizer=str(tiny_dirs["llama"]),  # the served model's own tokenizer files
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        batch_size=4,  # four prompts (token-id lists) per request
        max_length=512,
        max_retries=1,
    )


def test_local_completions_loglikelihoods_match_transformers(
    server, tiny_llama, tiny_dirs, offline
) -> None:
    from lm_eval.api.instance import Instance

    items = _items()
    pairs = [(it["context"], c) for it in items for c in it["choices"]]
    requests = [
        Instance("loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    results = _lm(server, tiny_dirs).loglikelihood(requests)
    assert len(results) == len(pairs) == ITEMS * 4
    for (context, continuation), (through_api, _greedy) in zip(pairs, results, strict=True):
        direct = _hf_loglikelihood(tiny_llama, context, continuation)
        assert through_api == pytest.approx(direct, abs=1e-4), (context, continuation)
    assert len({round(v, 3) for v, _ in results}) > ITEMS  # real, varied values


def test_lm_eval_task_from_a_local_file(server, tiny_llama, tiny_dirs, offline, tmp_path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    items = _items()
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    (tmp_path / "licence_mc.yaml").write_text(
        "task: wattserve_licence_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    out = simple_evaluate(
        model=_lm(server, tiny_dirs),
        tasks=["wattserve_licence_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    acc = out["results"]["wattserve_licence_mc"]["acc,none"]
    direct = [
        [_hf_loglikelihood(tiny_llama, it["context"], c) for c in it["choices"]] for it in items
    ]
    expected = (
        sum(
            max(range(4), key=row.__getitem__) == it["answer"]
            for row, it in zip(direct, items, strict=True)
        )
        / ITEMS
    )
    assert acc == pytest.approx(expected)
    # And item by item, the harness's own records of what the API returned.
    samples = sorted(out["samples"]["wattserve_licence_mc"], key=lambda x: x["doc_id"])
    assert len(samples) == ITEMS
    for sample, row in zip(samples, direct, strict=True):
        got = [float(resp[0][0]) for resp in sample["resps"]]
        assert got == pytest.approx(row, abs=1e-4)
