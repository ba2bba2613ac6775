"""Benchmarks run where they can: `bench pack` on the CPU; `bench kernels` refuses without a GPU
(exit 3); the roofline chart draws from records."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_cli import compat
from metrale_cli.adapters.adapter import WEIGHTS_NAME, Adapter
from metrale_cli.adapters.audit import audit
from metrale_cli.adapters.synth import synth_adapter
from metrale_cli.bench.kernels import module_shapes, plot
from metrale_cli.bench.pack import _tensor_written
from metrale_cli.cli.render import bench_pack_view, kernel_line
from metrale_cli.files.safetensors_header import read_header
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from tests.support.cli_runner import metrale


@pytest.mark.proc
def test_bench_pack_reports_ratios(tmp_path: Path) -> None:
    result = metrale("bench", "pack", "--model", "qwen3-8b", "--modules", "q_proj,v_proj",
                     "--rank", 8, "--adapters", 2, "--repeats", 1, "--json")
    assert result.code == 0, result.stderr
    record = result.json()
    assert record["tensor_bytes"] == 2 * 36 * 8 * (4096 + 4096 + 4096 + 1024) * 2
    assert record["pack_gb_per_s"] > 0 and record["memcpy_gb_per_s"] > 0
    assert record["pack_vs_memcpy"] == pytest.approx(
        record["pack_gb_per_s"] / record["memcpy_gb_per_s"])
    assert record["peak_rss_bytes"] > record["pool_bytes"]
    assert record["pack_tensor_writes_vs_memcpy"] == pytest.approx(
        record["pack_tensor_writes_gb_per_s"] / record["memcpy_gb_per_s"])
    assert record["finite_check_cost"] == pytest.approx(
        record["pack_unchecked_gb_per_s"] / record["pack_gb_per_s"])
    assert record["setup"]["device"] == "cpu" and record["experts"] is None
    # The human view is the same record.
    view = bench_pack_view(record).plain
    assert f"pack      {record['pack_gb_per_s']:.2f} GB/s" in view
    assert f"({record['memcpy_gb_per_s']:.2f} GB/s)" in view and "2 x qwen3-8b r=8" in view
    assert (f"{record['pack_tensor_writes_gb_per_s']:.2f} GB/s = "
            f"{100 * record['pack_tensor_writes_vs_memcpy']:.0f}% with files written per "
            "tensor") in view
    # What the pack ran on: its second reader needs a usable core idle.
    assert 1 <= record["setup"]["cpus_usable"] <= record["setup"]["cpus"]
    assert f"load average {record['setup']['load_average_1m']:.1f}; " in view
    # Each adapter's 7.6 MB stays below SHARED_BYTES: no fill asks for a second reader.
    assert record["shared_fills"] == [0, 0]
    assert "a second reader on 0 of 0 large fills" in view
    # Which reader checked: the compiled one `make test` builds, or NumPy's fallback.
    assert record["setup"]["compiled_reader"] is True
    assert "NaN/Inf check (compiled, as the reads land): the pack takes" in view
    fallback = {**record, "setup": {**record["setup"], "compiled_reader": False}}
    assert "(NumPy after each read: metrale_cli._native was not built" in bench_pack_view(
        fallback).plain


def test_bench_pack_rewrites_an_adapter_as_safetensors_saves_it(tmp_path: Path) -> None:
    """`bench pack`'s second case: the same tensors, byte for byte, in a file whose tensors lie
    in name order (as safetensors' `save_file`, and so PEFT, writes them: `layers.10` before
    `layers.2`), where `synth` writes the slot's order; both audit the same."""
    model = ModelConfig.preset("qwen3-8b")
    modules = [LoraModule.Q_PROJ, LoraModule.V_PROJ]
    synth_adapter(tmp_path / "synth", model, "qwen3-8b", modules, 4, seed=3)
    written = _tensor_written(tmp_path / "synth", tmp_path / "saved")
    ours, saved = (read_header(p / WEIGHTS_NAME) for p in (tmp_path / "synth", written))
    assert set(ours.tensors) == set(saved.tensors)
    in_file = sorted(saved.tensors, key=lambda name: saved.tensors[name].begin)
    assert in_file == sorted(saved.tensors) != sorted(ours.tensors,
                                                      key=lambda n: ours.tensors[n].begin)
    with open(tmp_path / "synth" / WEIGHTS_NAME, "rb") as a, open(written / WEIGHTS_NAME,
                                                                  "rb") as b:
        for name, info in ours.tensors.items():
            other = saved.tensors[name]
            assert (info.dtype, info.shape) == (other.dtype, other.shape)
            a.seek(info.begin)
            b.seek(other.begin)
            assert a.read(info.nbytes) == b.read(other.nbytes), name
    reports = [audit(Adapter.load(p), model) for p in (tmp_path / "synth", written)]
    assert [(m.layer, m.module, m.r) for m in reports[0].modules] == [
        (m.layer, m.module, m.r) for m in reports[1].modules]


