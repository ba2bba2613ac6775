"""`SimulateRequest`: the one record `metrale simulate` parses its options into and runs. A
library caller that makes one gets the CLI's option rules, refused in the CLI's words before
any work, and the same result the CLI prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_cli.errors import UsageError
from metrale_cli.sim.replay import Replay
from metrale_cli.sim.request import SimulateRequest
from tests.support.cli_runner import metrale

SLOT = ["--model", "qwen3-next-80b-a3b", "--modules", "q_proj,v_proj", "--max-rank", "16"]
SLOT_REQUEST = dict(model="qwen3-next-80b-a3b", modules="q_proj,v_proj", max_rank=16)


@pytest.mark.parametrize("args,options", [
    (["--max-cpu-loras", "4"], dict(max_cpu_loras=4)),
    (["--trace", "t.csv", "--workload", "zipf"], dict(trace=Path("t.csv"), workload="zipf")),
    (["--engine", "vllm", "--policy", "lru"], dict(engine="vllm", policies=("lru",))),
    (["--ep", "2"], dict(ep=2)),
    (["--seeds", "2", "--trace", "t.csv"], dict(seeds=2, trace=Path("t.csv"))),
    (["--target-hit-rate", "95"], dict(target_hit_rate=95.0)),
    (["--modules", "q_proj,nope"], dict(modules="q_proj,nope")),
])
def test_a_library_request_is_refused_as_the_cli_refuses_it(
        args: list[str], options: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same conflict, the same line: the CLI's stderr is the library's UsageError, and
    neither replays a request."""
    replayed: list[int] = []
    monkeypatch.setattr(Replay, "run", lambda *a, **k: replayed.append(1))
    cli = metrale("simulate", *SLOT, "--requests", "200", *args)
    assert cli.code == 2, cli.stderr
    with pytest.raises(UsageError) as refused:
        SimulateRequest(**{**SLOT_REQUEST, "requests": 200, **options})  # type: ignore[arg-type]
    assert cli.stderr.strip() == f"error: {refused.value}"
    assert replayed == []


def test_an_engine_flag_conflict_at_any_size_is_refused_before_the_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-cpu-loras below the largest swept --max-loras, which only the engine's rules know:
    the library's run refuses it before the first replay, in the CLI's words."""
    replayed: list[int] = []
    monkeypatch.setattr(Replay, "run", lambda *a, **k: replayed.append(1))
    request = SimulateRequest(engine="vllm", model="llama-3.1-8b", modules="q_proj,v_proj",
                              max_rank=16, requests=500, sizes=(4, 8, 16), max_cpu_loras=12,
                              input_tokens=(0, 0), output_tokens=(0, 0))
    with pytest.raises(UsageError, match="--max-cpu-loras 12 is below --max-loras 16"):
        request.run()
    assert replayed == []


def test_a_library_request_gives_the_cli_record() -> None:
    """Every figure but the wall time is the CLI's for the same options."""
    cli = metrale("simulate", *SLOT, "--requests", "400", "--adapters", "30", "--max-loras",
                  "4,8", "--policy", "lru,min", "--pinned", "1", "--json").json()
    got = SimulateRequest(**SLOT_REQUEST, requests=400, adapter_count=30,  # type: ignore[arg-type]
                          sizes=(4, 8), policies=("lru", "min"), pinned=1).run().record()
    for record in (cli, got):
        record.pop("seconds")
    assert got == cli
