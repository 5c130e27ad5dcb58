"""Start-up refusals for model directories (one line naming the file or key, exit non-zero)
and `wattserve models check DIR`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from wattserve.daemon.engine.loader import LoadError, load_model
from wattserve.daemon.engine.model_check import check_model_dir


def variant(tiny_dirs, tmp_path, name: str, **config) -> object:
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / name)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wattserve.daemon.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_missing_shard_is_named(tiny_dirs, cache_dir, tmp_path):
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "sharded")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError) as err:
        load_model(str(d), cache_dir)
    msg = str(err.value)
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg and "\n" not in msg


def test_corrupt_shard_is_named(tiny_dirs, cache_dir, tmp_path):
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "corrupt")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated mid-tensor
    with pytest.raises(LoadError, match=r"model\.safetensors: corrupt safetensors file"):
        load_model(str(d), cache_dir)


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"model_type": "granitemoehybrid"}, "'granitemoehybrid': Granite 4's hybrid Mamba"),
        ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
        (
            {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
            "rope_parameters.rope_type: rope type 'proportional' is not supported",
        ),
    ],
)
def test_unrunnable_config_is_refused_by_key(tiny_dirs, cache_dir, tmp_path, config, expected):
    d = variant(tiny_dirs, tmp_path, "bad", **config)
    with pytest.raises(LoadError) as err:
        load_model(str(d), cache_dir)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_models_check_reports_levels_and_refuses_by_name(tiny_dirs, tmp_path):
    report = check_model_dir(tiny_dirs["llama"], memory_bytes=1 << 40)
    assert report["architecture"] == "llama" and report["layers"] == 2
    levels = report["levels"]
    assert levels["fp32"]["weight_bytes"] > levels["bf16"]["weight_bytes"]
    assert levels["int8"]["weight_bytes"] > levels["int4"]["weight_bytes"]
    assert all(lv["fits"] for lv in levels.values())
    small = check_model_dir(tiny_dirs["llama"], memory_bytes=levels["int8"]["weight_bytes"])
    assert not small["levels"]["fp32"]["fits"] and small["levels"]["int4"]["fits"]
    out = cli("models", "check", str(tiny_dirs["llama"]), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["architecture"] == "llama"
    bad = variant(tiny_dirs, tmp_path, "hybrid", model_type="granitemoehybrid")
    out = cli("models", "check", str(bad))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "granitemoehybrid" in out.stderr
