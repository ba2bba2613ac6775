"""The pool: packing, tables, the slot manager under threads, the image, and atomic writes."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale_cli import compat
from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import AdapterReport, audit
from metrale_cli.bf16 import bf16_to_f32, f32_to_bf16, to_bf16_into
from metrale_cli.errors import (
    FormatError,
    LayoutMismatch,
    NonFiniteWeights,
    PoolFull,
    SlotBusy,
    UsageError,
)
from metrale_cli.files.safetensors_header import read_header
from metrale_cli.image.pool_image import PoolImage, write_image
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.pool import fill
from metrale_cli.pool.pool import LoraPool
from metrale_cli.pool.slots import adapter_id_hash, routed_prefill_slot_of
from tests.support.cli_runner import metrale
from tests.support.slot_threads import assert_all_released, run_threads

TINY = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "intermediate_size": 48, "linear_num_value_heads": 3, "linear_value_head_dim": 8,
    "full_attention_interval": 2, "num_experts": 4, "num_experts_per_tok": 2,
}
MODULES = "q_proj,k_proj,v_proj,o_proj,out_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool")
    (root / "config.json").write_text(json.dumps(TINY))
    made = {}
    for name, rank, dtype, extra in (("a", 4, "bf16", []), ("b", 2, "f32", ["--rslora"]),
                                     ("c", 3, "f16", []), ("d", 4, "bf16", ["--seed", "9"])):
        modules = MODULES if name != "c" else "q_proj,out_proj"
        result = metrale("synth", root / name, "--model", root, "--modules", modules,
                         "--rank", rank, "--dtype", dtype, *extra)
        assert result.code == 0, result.stderr
        made[name] = root / name
    made["model"] = root
    return made


def reports(tiny: dict[str, Path], *names: str):
    cfg = ModelConfig.from_hf(tiny["model"])
    return cfg, [audit(Adapter.load(tiny[n]), cfg) for n in names]


def tensor(adapter: Path, name: str) -> np.ndarray:
    """A tensor of a synthetic adapter as float32 (reference reading via safetensors)."""
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        return f.get_tensor(name).float().numpy()


def test_bf16_round_to_nearest_even() -> None:
    import torch

    values = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    values[:4] = [np.inf, -np.inf, 0.0, -0.0]
    mine = f32_to_bf16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(mine, theirs)
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0, 1e30])
def test_conversions_into_a_slot_match_torch_bit_for_bit(dtype: str, scale: float) -> None:
    """Every conversion the fill makes (a file dtype times a PEFT scaling relative to the
    slot's, rounded once to BF16; BF16 times a float32 scale), written straight into a strided
    slot region with reused buffers, is torch's, bit for bit: a scale too large is infinity,
    which the finite check then refuses. The columns past the values are left alone."""
    import torch

    from metrale_cli.bf16 import Scratch, to_bf16_into

    rng = np.random.default_rng(3)
    values = (rng.standard_normal((33, 40)) * 10.0 ** rng.uniform(-6, 3, (33, 40))).astype(
        np.float32)
    values[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    theirs = torch.from_numpy(values)
    if dtype == "BF16":
        raw = theirs.bfloat16().view(torch.int16).numpy().view(np.uint16)
        want = theirs.bfloat16().float() * float(np.float32(scale))
    else:
        raw = values.astype(np.float16) if dtype == "F16" else values
        want = (torch.from_numpy(raw).double() * scale).float()
    want_bits = want.bfloat16().view(torch.int16).numpy().view(np.uint16)
    scratch = Scratch()
    for cols in ((0, 40), (5, 21)):  # the second a strided view of the file's rows
        dest = np.full((33, 48), 0xABCD, np.uint16)
        k = cols[1] - cols[0]
        to_bf16_into(dest[:, :k], raw[:, cols[0]:cols[1]], dtype, scale, scratch)
        assert np.array_equal(dest[:, :k], want_bits[:, cols[0]:cols[1]])
        assert (dest[:, k:] == 0xABCD).all()
    nan = np.array([[np.nan, 1.0]], np.float32)
    out = np.zeros((1, 2), np.uint16)
    to_bf16_into(out, nan if dtype == "F32" else nan.astype(np.float16) if dtype == "F16"
                 else f32_to_bf16(nan), dtype, scale, scratch)
    assert np.isnan(bf16_to_f32(out[0, :1]))[0]


def test_a_fill_converts_in_buffers_it_reuses(tiny: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An F32 adapter read a few rows at a time: every chunk's conversion (and its read) goes
    through the same few buffers, grown only when a chunk is larger, not fresh ones a chunk
    (NumPy's temporaries were fresh pages for the kernel to fault in, each chunk)."""
    from metrale_cli.bf16 import Scratch

    monkeypatch.setattr(fill, "CHUNK_BYTES", 64)
    grown: list[str] = []
    take = Scratch.take

    def counted_take(self, role, shape, dtype):  # type: ignore[no-untyped-def]
        before = self.buffers.get(role)
        got = take(self, role, shape, dtype)
        if self.buffers[role] is not before:
            grown.append(role)
        return got

    monkeypatch.setattr(Scratch, "take", counted_take)
    calls: list[int] = []
    monkeypatch.setattr(fill, "to_bf16_into", lambda *args: calls.append(1) or
                        to_bf16_into(*args))
    cfg, (b,) = reports(tiny, "b")
    layout = SlotLayout.build(cfg, b.module_set, 4)
    LoraPool.load(layout, 1, [b])
    assert len(calls) > 4 * len(b.modules)  # many chunks a tensor
    assert set(grown) <= {"read", "values", "wide", "rounded"} and len(grown) <= 12, grown


def test_pack_tables_and_delta(tiny: dict[str, Path]) -> None:
    cfg, (a, b, c) = reports(tiny, "a", "b", "c")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 5, [a, b, c])
    assert pool.manager.pinned == 3 and pool.manager.adapter_names() == ["a", "b", "c"]
    assert list(pool.scale_table) == pytest.approx([2.0, 4 / 2**0.5, 2.0, 0.0, 0.0])
    assert list(pool.rank_table) == [4, 2, 3, 0, 0]
    base = pool.region.base_address
    for i, e in enumerate(layout.entries):
        for k in range(5):
            adapted = k < 2 or (k == 2 and e.module in (LoraModule.Q_PROJ, LoraModule.OUT_PROJ))
            expect_a = base + k * layout.slot_bytes + e.a_offset if adapted else 0
            assert int(pool.a_tables[i, k]) == expect_a
    # The delta read back through the tables equals scale * B @ A of the file (BF16 tolerance).
    i = layout.index[(1, LoraModule.Q_PROJ)]
    e = layout.entries[i]
    for k, (name, r) in enumerate((("a", 4), ("b", 2))):
        off_a = int(pool.a_tables[i, k]) - base
        off_b = int(pool.b_tables[i, k]) - base
        a_pool = bf16_to_f32(pool.pool[off_a:off_a + e.a_bytes].view(np.uint16)).reshape(4, -1)
        b_pool = bf16_to_f32(pool.pool[off_b:off_b + e.b_bytes].view(np.uint16)).reshape(-1, 4)
        assert not a_pool[r:].any() and not b_pool[:, r:].any()  # zero beyond the rank
        key = "base_model.model.model.layers.1.self_attn.q_proj"
        scaling = pool.manager.slot_info(k).scaling
        want = scaling * tensor(tiny[name], f"{key}.lora_B.weight") @ tensor(
            tiny[name], f"{key}.lora_A.weight")
        got = float(pool.scale_table[k]) * b_pool[:, :r] @ a_pool[:r]
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_slot_manager(tiny: dict[str, Path]) -> None:
    cfg, (a, b, c, d) = reports(tiny, "a", "b", "c", "d")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 4, [a])
    slots = pool.manager
    assert slots.select_victim_slot() == 1  # an empty cache slot first
    assert pool.swap_in(1, b) == 1 and pool.swap_in(2, c) == 1 and pool.swap_in(3, d) == 1
    assert slots.slot_of("c") == 2 and slots.slot_of("") is None
    # Least recently used among idle cache slots; pinned slot 0 is never a victim.
    for s in (2, 3, 1):
        slots.touch_slot(s)
    slots.acquire_slot(0)
    assert slots.select_victim_slot() == 2
    slots.acquire_slot(2)
    assert slots.select_victim_slot() == 3
    slots.acquire_slot(3)
    slots.acquire_slot(1)
    with pytest.raises(PoolFull):
        slots.select_victim_slot()
    with pytest.raises(SlotBusy):
        pool.swap_in(2, a)
    with pytest.raises(SlotBusy):
        slots.rotate(1)  # the active slot 0 is busy
    for s in (0, 1, 2, 3):
        slots.release_slot(s)
    with pytest.raises(UsageError):
        slots.release_slot(0)
    # Generations: in the identity, wrapping, untouched by a rotation.
    before = slots.adapter_id_for_slot(2)
    assert before == adapter_id_hash("c", 1) != adapter_id_hash("c", 0)
    pool.swap_in(2, a)
    assert slots.slot_info(2).generation == 2
    assert slots.adapter_id_for_slot(2) == adapter_id_hash("a", 2)
    slots.rotate(3)
    assert slots.active == 3 and slots.slot_info(3).generation == 1
    assert slots.adapter_id_for_slot(-1) == adapter_id_hash("d", 1)
    assert slots.adapter_id_for_slot(99) == 0
    # A swap zeroes the stale modules: c adapts only q_proj/out_proj.
    pool.swap_in(1, c)
    i = layout.index[(1, LoraModule.K_PROJ)]
    assert int(pool.a_tables[i, 1]) == 0
    start = 1 * layout.slot_bytes
    e = layout.entries[i]
    assert not pool.pool[start + e.a_offset:start + e.b_offset + e.b_bytes].any()


