"""The pool's CUDA code path (staging buffers, `.set()`, `asnumpy`, device addresses), run on
the host through a CuPy stand-in, must give the same pool image as the NumPy path. The real
device is checked by the `gpu` tests; this catches the device branch's logic on every CI run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from metrale_cli.adapters.adapter import Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.image.pool_image import PoolImage, write_image
from metrale_cli.layout.plan import plan_layouts
from metrale_cli.model.config import ModelConfig
from metrale_cli.pool import pool as pool_module
from metrale_cli.pool.pool import LoraPool
from tests.support.cli_runner import metrale


class DeviceArray(np.ndarray):
    """Host memory that answers like a CuPy array: `.set(host, stream)` and `.data.ptr`."""

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        assert self.flags.c_contiguous and host.shape == self.shape
        np.copyto(np.asarray(self), host)

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.ctypes.data)


class FakeStream:
    def __init__(self, non_blocking: bool = False) -> None:
        FakeCuda.streams += 1

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeEvent:
    def __init__(self, disable_timing: bool = False) -> None:
        pass

    def record(self, stream: FakeStream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeCuda:
    """`cupy.cuda`: pinned allocations are counted, the device has 1 GiB free."""

    pinned_allocations = 0
    streams = 0
    Stream = FakeStream
    Event = FakeEvent
    runtime = SimpleNamespace(memGetInfo=lambda: (1 << 30, 1 << 30))

    @staticmethod
    def alloc_pinned_memory(nbytes: int) -> bytearray:
        FakeCuda.pinned_allocations += 1
        return bytearray(nbytes)


class FakeCupy:
    """The slice of CuPy's API the pool uses; every array is a DeviceArray."""

    cuda = FakeCuda

    @staticmethod
    def zeros(shape: Any, dtype: Any) -> DeviceArray:
        return np.zeros(shape, dtype).view(DeviceArray)

    @staticmethod
    def empty(shape: Any, dtype: Any) -> DeviceArray:
        return np.empty(shape, dtype).view(DeviceArray)

    @staticmethod
    def asarray(array: Any) -> DeviceArray:
        return np.asarray(array).view(DeviceArray)

    @staticmethod
    def asnumpy(array: Any) -> np.ndarray:
        return np.array(array, copy=True).view(np.ndarray)


@pytest.fixture()
def adapters(tmp_path: Path) -> tuple[ModelConfig, list]:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 48, "linear_num_value_heads": 3, "linear_value_head_dim": 8,
        "full_attention_interval": 2}))
    for name, rank, dtype in (("a", 4, "bf16"), ("b", 2, "f32")):
        assert metrale("synth", tmp_path / name, "--model", tmp_path, "--modules",
                       "q_proj,v_proj,out_proj", "--rank", rank, "--dtype", dtype).code == 0
    model = ModelConfig.from_hf(tmp_path)
    return model, [audit(Adapter.load(tmp_path / n), model) for n in ("a", "b")]