def test_kernel_line_shows_the_record() -> None:
    record = {"kernel": "bgmv_shrink", "module": "q_proj", "rank": 16, "tokens": 8,
              "adapters": 8, "p50_us": 3.25, "tb_per_s": 1.5, "pct_peak": 31.25,
              "pct_copy": 80.0, "speedup_vs_torch": 2.5, "torch_best": "gather_bmm"}
    line = kernel_line(record).plain
    assert line.split() == ["bgmv_shrink", "q_proj", "r=16", "T=8", "D=8", "p50", "3.25", "us",
                            "1.50", "TB/s", "31.2%", "peak", "80.0%", "of", "copy", "2.50x",
                            "gather_bmm"]
    assert kernel_line({**record, "speedup_vs_torch": None}).plain.endswith("no torch")


@pytest.mark.slow
def test_bench_pack_experts_reports_peak_memory() -> None:
    result = metrale("bench", "pack", "--model", "qwen3-30b-a3b", "--modules", "q_proj",
                     "--rank", 8, "--adapters", 1, "--repeats", 1, "--experts", "--json")
    assert result.code == 0, result.stderr
    ex = result.json()["experts"]
    assert ex["experts"] == 128 and ex["rank"] == 8 and ex["dtype"] == "f32"
    assert ex["expert_pool_bytes"] > 0 and ex["tensor_bytes"] > ex["expert_pool_bytes"]
    assert ex["peak_rss_minus_pool_bytes"] == ex["peak_rss_bytes"] - ex["pool_bytes"]


@pytest.mark.skipif(compat.has_gpu(), reason="a GPU is present")
def test_bench_pack_on_cuda_needs_a_gpu() -> None:
    result = metrale("bench", "pack", "--device", "cuda", "--adapters", 1)
    assert result.code == 3 and result.stderr.startswith("error: a GPU is needed")


@pytest.mark.skipif(compat.has_gpu(), reason="a GPU is present")
def test_bench_kernels_needs_a_gpu() -> None:
    result = metrale("bench", "kernels", "--tokens", 1)
    assert result.code == 3 and result.stderr.startswith("error: a GPU is needed")


@pytest.mark.slow
def test_roofline_plot(tmp_path: Path) -> None:
    records = [
        {"kernel": k, "bytes": b, "flops": f, "p50_us": us, "copy_us": us * 0.8,
         "peak_tb_per_s": 4.8, "device": "test device"}
        for k, b, f, us in (("bgmv_shrink", 8e6, 4e6, 3.0), ("bgmv_expand", 16e6, 4e6, 6.0),
                            ("sgmv_shrink", 64e6, 2e9, 20.0))
    ]
    out = tmp_path / "roof.png"
    plot(records, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(Exception, match="--force"):
        plot(records, out)


def test_kernel_shapes_are_the_modules_that_apply() -> None:
    """Qwen3-Next: gate/up/down are routed experts there, so only q_proj and out_proj remain."""
    modules = [LoraModule.Q_PROJ, LoraModule.GATE_PROJ, LoraModule.OUT_PROJ]
    assert module_shapes(ModelConfig.preset("qwen3-next-80b-a3b"), modules) == [
        ("q_proj", 8192, 2048), ("out_proj", 2048, 4096)]
    # DeepSeek-V3: gate_proj on the 3 dense layers and on the MoE layers' shared expert, each
    # width once.
    assert module_shapes(ModelConfig.preset("deepseek-v3"), [LoraModule.GATE_PROJ]) == [
        ("gate_proj", 18432, 7168), ("gate_proj", 2048, 7168)]


@pytest.mark.parametrize("json_out", [False, True])
def test_measured_lines_name_the_device_peak_first(json_out: bool,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU run's lines, as they are measured: first the device and the peak its `% peak` is
    of, then a line per record; under --json on stderr (stdout holds the one document)."""
    from metrale_cli.cli import bench_cmds, console

    console.out.cache_clear()
    console.err.cache_clear()
    record = {"kernel": "bgmv_shrink", "module": "q_proj", "rank": 16, "tokens": 8,
              "adapters": 8, "p50_us": 3.25, "tb_per_s": 1.5, "pct_peak": 31.25,
              "pct_copy": 80.0, "speedup_vs_torch": None, "torch_best": None,
              "device": "NVIDIA H100 80GB HBM3", "peak_tb_per_s": 3.35}
    show = bench_cmds._measured(kernel_line, json_out)
    try:
        show(record)
        show({**record, "peak_source": "memory clock x bus width"})  # the device line once
    finally:  # the consoles bound to this test's captured streams go with it
        console.out.cache_clear()
        console.err.cache_clear()
    out, err = capsys.readouterr()
    lines = (err if json_out else out).splitlines()
    assert (out if json_out else err) == ""
    assert lines[0] == "NVIDIA H100 80GB HBM3: nominal HBM peak 3.35 TB/s; % peak is of it"
    assert len(lines) == 3 and lines[1] == kernel_line(record).plain