def test_clear_slot_leaves_a_placeholder(tiny: dict[str, Path]) -> None:
    """A cleared slot has identity 0: not found by name, not rotatable, not acquirable; a
    slot with in-flight sequences is not cleared."""
    cfg, (a, b) = reports(tiny, "a", "b")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 3, [a])
    pool.swap_in(1, b)
    slots = pool.manager
    slots.acquire_slot(1)
    with pytest.raises(SlotBusy):
        pool.clear_slot(1)
    assert slots.slot_of("b") == 1
    slots.release_slot(1)
    pool.clear_slot(1)
    assert slots.adapter_id_for_slot(1) == 0 and slots.slot_of("b") is None
    assert slots.slot_info(1).name == "" and slots.slot_info(1).generation == 1
    with pytest.raises(UsageError):
        slots.rotate(1)
    with pytest.raises(UsageError):
        slots.acquire_slot(1)
    assert not pool.region.host_bytes(1).any() and not pool.a_tables[:, 1].any()
    assert float(pool.scale_table[1]) == 0.0 and int(pool.rank_table[1]) == 0
    assert slots.select_victim_slot() == 1


class HeldReader(fill.TensorReader):
    """A tensor reader that stops at its first read until the test lets it go."""

    entered = threading.Event()
    release = threading.Event()

    def block(self, info, rows, cols, scratch=None):  # type: ignore[no-untyped-def]
        HeldReader.entered.set()
        assert HeldReader.release.wait(30), "the test never released the reader"
        return super().block(info, rows, cols, scratch)


