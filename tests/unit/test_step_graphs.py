"""Every bucket's graph captured at the engine's start, none while serving, on the CPU.

The capture call is cuda_graphs' seam: here a stand-in that runs the step once and whose
replay runs it again, so everything but torch.cuda.CUDAGraph is the code CUDA runs: the
buckets chosen from the limits, the static inputs, the shared logits buffer, run()'s
choice between a replay and the eager forward. Greedy tokens must be those of an engine
without graphs. And the key that limits the graphs refuses bad values in one line.
"""

from __future__ import annotations

import pytest

from wattserve.daemon.config import ConfigError, load_config
from wattserve.daemon.engine import cuda_graphs
from wattserve.daemon.engine.engine import Engine, EngineOptions
from wattserve.daemon.engine.request import SamplingParams
from wattserve.daemon.engine.step_buckets import Bucket

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(loaded, graphs: bool) -> Engine:
    cfg = loaded.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim * 4
    options = EngineOptions(
        kv_cache_bytes=32 * block,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,  # 4 blocks of 16: table widths 1, 2, 4
        cuda_graphs=graphs,
        cuda_graph_max_tokens=16,
    )
    return Engine(loaded, options, device="cpu")


def _serve(engine: Engine) -> list[list[int]]:
    """Requests arriving between steps: a prompt alone (mixed, 3 tokens), a decode, a
    decode with a new prompt (7 tokens), two decodes with a 30-token prompt (32 tokens:
    above the largest bucket), then decodes of three; each request's tokens."""
    outs: dict[int, list[int]] = {}

    def add(i: int, prompt: list[int]) -> None:
        outs[i] = []
        engine.add_request(prompt, PARAMS, lambda out: outs[i].extend(out.token_ids))

    add(0, [5, 6, 7])
    engine.step()
    engine.step()
    add(1, [9, 10, 11, 12, 13, 14])
    engine.step()
    add(2, [(3 * k) % 90 + 3 for k in range(30)])
    while engine.has_work():
        engine.step()
    return [outs[i] for i in sorted(outs)]


@pytest.fixture
def stand_in_capture(monkeypatch) -> dict[str, list]:
    calls: dict[str, list] = {"captured": [], "replayed": []}

    def capture(run, device, pool):
        run()  # as the CUDA capture's warm-up: the step runs on its static inputs
        calls["captured"].append(run)

        def replay() -> None:
            calls["replayed"].append(run)
            run()

        return replay

    monkeypatch.setattr(cuda_graphs, "GRAPH_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", capture)
    return calls


def test_start_captures_every_bucket_and_serving_captures_none(tiny_llama, stand_in_capture):
    engine = _engine(tiny_llama, graphs=True)
    graphs = engine._graphs
    assert graphs is not None
    level = engine.model.level
    widths = (1, 2, 4)
    expected = {(level, Bucket("decode", t, w, t)) for t in (1, 2, 4) for w in widths}
    expected |= {
        (level, Bucket("mixed", t, w, min(t - 1, 4))) for t in (2, 4, 8, 16) for w in widths
    }
    assert set(graphs._graphs) == expected
    assert len(stand_in_capture["captured"]) == len(expected) == 21
    assert engine.model.level == level  # restored after capture

    ran: list[tuple[str, int, bool]] = []  # (kind, tokens, replayed) per step
    real_run = graphs.run

    def run(lay, before_replay=None):
        logits = real_run(lay, before_replay)
        kind = "decode" if len(lay.input_ids) == len(lay.context_lens) else "mixed"
        ran.append((kind, len(lay.input_ids), logits is not None))
        return logits

    graphs.run = run
    with_graphs = _serve(engine)
    assert len(stand_in_capture["captured"]) == 21  # none while serving
    assert ("mixed", 3, True) in ran and ("mixed", 7, True) in ran
    assert ("mixed", 32, False) in ran  # larger than the largest bucket: eager
    assert ("decode", 3, True) in ran and ("decode", 1, True) in ran
    assert len(stand_in_capture["replayed"]) == sum(r for _, _, r in ran)

    eager = _serve(_engine(tiny_llama, graphs=False))
    assert with_graphs == eager
    assert all(len(t) == PARAMS.max_tokens for t in eager)


def test_no_graphs_without_the_option_or_off_the_graph_devices(tiny_llama, monkeypatch):
    assert _engine(tiny_llama, graphs=True)._graphs is None  # the CPU: not a graph device
    monkeypatch.setattr(cuda_graphs, "GRAPH_DEVICES", {"cuda", "cpu"})
    assert _engine(tiny_llama, graphs=False)._graphs is None


@pytest.mark.parametrize("value", ["0", "300", "32768", "'many'"])
def test_bad_graph_limits_stop_the_start_with_one_line(tmp_path, clean_wattserve_env, value):
    path = tmp_path / "config.toml"
    path.write_text(f"[engine]\ncuda_graph_max_tokens = {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "engine.cuda_graph_max_tokens" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_graph_limit_takes_powers_of_two(tmp_path, clean_wattserve_env):
    path = tmp_path / "config.toml"
    path.write_text("[engine]\ncuda_graph_max_tokens = 64\n")
    assert EngineOptions.from_config(load_config(path).engine).cuda_graph_max_tokens == 64
