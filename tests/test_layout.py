"""The slot layout and capacity plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_cli.cli.parsing import parse_size
from metrale_cli.errors import UsageError
from metrale_cli.layout.plan import PoolPlan
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import copy_adapter, one_line_error

ATTN = [LoraModule(m) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")]


def test_qwen3_next_slot_bytes() -> None:
    layout = SlotLayout.build(ModelConfig.preset("qwen3-next-80b-a3b"), ATTN, 16)
    assert layout.slot_bytes == 15_335_424
    assert len(layout.entries) == 12 * 4 + 36
    # No q_proj is reserved on a linear-attention layer.
    assert all(e.module is LoraModule.OUT_PROJ for e in layout.entries if e.layer % 4 != 3)


def test_entries_are_aligned_ordered_and_disjoint() -> None:
    cfg = ModelConfig.preset("qwen3.5-9b")
    layout = SlotLayout.build(cfg, list(LoraModule), 7, align=512)
    end = 0
    for e in layout.entries:
        assert e.a_offset % 512 == 0 and e.b_offset % 512 == 0
        assert e.a_offset >= end and e.b_offset >= e.a_offset + 7 * e.in_dim * 2
        end = e.b_offset + e.out_dim * 7 * 2
    assert layout.slot_bytes >= end and layout.slot_bytes % 512 == 0
    order = [(e.layer, list(LoraModule).index(e.module)) for e in layout.entries]
    assert order == sorted(order)


def test_fingerprint_tracks_byte_positions() -> None:
    cfg = ModelConfig.preset("qwen3-8b")
    a = SlotLayout.build(cfg, ATTN[:4], 16)
    assert a.fingerprint == SlotLayout.build(cfg, list(reversed(ATTN[:4])), 16).fingerprint
    assert a.fingerprint != SlotLayout.build(cfg, ATTN[:4], 32).fingerprint
    assert a.fingerprint != SlotLayout.build(cfg, ATTN[:3], 16).fingerprint
    assert a.fingerprint != SlotLayout.build(cfg, ATTN[:4], 16, align=512).fingerprint


def test_capacity() -> None:
    layout = SlotLayout.build(ModelConfig.preset("qwen3-next-80b-a3b"), ATTN, 16)
    fits = PoolPlan.sized(layout, None, budget_bytes=parse_size("40GiB")).max_loras
    assert fits == 2800
    assert layout.pool_bytes(fits) + layout.table_bytes(fits) <= 40 * 2**30
    assert layout.pool_bytes(fits + 1) + layout.table_bytes(fits + 1) > 40 * 2**30


def test_parse_size() -> None:
    assert parse_size("40GiB") == 40 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("lots", "12XB", "-1GB"):
        with pytest.raises(UsageError):
            parse_size(bad)


@pytest.mark.parametrize(("model", "absent"), [("qwen3-8b", "out_proj"),
                                               ("qwen3-next-80b-a3b", "gate_proj")])
def test_modules_all_lists_only_what_the_model_has(model: str, absent: str) -> None:
    """`--modules all` on a dense model (no out_proj) or a hybrid MoE (no dense gate/up/down):
    the modules line lists the modules with entries and names the others as not in the model."""
    r = metrale("layout", "--model", model, "--modules", "all", "--max-rank", "16",
                columns=200)  # wide enough that the field is one line
    assert r.code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("modules"))
    listed, _, missing = line.removeprefix("modules").partition("(")
    assert "q_proj" in listed and absent not in listed, line
    assert absent in missing and "not in this model" in missing, line


def test_layout_without_modules_or_adapters_suggests_modules_all() -> None:
    """Nothing gives the module set: one line, exit 2, and the way out (`--modules all`)."""
    r = metrale("layout", "--model", "qwen3-8b", "--max-rank", "16")
    assert r.code == 2 and r.stdout == "", r
    assert len(r.stderr.strip().splitlines()) == 1 and "--modules all" in r.stderr, r.stderr


# -- hostile input: layout refuses what pack refuses -----------------------------------------------


def test_layout_refuses_what_pack_refuses(tiny: Path, tmp_path: Path) -> None:
    # No (layer, module) pair applies: a dense model has no linear-attention out_proj.
    empty = metrale("layout", "--model", "qwen3-8b", "--modules", "out_proj", "--max-rank", 8,
                    "--budget", "40GiB")
    one_line_error(empty, 2)
    assert "applies to any layer" in empty.stderr
    # An adapter above --max-rank, and a DoRA adapter: the same refusal, exit 1, by layout,
    # simulate (which sizes its slots by the adapters) and pack.
    dora = copy_adapter(tiny / "a", tmp_path / "dora", use_dora=True)
    for args in ((tiny / "a", "--max-rank", 1), (dora,)):
        planned = metrale("layout", *args, "--model", tiny)
        simulated = metrale("simulate", *args, "--model", tiny, "--requests", 20)
        packed = metrale("pack", *args, "--model", tiny, "--max-loras", 2)
        assert planned.code == simulated.code == packed.code == 1, (
            planned.stderr, simulated.stderr, packed.stderr)
        assert planned.stderr == simulated.stderr == packed.stderr
        assert planned.stdout == simulated.stdout == ""
    # Modules the adapter has outside --modules: refused by both, naming the adapter.
    narrow = metrale("layout", tiny / "a", "--model", tiny, "--modules", "k_proj")
    one_line_error(narrow, 2)
    assert "error: a: out_proj on layer 0 is not in the pool's layout" in narrow.stderr


@pytest.mark.parametrize(("budget", "extra", "said"), [
    ("40", [], "nothing fits in 40 B (a number without a unit is bytes; for gibibytes write "
     "40GiB); one slot with its share of the tables takes 4,194,824 B (4.00 MiB)"),
    ("1MiB", ["--json"], "nothing fits in 1,048,576 B; one slot with its share of the tables "
     "takes 4,194,824 B (4.00 MiB)"),
    ("0GiB", [], "nothing fits in 0 B; one slot with its share of the tables takes "
     "4,194,824 B (4.00 MiB)"),
    ("40", ["--tp", "2"], "nothing fits in 40 B (a number without a unit is bytes; for "
     "gibibytes write 40GiB) per GPU; one slot with its share of the tables takes 3,146,248 B "
     "(3.00 MiB) per GPU"),
])
def test_a_budget_below_one_slot_says_nothing_fits_and_what_a_slot_takes(
        budget: str, extra: list[str], said: str) -> None:
    r = metrale("layout", "-m", "llama-3.1-8b", "--modules", "q_proj", "--max-rank", "8",
                "--budget", budget, *extra)
    assert r.code == 2, r
    assert r.stderr.strip().splitlines() == [f"error: --budget {budget}: {said}"]
    assert r.stdout == ""


@pytest.mark.parametrize(("engine", "label"), [("vllm", "vLLM 0.32.0"),
                                               ("sglang", "SGLang 0.5.23")])
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_an_engine_budget_below_one_slot_is_the_same_answer(engine: str, label: str,
                                                            extra: list[str]) -> None:
    """`layout --engine` under a budget below one of the engine's slots answers as `layout
    --tp 1` does (it said "holds 0 --max-loras" and exited 0): exit 2, nothing fits, what one
    slot of the engine's buffers takes, per GPU."""
    args = ("layout", "-m", "llama-3.1-8b", "--modules", "q_proj", "--max-rank", "8")
    fits = metrale(*args, "--engine", engine, "--budget", "1GiB", "--json")
    assert fits.code == 0, fits.stderr
    slot = fits.json()["engine"]["slot_bytes"]
    said = ("nothing fits in 40 B (a number without a unit is bytes; for gibibytes write 40GiB) "
            "per GPU")
    r = metrale(*args, "--engine", engine, "--budget", "40", *extra)
    assert (r.code, r.stdout) == (2, "")
    assert r.stderr.strip().splitlines() == [
        f"error: --budget 40: {said}; one slot of {label}'s LoRA buffers takes {slot:,} B "
        f"({slot / 2**20:.2f} MiB) per GPU"]
    plain = metrale(*args, "--tp", "1", "--budget", "40", *extra)
    assert plain.code == 2 and plain.stderr.startswith(f"error: --budget 40: {said}; one slot ")


@pytest.mark.parametrize(("args", "says"), [
    (["layout", "--modules", "q_proj", "--max-rank", "99999999999999999999"],
     "error: a slot would take 52,428,799,999,999,999,999,475,712 B (47,683,715,820,312 TiB), "
     "past the 1,024 TiB no machine holds: check --max-rank"),
    # An OverflowError (exit 70) making the replay's int64 load sizes.
    (["simulate", "--modules", "q_proj", "--max-rank", "99999999999999999999", "--requests",
      "50", "--max-loras", "2"], "error: a slot would take 52,428,799,999,999,999,999,475,712 B"),
    (["layout", "--modules", "q_proj", "--max-rank", "8", "--max-loras",
      "99999999999999999999"],
     "error: a pool of 99,999,999,999,999,999,999 slots and its tables would take "
     "419,482,399,999,999,999,995,805,176 B (381,517,020,286,992 TiB), past the 1,024 TiB no "
     "machine holds: check --max-loras"),
    (["layout", "--modules", "q_proj", "--max-rank", "8", "--budget", "1e30"],
     "error: a pool of 238,389,024,187,903,954,941,762 slots and its tables would take"),
    # Every region padded to 1 TiB: a 64 TiB slot, exit 0.
    (["layout", "--modules", "q_proj", "--max-rank", "8", "--align", "1099511627776"],
     "error: alignment must be at most 2,097,152 bytes (a GPU's large page), got "
     "1,099,511,627,776"),
])
def test_a_slot_or_pool_no_machine_holds_is_refused(args: list[str], says: str) -> None:
    """metrale's own pool, as the engines' plans: a slot or a pool past 1 PiB is a typo in
    --max-rank, --max-loras or --budget, refused with its size (it printed 381 trillion TiB
    with exit 0)."""
    done = metrale(*args, "-m", "llama-3.1-8b")
    one_line_error(done, 2)
    assert done.stderr.startswith(says) and done.stdout == ""


def test_layout_under_tp_says_which_slot_is_unsharded() -> None:
    """`layout --tp 2` gives two slot sizes: the unsharded slot, labelled so, and each GPU's
    shard, the one `simulate --tp 2` swaps. The first read as a second answer to "how big is a
    slot?" beside the per-GPU one."""
    args = ["layout", "-m", "llama-3.1-8b", "--modules", "q_proj,v_proj", "--max-rank", "64",
            "--tp", "2"]
    record = metrale(*args, "--json").json()
    shown = " ".join(metrale(*args, columns=200).stdout.split())
    assert f"slot {record['slot_bytes']:,} B (52.00 MiB), 256-byte aligned BF16, unsharded " \
           "(each GPU's shard below)" in shown
    per_gpu = record["rank_layouts"][0]["slot_bytes"]
    assert f"slot {per_gpu:,} B (42.00 MiB) per GPU" in shown