def test_swap_in_packs_outside_the_lock(tiny: dict[str, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a swap's disk read is held, acquires and releases on other slots complete, and the
    loading slot has no identity, is not acquirable, is no victim and its tables point nowhere."""
    cfg, (a, b, c) = reports(tiny, "a", "b", "c")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 4, [a])
    pool.swap_in(1, b)
    pool.swap_in(2, c)
    HeldReader.entered.clear()
    HeldReader.release.clear()
    monkeypatch.setattr(fill, "TensorReader", HeldReader)
    slots = pool.manager
    result: list[object] = []
    swap = threading.Thread(target=lambda: result.append(pool.swap_in(2, b)))
    swap.start()
    try:
        assert HeldReader.entered.wait(30)
        for _ in range(3):
            for k in (0, 1):
                slots.release_slot(slots.acquire_slot(k))
        # The pool's own lock is free too: clearing another slot does not wait for the pack.
        clear = threading.Thread(target=pool.clear_slot, args=(3,))
        clear.start()
        clear.join(10)
        assert not clear.is_alive(), "clear_slot waited behind the swap's disk read"
        assert slots.adapter_id_for_slot(2) == 0 and slots.slot_of("c") is None
        with pytest.raises(SlotBusy):
            slots.acquire_slot(2)
        with pytest.raises(SlotBusy):
            pool.clear_slot(2)
        assert slots.select_victim_slot() == 3
        assert not pool.a_tables[:, 2].any() and float(pool.scale_table[2]) == 0.0
    finally:
        HeldReader.release.set()
        swap.join(30)
    assert result == [2]
    assert slots.slot_of("b") == 1 and slots.adapter_id_for_slot(2) == adapter_id_hash("b", 2)
    assert np.array_equal(pool.region.host_bytes(2), pool.region.host_bytes(1))


def truncate(adapter: Path) -> None:
    """Cut the last third off an adapter's safetensors file (after its audit)."""
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) * 2 // 3])


def test_failed_swap_clears_the_slot(tiny: dict[str, Path], tmp_path: Path) -> None:
    """A swap whose file ends early never leaves the old identity over new bytes: the slot is
    cleared, identity 0."""
    cfg, (a, b) = reports(tiny, "a", "b")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    shutil.copytree(tiny["d"], tmp_path / "d")
    broken = audit(Adapter.load(tmp_path / "d"), cfg)
    truncate(tmp_path / "d")
    pool, _ = LoraPool.load(layout, 3, [a])
    assert pool.swap_in(1, b) == 1
    with pytest.raises(FormatError, match="file ended inside tensor"):
        pool.swap_in(1, broken)
    slots = pool.manager
    assert slots.adapter_id_for_slot(1) == 0 and slots.slot_of("b") is None
    assert slots.slot_info(1).name == "" and slots.slot_info(1).generation == 2
    assert not pool.region.host_bytes(1).any() and not pool.a_tables[:, 1].any()
    assert float(pool.scale_table[1]) == 0.0
    assert pool.swap_in(1, b) == 3  # the slot serves again


def test_ids_and_routed_prefill() -> None:
    assert adapter_id_hash("x", 0) != 0 and adapter_id_hash("x", 0) == adapter_id_hash("x", 0)
    assert adapter_id_hash("x", 1) != adapter_id_hash("x", 2)
    assert routed_prefill_slot_of(-1, 0, 4) is None
    assert routed_prefill_slot_of(0, 0, 4) is None
    assert routed_prefill_slot_of(2, 0, 4) == 2
    assert routed_prefill_slot_of(4, 0, 4) is None
    assert routed_prefill_slot_of(-2, 0, 4) is None


def test_threads_keep_counts_consistent(tiny: dict[str, Path]) -> None:
    cfg, (a, b, c, d) = reports(tiny, "a", "b", "c", "d")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 6, [a, b])
    slots = pool.manager
    held_lock = threading.Lock()
    held = [0] * 6  # what the threads believe they hold

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        for _ in range(300):
            op = rng.random()
            if op < 0.45:
                try:
                    slot = slots.acquire_slot(rng.randrange(6))
                except (UsageError, SlotBusy):  # empty, or loading right now
                    continue
                with held_lock:
                    held[slot] += 1
                mine.append(slot)
            elif op < 0.8 and mine:
                slot = mine.pop(rng.randrange(len(mine)))
                with held_lock:
                    held[slot] -= 1
                slots.release_slot(slot)
            elif op < 0.9:
                slots.touch_slot(rng.randrange(6))
            else:
                try:
                    victim = slots.select_victim_slot()
                    pool.swap_in(victim, rng.choice([c, d]))
                except (PoolFull, SlotBusy):
                    pass
        for slot in mine:
            with held_lock:
                held[slot] -= 1
            slots.release_slot(slot)

    run_threads(worker)
    assert_all_released(slots, held)
    assert slots.slot_info(0).name == "a" and slots.slot_info(1).name == "b"  # pinned stay
    # Every published slot's bytes are its adapter's, whatever the interleaving.
    fresh, _ = LoraPool.load(layout, 2, [c, d])
    for k in range(2, 6):
        name = slots.slot_info(k).name
        if name:
            want = fresh.region.host_bytes(fresh.manager.slot_of(name))
            assert np.array_equal(pool.region.host_bytes(k), want), (k, name)


def test_image_roundtrip_and_land_slot(tiny: dict[str, Path], tmp_path: Path) -> None:
    cfg, (a, b, c) = reports(tiny, "a", "b", "c")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 3, [a, b])
    path = tmp_path / "pool.safetensors"
    write_image(pool, path)
    header = read_header(path)
    assert header.data_start % 256 == 0
    image = PoolImage.open(path)
    assert image.layout.fingerprint == layout.fingerprint
    assert np.array_equal(image.region.memory, pool.pool)
    assert np.array_equal(image.scales, pool.scale_table)
    assert [s.name for s in image.slots] == ["a", "b", ""] and image.pinned == [True, True, False]
    assert np.array_equal(image.region.a_offsets, pool.region.offset_tables()[0])
    # Peer swap: land image slot 1 into a fresh pool's slot 2; bytes equal, generation bumps.
    other, _ = LoraPool.load(layout, 3, [c])
    assert other.land_slot(2, image, 1) == 1
    assert np.array_equal(other.region.host_bytes(2), pool.region.host_bytes(1))
    assert other.manager.slot_info(2).name == "b" and other.rank_table[2] == 2
    i = layout.index[(1, LoraModule.Q_PROJ)]
    assert int(other.a_tables[i, 2]) - other.region.base_address == 2 * layout.slot_bytes + \
        layout.entries[i].a_offset
    with pytest.raises(UsageError, match="holds no adapter"):
        other.land_slot(1, image, 2)
    wrong = LoraPool(SlotLayout.build(cfg, [LoraModule.Q_PROJ], 4), 3)
    with pytest.raises(LayoutMismatch):
        wrong.land_slot(1, image, 1)


