"""Adapters and base models by hub id: from a real cache layout offline, and with --online from a
local stand-in for the hub (tests/support/hub_server.py) that counts the bytes it serves. No test
reaches the internet: the online runs are subprocesses whose HF_ENDPOINT is 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import run_cli
from tests.support.hub_server import COMMIT, Hub, cache_repo, run_metrale, serve

MODEL = "qwen3-next-80b-a3b"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`chat` (q_proj r16, ~4 MB of tensors) and a base `config.json` directory."""
    root = tmp_path_factory.mktemp("hub")
    done = metrale("synth", root / "chat", "-m", MODEL, "--modules", "q_proj", "-r", 16)
    assert done.code == 0, done.stderr
    (root / "base").mkdir()
    (root / "base" / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 48, "linear_num_value_heads": 3, "linear_value_head_dim": 8,
        "full_attention_interval": 2}))
    return root


# -- the local cache, offline -------------------------------------------------------------------


@pytest.fixture
def cache(adapters: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    cache_repo(cache, "acme/chat", adapters / "chat")
    cache_repo(cache, "acme/base", adapters / "base")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("METRALE_ONLINE", raising=False)
    return cache


def test_cached_adapter_by_hub_id(cache: Path) -> None:
    snapshot = cache / "models--acme--chat" / "snapshots" / COMMIT
    for spec, name in (("acme/chat", "chat"), ("mine=acme/chat", "mine"),
                       (f"acme/chat@{COMMIT}", f"chat@{COMMIT}"), ("acme/chat@main", "chat@main")):
        result = metrale("inspect", spec, "--json")
        assert result.code == 0, (spec, result.stderr)
        [report] = result.json()["adapters"]
        assert (report["name"], report["path"], report["servable"]) == (name, str(snapshot),
                                                                         True)


def test_hf_hub_cache_wins_over_hf_home(cache: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    result = metrale("inspect", "acme/chat")
    assert result.code == 2
    assert f"not in the local Hugging Face cache ({tmp_path / 'elsewhere'})" in result.stderr
    assert "--online" in result.stderr and result.stderr.count("\n") == 1


def test_pack_and_verify_from_the_cache(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "pool.safetensors"
    assert metrale("pack", "acme/chat", "--max-loras", 2, "--out", out).code == 0
    shown = metrale("show", out, "--json").json()
    assert shown["slots"][0]["name"] == "chat"
    assert metrale("verify", out, "acme/chat").code == 0


def test_model_by_hub_id_from_the_cache(cache: Path, adapters: Path) -> None:
    result = metrale("layout", "-m", "acme/base", "--modules", "q_proj", "--max-rank", 4,
                     "--json")
    assert result.code == 0, result.stderr
    # The tiny base's two full-attention layers, q_proj 32 -> 32 (gated: 2 x 2 heads x 8).
    doc = result.json()
    assert (len(doc["entries"]), doc["slot_bytes"]) == (2, 2 * (256 + 256))
    assert "acme/base" in metrale("layout", "-m", "acme/base", "--modules", "q_proj",
                                  "--max-rank", 4).stdout
    missing = metrale("layout", "-m", "acme/other", "--modules", "q_proj", "--max-rank", 4)
    assert missing.code == 2 and "--online" in missing.stderr


# -- the hub, online ----------------------------------------------------------------------------


@pytest.fixture
def hub(adapters: Path) -> Hub:
    hub = Hub(refuse={"acme/private": 401, "acme/gated": 403})
    hub.add("acme/chat", adapters / "chat")
    hub.add("acme/base", adapters / "base")
    with serve(hub):
        yield hub


@pytest.mark.proc
def test_online_inspect_reads_only_the_header(hub: Hub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = run_metrale(hub, cache, "inspect", "acme/chat", "--online", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["adapters"][0]["servable"]
    weights = hub.repos["acme/chat"]["adapter_model.safetensors"]
    header = 8 + int.from_bytes(weights[:8], "little")
    assert len(weights) > 1000 * header
    assert hub.served[("acme/chat", "adapter_model.safetensors")] == header
    assert hub.served[("acme/chat", "adapter_config.json")] == len(
        hub.repos["acme/chat"]["adapter_config.json"])
    # The config is cached, the weights are not.
    assert list(cache.rglob("adapter_config.json"))
    assert not list(cache.rglob("adapter_model.safetensors"))


@pytest.mark.slow
def test_online_pack_downloads_into_the_cache(hub: Hub, tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "pool.safetensors"
    done = run_metrale(hub, cache, "pack", "acme/chat", "--max-loras", 1, "--out", out,
                       METRALE_ONLINE="1")
    assert done.returncode == 0, done.stderr
    weights = hub.repos["acme/chat"]["adapter_model.safetensors"]
    assert hub.served[("acme/chat", "adapter_model.safetensors")] == len(weights)
    [cached] = cache.rglob("adapter_model.safetensors")
    assert cached.read_bytes() == weights
    # Now it is cached: offline, with no hub at all, the same pack and verify work.
    again = run_metrale("http://127.0.0.1:9", cache, "verify", out, "acme/chat")
    assert again.returncode == 0, again.stderr


@pytest.mark.proc
def test_online_model_by_hub_id(hub: Hub, tmp_path: Path) -> None:
    done = run_metrale(hub, tmp_path / "cache", "layout", "-m", "acme/base", "--online",
                       "--modules", "q_proj", "--max-rank", 4, "--json")
    assert done.returncode == 0, done.stderr
    assert hub.served[("acme/base", "config.json")] > 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.proc
@pytest.mark.parametrize("spec, message", [
    ("acme/private", "401 unauthorized"),
    ("acme/gated", "403 forbidden"),
    ("acme/nope", "404 not found"),
    ("acme/chat@v9", "404 not found"),
    ("acme/chat", "cannot reach http://127.0.0.1:"),
])
def test_hub_failures_are_one_line_exit_2(hub: Hub, tmp_path: Path, spec: str,
                                          message: str) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}" if "reach" in message else hub
    done = run_metrale(endpoint, tmp_path / "cache", "inspect", spec, "--online")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {spec}: adapter_config.json: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


# -- hostile input: a Hugging Face home that is no directory ---------------------------------------


@pytest.mark.proc
@pytest.mark.parametrize("online", [[], ["--online"]])
def test_a_hugging_face_home_that_is_no_directory_is_one_line(
    tiny: Path, online: list[str]
) -> None:
    result = run_cli("inspect", tiny / "a", "--model", "org/name", *online,
                     env_extra={"HF_HOME": os.devnull, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Errno" not in result.stderr, result.stderr
    assert "/dev/null" in result.stderr