def test_device_path_matches_host_path(adapters, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model, reports = adapters
    layout, _ = plan_layouts(model, reports)
    host, _ = LoraPool.load(layout, 3, reports, device="cpu")
    monkeypatch.setattr(pool_module, "cupy_module", lambda: FakeCupy)
    device, _ = LoraPool.load(layout, 3, reports, device="cuda")
    assert device.device == "cuda" and isinstance(device.pool, DeviceArray)
    # Tables hold "device" addresses of the device pool.
    i = layout.index[(1, next(iter(layout.modules)))]
    assert int(device.a_tables[i, 0]) == device.region.base_address + layout.entries[i].a_offset
    paths = []
    for p in (host, device):
        paths.append(tmp_path / f"{p.device}.safetensors")
        write_image(p, paths[-1])
    a, b = (PoolImage.open(p) for p in paths)
    assert np.array_equal(a.region.memory, b.region.memory)
    assert np.array_equal(a.region.a_offsets, b.region.a_offsets)
    assert np.array_equal(a.scales, b.scales) and np.array_equal(a.ranks, b.ranks)
    # Swap and peer landing through the device path too.
    device.swap_in(2, reports[1])
    device.land_slot(1, b, 0)
    assert np.array_equal(device.region.host_bytes(1), host.region.host_bytes(0))
    assert np.array_equal(device.region.host_bytes(2), host.region.host_bytes(1))


def test_device_path_fills_a_fused_rank_s_runs(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP rank of Phi-3's fused qkv_proj and gate_up_proj holds B as one run per slice (a
    KV head on two ranks at TP 4): the staged device fill writes each rank's runs as the host
    fill does, from BF16 (read straight on the host) and F32 files alike."""
    from metrale_cli.layout.sharding import ShardSpec, rank_layouts

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "phi3", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
        "vocab_size": 64}))
    for name, rank, dtype in (("a", 4, "bf16"), ("b", 2, "f32")):
        assert metrale("synth", tmp_path / name, "--model", tmp_path, "--modules",
                       "qkv_proj,gate_up_proj,down_proj", "--rank", rank, "--dtype",
                       dtype).code == 0
    model = ModelConfig.from_hf(tmp_path)
    reports = [audit(Adapter.load(tmp_path / n), model) for n in ("a", "b")]
    layout, _ = plan_layouts(model, reports)
    for k in range(4):
        ranked, _ = rank_layouts(layout, None, ShardSpec(4, k))
        assert any(len(e.slice.rows) == 3 for e in ranked.entries)
        monkeypatch.undo()
        host, _ = LoraPool.load(ranked, 2, reports, device="cpu")
        monkeypatch.setattr(pool_module, "cupy_module", lambda: FakeCupy)
        device, _ = LoraPool.load(ranked, 2, reports, device="cuda")
        for slot in (0, 1):
            assert np.array_equal(device.region.host_bytes(slot), host.region.host_bytes(slot))


def test_device_packs_stage_through_two_pinned_buffers(adapters, monkeypatch) -> None:
    """Many slots packed and swapped on the device path: two pinned staging buffers and one
    stream in all, reused; stale slots come out byte-equal to the host path's."""
    model, reports = adapters
    layout, _ = plan_layouts(model, reports)
    monkeypatch.setattr(pool_module, "cupy_module", lambda: FakeCupy)
    monkeypatch.setattr(FakeCuda, "pinned_allocations", 0)
    monkeypatch.setattr(FakeCuda, "streams", 0)
    device, _ = LoraPool.load(layout, 8, reports * 4, device="cuda")
    for round_ in range(3):
        for slot in range(8):
            device.swap_in(slot, reports[(slot + round_) % 2])
    assert FakeCuda.pinned_allocations == 2 and FakeCuda.streams == 1
    host, _ = LoraPool.load(layout, 2, reports, device="cpu")
    for slot in range(8):
        want = host.region.host_bytes((slot + 2) % 2)
        assert np.array_equal(device.region.host_bytes(slot), want), slot


def test_bench_pack_device_figures_on_the_stand_in(adapters, monkeypatch) -> None:
    """`bench pack --device cuda`'s two figures, the pack through pinned staging and the pinned
    host-to-device copy of the same bytes, run their device code on the stand-in."""
    from metrale_cli import compat
    from metrale_cli.bench import pack as bench_pack

    model, reports = adapters
    layout, _ = plan_layouts(model, reports)
    monkeypatch.setattr(pool_module, "cupy_module", lambda: FakeCupy)
    monkeypatch.setattr(compat, "cupy_module", lambda: FakeCupy)
    assert bench_pack._pack_rate(reports, layout, "cuda", 2, check_finite=True) > 0
    assert bench_pack._copy_rate(1 << 20, 2, "cuda") > 0


@pytest.mark.gpu
def test_real_device_pack_matches_host(adapters) -> None:
    """On a GPU, through CuPy's pinned staging: the same bytes and offsets as the host path,
    stale slots included."""
    model, reports = adapters
    layout, _ = plan_layouts(model, reports)
    host, _ = LoraPool.load(layout, 3, reports, device="cpu")
    device, _ = LoraPool.load(layout, 3, reports, device="cuda")
    device.swap_in(0, reports[1])
    device.swap_in(0, reports[0])  # rank 4 over rank 2 over rank 4
    device.swap_in(2, reports[1])
    for slot, want in ((0, 0), (1, 1), (2, 1)):
        assert np.array_equal(device.region.host_bytes(slot), host.region.host_bytes(want))
    offsets = device.region.offset_tables()[0]
    assert np.array_equal(offsets[:, :2], host.region.offset_tables()[0][:, :2])


@pytest.mark.slow
def test_device_path_expert_pool(peft_zoo, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.peft_factory import EXPERT_TARGET_PARAMETERS

    truth = peft_zoo.adapter("qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=list(EXPERT_TARGET_PARAMETERS))
    model = ModelConfig.from_hf(truth.base_dir)
    reports = [audit(Adapter.load(truth.path), model, experts_enabled=True)]
    layout, expert_layout = plan_layouts(model, reports, experts=True)
    assert expert_layout is not None
    host, _ = LoraPool.load(layout, 2, reports, device="cpu", expert_layout=expert_layout)
    monkeypatch.setattr(pool_module, "cupy_module", lambda: FakeCupy)
    device, _ = LoraPool.load(layout, 2, reports, device="cuda", expert_layout=expert_layout)
    paths = []
    for p in (host, device):
        paths.append(tmp_path / f"{p.device}.safetensors")
        write_image(p, paths[-1])
    a, b = (PoolImage.open(p) for p in paths)
    assert a.expert_region is not None and b.expert_region is not None
    assert np.array_equal(a.expert_region.memory, b.expert_region.memory)
    assert np.array_equal(a.expert_region.a_offsets, b.expert_region.a_offsets)
    assert a.expert_region.memory.any()