def test_pack_refuses_and_never_overwrites(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "p.safetensors"
    ok = metrale("pack", tiny["a"], tiny["b"], "--max-loras", 2, "--out", out, "--json")
    assert ok.code == 0, ok.stderr
    doc = ok.json()
    # Ranks 4 and 2 pad to 8 by default, the smallest max rank the kernels serve.
    assert [s["name"] for s in doc["slots"]] == ["a", "b"] and doc["layout"]["max_rank"] == 8
    again = metrale("pack", tiny["a"], "--max-loras", 2, "--out", out)
    assert again.code == 2 and "--force" in again.stderr
    assert metrale("pack", tiny["a"], "--max-loras", 2, "--out", out, "--force").code == 0
    few = metrale("pack", tiny["a"], tiny["b"], "--max-loras", 1)
    assert few.code == 2 and "do not fit" in few.stderr
    low = metrale("pack", tiny["a"], "--max-loras", 1, "--max-rank", 2)
    assert low.code == 1 and "rank_above_max" in low.stderr


@pytest.mark.skipif(compat.has_gpu(), reason="a GPU is present")
def test_pack_tells_its_stages_and_what_it_wrote(tiny: dict[str, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped, a pack that runs long is told at each tenth of each stage, in MiB as its summary
    counts: reading the adapters, then writing the image (the bar sat at 100% while the image
    was written, and piped a pack said nothing). Without --out it says it wrote nothing."""
    from metrale_cli.cli import console

    monkeypatch.setattr(console, "QUIET_S", 0.0)  # as if it had run long
    monkeypatch.setattr(fill, "CHUNK_BYTES", 64)  # many small reads: many steps to tell
    monkeypatch.setattr(fill, "READ_BYTES", 64)
    out = tmp_path / "pool.safetensors"
    done = metrale("pack", tiny["a"], tiny["d"], "--max-loras", 2, "--out", out)
    assert done.code == 0, done.stderr
    lines = done.stderr.splitlines()
    stages = [line.split(":")[0] for line in lines]
    assert stages == sorted(stages, key=["packing", "writing the image"].index), lines
    assert {"packing", "writing the image"} == set(stages)
    assert all(re.fullmatch(r"(packing|writing the image): \d0% of \d+\.\d MiB", line)
                            for line in lines), lines
    assert "nothing was written" not in done.stderr
    monkeypatch.undo()  # a short pack again: quiet
    none = metrale("pack", tiny["a"], "--max-loras", 2)
    assert none.code == 0 and "packed" in none.stdout
    assert none.stderr == ("note: no --out, so nothing was written: the pool was packed in "
                           "memory and let go\n")
    assert metrale("pack", tiny["a"], "--max-loras", 2, "--json").json()["image"] is None


def test_pack_on_cuda_without_a_gpu_exits_3(tiny: dict[str, Path]) -> None:
    gpu = metrale("pack", tiny["a"], "--max-loras", 1, "--device", "cuda")
    assert gpu.code == 3 and gpu.stderr.startswith("error: a GPU is needed")


def test_a_pool_larger_than_memory_is_refused_before_allocating(tiny: dict[str, Path]) -> None:
    # 10**10 slots: past host memory, short of the 1 PiB no machine holds.
    result = metrale("pack", tiny["a"], "--max-loras", 10_000_000_000, "--device", "cpu")
    assert result.code == 2, result.stderr
    assert result.stderr.startswith("error: the pool needs") and "host memory" in result.stderr
    assert result.stderr.count("\n") == 1


def hook_reads(monkeypatch: pytest.MonkeyPatch,
               before: Callable[[fill.TensorReader, int, list[Any]], None]) -> None:
    """`before(reader, start, parts)` ahead of every read into the slot or a buffer of the fill's
    reader: `into`, and `into_checked` (the compiled reader's reads, checked as they land)."""
    for name in ("into", "into_checked"):
        real = getattr(fill.TensorReader, name)

        def hooked(self, start, parts, real=real):  # type: ignore[no-untyped-def]
            before(self, start, parts)
            return real(self, start, parts)

        monkeypatch.setattr(fill.TensorReader, name, hooked)


def poisoned(src: Path, dst: Path, values: list[float]) -> tuple[Path, str]:
    """A copy of adapter `src` whose first A tensor starts with `values` (in its own dtype)."""
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    info = next(t for t in read_header(weights).tensors.values() if "lora_A" in t.name)
    if info.dtype == "BF16":
        raw = f32_to_bf16(np.array(values, np.float32)).tobytes()
    else:
        raw = np.array(values, {"F32": "<f4", "F16": "<f2"}[info.dtype]).tobytes()
    with open(weights, "r+b") as f:
        f.seek(info.begin)
        f.write(raw)
    return dst, info.name


@pytest.mark.parametrize("name", ["b", "a"])  # F32 (converted) and BF16 (read straight)
def test_non_finite_weights_are_refused(tiny: dict[str, Path], tmp_path: Path, name: str,
                                        host_reads: str) -> None:
    bad, tensor_name = poisoned(tiny[name], tmp_path / "bad", [np.nan, np.inf, 1.0])
    result = metrale("pack", bad, "--max-loras", 1, "--device", "cpu")
    assert result.code == 1, result.stderr
    assert result.stderr == (f"error: bad: tensor {tensor_name!r} has 2 non-finite values "
                             "(NaN or infinity) as BF16; refusing to pack it\n")
    # Under --json the refusal prints its record, as the audit's refusals do.
    out = tmp_path / "pool.safetensors"
    result = metrale("pack", bad, "--max-loras", 1, "--device", "cpu", "--out", out, "--json")
    assert result.code == 1 and not out.exists()
    assert result.json() == {"refused": "non_finite_weights",
                             "error": result.stderr.removeprefix("error: ").rstrip("\n")}


def test_every_judged_refusal_has_a_json_record() -> None:
    """A layout mismatch (another exit-1 refusal of pack) prints its kind and line; a usage
    error (exit 2) prints no record, its line says what to change."""
    from metrale_cli.cli.console import refusal_record
    from metrale_cli.errors import LayoutMismatch, UsageError

    assert refusal_record(LayoutMismatch("a: q_proj is [8, 32]")) == {
        "refused": "layout_mismatch", "error": "a: q_proj is [8, 32]"}
    assert refusal_record(UsageError("--max-loras must be positive")) is None


@pytest.mark.parametrize("name", ["b", "a"])  # F32 (converted) and BF16 (copied as it is)
def test_every_chunk_is_checked_and_counted(tiny: dict[str, Path], tmp_path: Path, name: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            host_reads: str) -> None:
    """The finite check runs on each chunk as it is written: with one B row per chunk, a NaN in
    the first row and an infinity in the last are both found, counted together."""
    monkeypatch.setattr(fill, "CHUNK_BYTES", 16)
    monkeypatch.setattr(fill, "READ_BYTES", 16)
    bad = tmp_path / "bad"
    shutil.copytree(tiny[name], bad)
    weights = bad / "adapter_model.safetensors"
    info = next(t for t in read_header(weights).tensors.values() if "lora_B" in t.name)
    dtype = {"BF16": "<u2", "F32": "<f4"}[info.dtype]
    values = np.array([np.nan, np.inf], np.float32)
    raw = f32_to_bf16(values) if info.dtype == "BF16" else values
    item = np.dtype(dtype).itemsize
    with open(weights, "r+b") as f:
        for at, value in ((0, raw[:1]), (info.nbytes - item, raw[1:])):
            f.seek(info.begin + at)
            f.write(value.astype(dtype).tobytes())
    cfg = ModelConfig.from_hf(tiny["model"])
    report = audit(Adapter.load(bad), cfg)
    layout = SlotLayout.build(cfg, report.module_set, 8)
    assert layout.entries[0].out_dim > 1  # the two values land in different chunks
    with pytest.raises(NonFiniteWeights, match=f"tensor {info.name!r} has 2 non-finite"):
        LoraPool.load(layout, 1, [report])


def test_a_non_finite_value_in_a_read_s_last_tensor_is_found(
        tiny: dict[str, Path], tmp_path: Path, host_reads: str) -> None:
    """A BF16 adapter read straight into the slot in one read whose tensors lie in several
    stretches of the slot, a NaN in the last tensor in the file alone: found and refused, by
    the compiled reader's last chunk or NumPy's last stretch, not only the first's."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny["d"], bad)
    weights = bad / "adapter_model.safetensors"
    last = max(read_header(weights).tensors.values(), key=lambda t: t.begin)
    with open(weights, "r+b") as f:
        f.seek(last.begin + last.nbytes - 2)
        f.write(f32_to_bf16(np.array([np.nan], np.float32)).tobytes())
    cfg = ModelConfig.from_hf(tiny["model"])
    report = audit(Adapter.load(bad), cfg)
    layout = SlotLayout.build(cfg, report.module_set, 4)
    with pytest.raises(NonFiniteWeights) as refused:
        LoraPool.load(layout, 1, [report])
    assert str(refused.value) == (f"bad: tensor {last.name!r} has 1 non-finite values (NaN "
                                  "or infinity) as BF16; refusing to pack it")


@pytest.mark.parametrize(("name", "rank", "direct"), [("d", 4, True), ("b", 2, False)])
def test_a_fill_reads_a_chunk_at_a_time(tiny: dict[str, Path], name: str, rank: int,
                                        direct: bool, monkeypatch: pytest.MonkeyPatch,
                                        host_reads: str) -> None:
    """Copy, conversion and finite check are fused per chunk: no read is larger than one chunk
    of the slot (or one row; a read straight into the slot: one piece), and a BF16 adapter at
    the pool's rank (its bytes are the slot's) is read straight into the slot, with no buffer
    between, tensors end to end in the file in one read (`bench pack` measures the rate)."""
    monkeypatch.setattr(fill, "CHUNK_BYTES", 64)
    monkeypatch.setattr(fill, "READ_BYTES", 64)
    reads: list[tuple[bool, int, int]] = []  # (straight into the slot, BF16 bytes, one row's)
    block = fill.TensorReader.block

    in_block: list[bool] = []  # a block's own read into its buffer is not counted again

    def counted_block(self, info, rows, cols, scratch=None):  # type: ignore[no-untyped-def]
        width = (cols[1] - cols[0]) * 2
        reads.append((False, (rows[1] - rows[0]) * width, width))
        in_block.append(True)
        try:
            return block(self, info, rows, cols, scratch)
        finally:
            in_block.pop()

    def counted_into(self, start, parts):  # type: ignore[no-untyped-def]
        if not in_block:  # spans of the slot, not a buffer
            reads.append((True, sum(out.nbytes for _, out in parts), 0))

    monkeypatch.setattr(fill.TensorReader, "block", counted_block)
    hook_reads(monkeypatch, counted_into)
    cfg = ModelConfig.from_hf(tiny["model"])
    report = audit(Adapter.load(tiny[name]), cfg)
    layout = SlotLayout.build(cfg, report.module_set, rank)
    pool, _ = LoraPool.load(layout, 1, [report])
    assert reads and all(straight == direct for straight, _, _ in reads), reads
    assert all(nbytes <= max(64, row) for _, nbytes, row in reads), reads
    # A whole tensor is more than one chunk, so the bound means something.
    assert max(m.a.shape[0] * m.a.shape[1] * 2 for m in report.modules) > 64
    # The bytes are those of a pack a tensor at a time.
    monkeypatch.setattr(fill, "CHUNK_BYTES", 1 << 30)
    monkeypatch.setattr(fill, "READ_BYTES", 1 << 30)
    reads.clear()
    assert np.array_equal(pool.region.host_bytes(0),
                          LoraPool.load(layout, 1, [report])[0].region.host_bytes(0))
    if direct:  # every tensor lies end to end with the next in the file: one read in all
        assert len(reads) == 1 < 2 * len(report.modules), reads


def test_tensors_end_to_end_in_the_slot_are_checked_as_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_reads: str) -> None:
    """A BF16 adapter at the pool's rank whose file holds its tensors in the slot's order
    (`synth` writes it so): one read for the whole file, checked as it lands by the compiled
    reader, or with one NumPy check for the whole file, where a check per tensor cost two NumPy
    calls each. With non-finite values in two of its tensors, the refusal still names the first
    in the file with its own count, as a check per tensor did."""
    model = ModelConfig.preset("qwen3-8b")
    modules = [LoraModule.Q_PROJ, LoraModule.V_PROJ]
    bad = tmp_path / "bad"
    assert metrale("synth", bad, "--model", "qwen3-8b", "--modules", "q_proj,v_proj",
                   "--rank", 4).code == 0
    weights = bad / "adapter_model.safetensors"
    tensors = sorted(read_header(weights).tensors.values(), key=lambda t: t.begin)
    layout = SlotLayout.build(model, modules, 4)
    clean = audit(Adapter.load(bad), model)
    monkeypatch.setattr(fill, "READ_BYTES", 1 << 30)
    checks: list[int] = []
    counted = fill.non_finite

    def counting(bits: np.ndarray) -> int:
        checks.append(bits.size)
        return counted(bits)

    monkeypatch.setattr(fill, "non_finite", counting)
    reads: list[int] = []
    hook_reads(monkeypatch, lambda reader, start, parts: reads.append(len(parts)))
    LoraPool.load(layout, 1, [clean])
    assert reads == [len(tensors)]
    assert checks == ([] if host_reads == "compiled" else [sum(t.nbytes for t in tensors) // 2])
    second, third = tensors[1], tensors[2]
    nan = f32_to_bf16(np.array([np.nan, np.inf, -np.inf], np.float32)).tobytes()
    with open(weights, "r+b") as f:
        for info, raw in ((second, nan), (third, nan[:2])):
            f.seek(info.begin + 2)
            f.write(raw)
    with pytest.raises(NonFiniteWeights) as refused:
        LoraPool.load(layout, 1, [audit(Adapter.load(bad), model)])
    assert str(refused.value) == (f"bad: tensor {second.name!r} has 3 non-finite values (NaN "
                                  "or infinity) as BF16; refusing to pack it")


def to_cut(tiny: dict[str, Path], tmp_path: Path) -> tuple[Path, AdapterReport, SlotLayout]:
    """A copy of adapter `d` (BF16, read straight into the slot) for a test to cut short: its
    weights file, its report and a pool layout at its rank."""
    shutil.copytree(tiny["d"], tmp_path / "d")
    cfg = ModelConfig.from_hf(tiny["model"])
    report = audit(Adapter.load(tmp_path / "d"), cfg)
    return (tmp_path / "d" / "adapter_model.safetensors", report,
            SlotLayout.build(cfg, report.module_set, 4))


def test_a_file_cut_short_between_reads_fails_the_fill(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        host_reads: str) -> None:
    """Tensors end to end in the file are read a chunk at a time: a file cut short after the
    first chunk was read fails the fill, naming the tensor the next read was in."""
    monkeypatch.setattr(fill, "READ_BYTES", 64)
    weights, report, layout = to_cut(tiny, tmp_path)
    second: list[str] = []

    def cut_before_the_second(self, start, parts):  # type: ignore[no-untyped-def]
        if not second and start > min(m.a.begin for m in report.modules):
            second.append(parts[0][0].name)
            os.truncate(weights, start)  # the file now ends where this read begins

    hook_reads(monkeypatch, cut_before_the_second)
    with pytest.raises(FormatError) as failed:
        LoraPool.load(layout, 1, [report])
    assert second and str(failed.value) == (f"{weights}: file ended inside tensor "
                                            f"{second[0]!r} (cut short while it was read)")


def test_a_file_cut_short_inside_a_read_names_the_tensor_it_ended_in(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        host_reads: str) -> None:
    """A file cut short inside the third tensor of a read of several (end to end in the file):
    the fill fails naming that tensor, not the read's first."""
    weights, report, layout = to_cut(tiny, tmp_path)
    third: list[str] = []

    def cut_inside_the_third(self, start, parts):  # type: ignore[no-untyped-def]
        if not third and len(parts) >= 3:
            third.append(parts[2][0].name)
            os.truncate(weights, start + parts[0][1].nbytes + parts[1][1].nbytes + 2)

    hook_reads(monkeypatch, cut_inside_the_third)
    with pytest.raises(FormatError) as failed:
        LoraPool.load(layout, 1, [report])
    assert third and str(failed.value) == (f"{weights}: file ended inside tensor "
                                           f"{third[0]!r} (cut short while it was read)")


def two_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fills share their reads with a helper thread whatever their size and this machine's
    cores, a run of 64 bytes at a time; returns the names of the threads that read, a read
    at a time."""
    monkeypatch.setattr(fill, "CHUNK_BYTES", 64)
    monkeypatch.setattr(fill, "READ_BYTES", 64)
    monkeypatch.setattr(fill, "SHARED_BYTES", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(fill, "_load", lambda: (1, 1.0))  # this thread alone: a core idle
    readers: list[str] = []
    hook_reads(monkeypatch, lambda *_: readers.append(threading.current_thread().name))
    return readers


@pytest.mark.parametrize("name", ["d", "b"])  # BF16 read straight, F32 converted
def test_two_threads_fill_the_bytes_one_does(tiny: dict[str, Path], name: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             host_reads: str) -> None:
    """A fill whose bytes warrant it, where a second core is usable and idle, shares its chunks
    with a helper thread (each reads a run straight into the slot, or a block into its own
    buffers and converts it, and checks it); the slot's bytes and the progress told are those
    of one thread. A fill below `SHARED_BYTES`, on one core or on a busy machine starts no
    thread."""
    cfg = ModelConfig.from_hf(tiny["model"])
    report = audit(Adapter.load(tiny[name]), cfg)
    layout = SlotLayout.build(cfg, report.module_set, 4)
    one, _ = LoraPool.load(layout, 1, [report])
    assert fill._threads(fill.SHARED_BYTES - 1) == 1
    runnable, average = fill._load()
    assert runnable >= 1 and average >= 0  # this thread, at least
    readers = two_threads(monkeypatch)

    def slow_first(self, start, parts):  # type: ignore[no-untyped-def]
        if not readers:
            time.sleep(0.05)  # whichever thread reads first, the other takes runs meanwhile

    hook_reads(monkeypatch, slow_first)
    told: list[int] = []
    pool = LoraPool(layout, 1, "cpu")
    read, _ = fill.fill_slot(report, 0, layout, pool.region, progress=told.append)
    assert {"MainThread", "metrale-fill"} <= set(readers), readers
    assert np.array_equal(pool.region.host_bytes(0), one.region.host_bytes(0))
    assert sum(told) == read == sum(m.a.nbytes + m.b.nbytes for m in report.modules)
    assert fill._threads(1 << 40) == 2
    # Another thread runs at this moment, the last minute's average leaves a core idle (a
    # kernel thread, or the last fill's helper exiting): two; busy by both: one.
    monkeypatch.setattr(fill, "_load", lambda: (2, 1.2))
    assert fill._threads(1 << 40) == 2
    monkeypatch.setattr(fill, "_load", lambda: (2, 1.6))
    assert fill._threads(1 << 40) == 1
    monkeypatch.setattr(fill, "_load", lambda: (1, 7.0))  # a load that has just ended
    assert fill._threads(1 << 40) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # one usable core
    assert fill._threads(1 << 40) == 1
    readers.clear()
    LoraPool.load(layout, 1, [report])
    assert readers and set(readers) == {"MainThread"}


def _two_threads_refuse_first(bad: Path, cfg: ModelConfig, begin: int, name: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Pack the adapter at `bad` on two threads, the tensor at file offset `begin` read (or
    converted) last, its thread held up while the other goes on to the last tensor: the
    refusal names that tensor, `name`, with its 2 non-finite values, as one thread's does."""
    report = audit(Adapter.load(bad), cfg)
    layout = SlotLayout.build(cfg, report.module_set, 4)
    readers = two_threads(monkeypatch)

    def first_read_last(self, start, parts):  # type: ignore[no-untyped-def]
        if start == begin:
            time.sleep(0.05)  # the other thread reads or converts on, to the last tensor

    hook_reads(monkeypatch, first_read_last)
    with pytest.raises(NonFiniteWeights) as refused:
        LoraPool.load(layout, 1, [report])
    assert str(refused.value) == (f"bad: tensor {name!r} has 2 non-finite values (NaN "
                                  "or infinity) as BF16; refusing to pack it")
    assert "metrale-fill" in readers


def test_two_threads_refuse_the_first_non_finite_tensor_in_the_file(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        host_reads: str) -> None:
    """Non-finite values in two tensors, the first read last (its thread held up): the
    refusal names the first tensor in the file, with its count, as one thread's does."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny["d"], bad)
    weights = bad / "adapter_model.safetensors"
    tensors = sorted(read_header(weights).tensors.values(), key=lambda t: t.begin)
    first, last = tensors[0], tensors[-1]
    nan = f32_to_bf16(np.array([np.nan, np.inf], np.float32)).tobytes()
    with open(weights, "r+b") as f:
        for info, raw in ((first, nan), (last, nan[:2])):
            f.seek(info.begin)
            f.write(raw)
    cfg = ModelConfig.from_hf(tiny["model"])
    _two_threads_refuse_first(bad, cfg, first.begin, first.name, monkeypatch)


def test_two_threads_refuse_the_first_non_finite_tensor_converted(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An F32 adapter (converted) with non-finite values in its first and last tensors, the
    first converted last (its thread held up): the refusal names the first, with its count,
    as one thread's does."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny["b"], bad)
    cfg = ModelConfig.from_hf(tiny["model"])
    clean = audit(Adapter.load(bad), cfg)
    first, last = clean.modules[0].a, clean.modules[-1].b
    with open(bad / "adapter_model.safetensors", "r+b") as f:
        for info, values in ((first, [np.nan, np.inf]), (last, [np.nan])):
            f.seek(info.begin)
            f.write(np.array(values, "<f4").tobytes())
    _two_threads_refuse_first(bad, cfg, first.begin, first.name, monkeypatch)


def test_two_threads_fail_a_file_cut_short_as_one_does(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        host_reads: str) -> None:
    """A file cut short near the end of a tensor: with two threads reading, the error names
    that tensor, the first read in the file past the cut, as one thread's does, though the
    other thread failed first in the next tensor; raised once both threads have stopped."""
    weights, report, layout = to_cut(tiny, tmp_path)
    tensors = sorted(read_header(weights).tensors.values(), key=lambda t: t.begin)
    cut = tensors[len(tensors) // 2]
    end = cut.begin + cut.nbytes - 10  # the next read past the cut is in the next tensor
    os.truncate(weights, end)
    with pytest.raises(FormatError) as one:
        LoraPool.load(layout, 1, [report])
    readers = two_threads(monkeypatch)

    def first_past_the_cut_late(self, start, parts):  # type: ignore[no-untyped-def]
        if start <= end < start + 64:
            time.sleep(0.05)  # the other thread meets a later short read first

    hook_reads(monkeypatch, first_past_the_cut_late)
    with pytest.raises(FormatError) as two:
        LoraPool.load(layout, 1, [report])
    assert str(two.value) == str(one.value) and repr(cut.name) in str(one.value)
    assert "metrale-fill" in readers
    reads = len(readers)
    time.sleep(0.1)
    assert len(readers) == reads  # both threads stopped before the error was raised


def test_an_adapter_for_other_dims_is_refused_before_a_byte_is_written(tmp_path: Path) -> None:
    """Audited against intermediate_size 96, packed into a layout for 48: refused, naming the
    module and both shapes."""
    dense = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
             "intermediate_size": 48}
    for name, inter in (("narrow", 48), ("wide", 96)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**dense,
                                                                 "intermediate_size": inter}))
    assert metrale("synth", tmp_path / "x", "--model", tmp_path / "wide", "--modules",
                   "gate_proj,down_proj", "--rank", 4).code == 0
    wide, narrow = (ModelConfig.from_hf(tmp_path / n) for n in ("wide", "narrow"))
    report = audit(Adapter.load(tmp_path / "x"), wide)
    layout = SlotLayout.build(narrow, [LoraModule.GATE_PROJ, LoraModule.DOWN_PROJ], 8)
    pool, _ = LoraPool.load(layout, 2, [])
    with pytest.raises(LayoutMismatch, match=r"gate_proj on layer 0: A \[4, 32\], B \[96, 4\] "
                       r"do not fit the pool's layout, which has A \[r, 32\], B \[48, r\]"):
        pool.swap_in(1, report)
    assert LayoutMismatch.exit_code == 1
    assert not pool.pool.any() and pool.manager.slot_info(1).generation == 0


@pytest.mark.proc
def test_kill_during_pack_leaves_no_partial_file(tmp_path: Path) -> None:
    """SIGKILL at many moments of `pack --out`: the output is absent or a whole image."""
    a = tmp_path / "big"
    assert metrale("synth", a, "--model", "qwen3-8b", "--modules", "q_proj,v_proj,o_proj",
                   "--rank", 16).code == 0
    out = tmp_path / "pool.safetensors"
    cmd = [sys.executable, "-m", "metrale_cli", "pack", str(a), "--model", "qwen3-8b",
           "--max-loras", "12", "--device", "cpu", "--out", str(out)]
    for delay in (0.2, 0.5, 0.9, 1.4):
        out.unlink(missing_ok=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if out.exists():
            assert PoolImage.open(out).max_loras == 12  # whole, or it would not be there
    out.unlink(missing_ok=True)
    assert subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False).returncode == 0
    assert PoolImage.open(out).max_loras == 12


def test_swap_and_land_into_the_active_slot(tiny: dict[str, Path]) -> None:
    """-1 is the active slot for every slot-taking call: a swap or a landing into -1 writes the
    active slot's bytes, tables, scale and rank, not (by Python's negative indexing) the last
    slot's bytes under pointers below the pool."""
    cfg, (a, b) = reports(tiny, "a", "b")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 4, [a])
    pool.swap_in(1, b)
    pool.manager.rotate(1)
    pool.swap_in(-1, a)
    source, _ = LoraPool.load(layout, 1, [b])
    landed, _ = LoraPool.load(layout, 3, [a])
    landed.swap_in(1, a)
    landed.manager.rotate(1)
    landed.land_slot(-1, source, 0)
    for p, want, donor in ((pool, "a", pool), (landed, "b", source)):
        base = p.region.base_address
        assert p.manager.slot_info(1).name == want and p.manager.slot_of(want) is not None
        assert p.rank_table[1] == donor.rank_table[0] and p.rank_table[-1] == 0
        assert p.scale_table[1] == donor.scale_table[0] and p.scale_table[-1] == 0
        assert np.array_equal(p.region.host_bytes(1), donor.region.host_bytes(0))
        assert not p.region.host_bytes(p.max_loras - 1).any()
        adapted = p.to_host(p.a_tables[:, 1])
        assert (adapted[adapted != 0] >= base + layout.slot_bytes).all()
        assert not p.to_host(p.a_tables[:, -1]).any()


def test_clearing_the_active_slot_clears_that_slot_only(tiny: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """clear_slot(-1) clears the slot that was active when it was called: a rotation between
    the manager's clear and the bytes' (rotate does not take the pool's lock) must not zero the
    bytes and tables of the slot it rotated to, which is READY and serving."""
    cfg, (a, b) = reports(tiny, "a", "b")
    layout = SlotLayout.build(cfg, [LoraModule(m) for m in MODULES.split(",")], 4)
    pool, _ = LoraPool.load(layout, 3, [a])
    pool.swap_in(1, b)
    pool.swap_in(2, a)
    pool.manager.rotate(1)
    before = pool.region.host_bytes(2).copy()
    clear = pool.manager.clear_slot

    def clear_then_rotate(slot: int) -> None:
        clear(slot)
        pool.manager.rotate(2)  # another thread, between the two halves

    monkeypatch.setattr(pool.manager, "clear_slot", clear_then_rotate)
    pool.clear_slot(-1)
    assert pool.manager.slot_info(1).name == "" and not pool.region.host_bytes(1).any()
    assert pool.manager.slot_info(2).name == "a"
    assert np.array_equal(pool.region.host_bytes(2), before)
    assert pool.to_host(pool.a_tables[:, 2]).any() and pool.rank_table[2] == 4
