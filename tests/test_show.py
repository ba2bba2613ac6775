"""`metrale show`: the record of a packed image, every inconsistency named in one line (exit 1),
anything that is not a pool image refused (exit 2), and only the header and tables read."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale_cli.files.safetensors_header import read_header
from metrale_cli.image.format import read_tables
from metrale_cli.layout.slot_layout import SlotLayout
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.modules import LoraModule
from metrale_cli.pool.pool import AdapterSlot
from tests.support.cli_runner import metrale
from tests.support.hostile_inputs import one_line_error, run_cli
from tests.support.image_edit import edit_metadata, read_element, write_element

MODEL = "qwen3-next-80b-a3b"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Two synthetic adapters in a 3-slot pool; the image and pack's JSON record."""
    root = tmp_path_factory.mktemp("show")
    for name, modules, rank, seed in (("a", "q_proj,v_proj,out_proj", 8, 0),
                                      ("b", "q_proj,o_proj", 4, 2)):
        done = metrale("synth", root / name, "-m", MODEL, "--modules", modules, "-r", rank,
                       "--seed", seed)
        assert done.code == 0, done.stderr
    out = root / "pool.safetensors"
    done = metrale("pack", root / "a", root / "b", "--max-loras", 3, "-m", MODEL, "--out", out,
                   "--device", "cpu", "--json")
    assert done.code == 0, done.stderr
    return out, done.json()


@pytest.fixture
def image(packed: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the packed image, to break."""
    copy = tmp_path / "pool.safetensors"
    shutil.copy(packed[0], copy)
    return copy


def test_show_json_is_the_packed_pool(packed: tuple[Path, dict]) -> None:
    path, pack = packed
    result = metrale("show", path, "--json")
    assert result.code == 0, result.stderr
    doc = result.json()
    assert doc["format"] == "pool/1" and doc["valid"]
    assert doc["layout"]["fingerprint"] == pack["layout"]["fingerprint"]
    assert doc["layout"]["entries"] == pack["entries"]
    assert doc["layout"]["slot_bytes"] == pack["layout"]["slot_bytes"]
    assert doc["model"]["model_type"] == "qwen3_next"
    assert [s["name"] for s in doc["slots"]] == ["a", "b", ""]
    assert [s["rank"] for s in doc["slots"]] == [8, 4, 0]
    assert [s["scale"] for s in doc["slots"]] == [s["scaling"] for s in pack["slots"]]
    assert [s["pinned"] for s in doc["slots"]] == [True, True, False]
    # a: q_proj on the 12 full-attention layers, v_proj too, out_proj on the 36 linear ones.
    assert [s["entries"] for s in doc["slots"]] == [12 + 12 + 36, 12 + 12, 0]
    assert doc["free_slots"] == [2]
    assert doc["experts"] is None
    sizes = doc["bytes"]
    assert sizes["total"] == path.stat().st_size == pack["image_bytes"]
    assert sizes["pool"] == pack["layout"]["pool_bytes"]
    assert sizes["header"] + sizes["pool"] + sizes["tables"] == sizes["total"]


def test_show_view(packed: tuple[Path, dict]) -> None:
    result = metrale("show", packed[0])
    assert result.code == 0, result.stderr
    assert packed[1]["layout"]["fingerprint"] in result.stdout
    assert "consistent" in result.stdout and "free slots   2" in result.stdout
    assert all(len(line) <= 100 or is_field(line) for line in result.stdout.splitlines())


def is_field(line: str) -> bool:
    """A `key  value` line of the view's head that holds a path, which is never folded: past
    the terminal's width the terminal wraps it, and a grep finds the whole path. The other
    head lines (`layout`, 130 columns once) wrap to the width."""
    return line.startswith(("image  ", "model  ", "slot 0 source  ", "slot 1 source  "))


LONG_NAME = "customer-support-assistant-v2-finetuned-on-2026-tickets"


def named_image(packed: tuple[Path, dict], tmp_path: Path, *names: str) -> Path:
    """An image of the fixture's adapters `a`, then `b`, packed under `names` (NAME=PATH), an
    empty slot beside them."""
    root = packed[0].parent
    image = tmp_path / "pool.safetensors"
    specs = [f"{name}={root / adapter}" for name, adapter in zip(names, "ab", strict=False)]
    assert metrale("pack", *specs, "--max-loras", len(names) + 1, "-m", MODEL, "--out", image,
                   "--device", "cpu").code == 0
    return image


SLOT_HEADERS = ("slot", "name", "gen", "rank", "alpha", "scale", "pinned", "entries", "experts",
                "overlays")


@pytest.mark.parametrize("columns", [80, 120])
def test_show_reads_whole_at_80_and_120_columns(packed: tuple[Path, dict], tmp_path: Path,
                                                columns: int) -> None:
    """Every slot header and figure whole, no line past the terminal but the head's field
    lines too long for it (whole: the terminal wraps them); a long name folds in its column."""
    image = named_image(packed, tmp_path, LONG_NAME, "b")
    result = metrale("show", image, columns=columns)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout
    assert all(len(line) <= columns or is_field(line) for line in lines)
    assert f"image        {image} (pool/1, consistent)" in lines
    k = next(i for i, line in enumerate(lines) if line.startswith("slot "))
    assert lines[k].split() == list(SLOT_HEADERS)
    name_at, gen_at = lines[k].index("name"), lines[k].index("gen")
    rows = lines[k + 2:lines.index("", k)]
    assert "".join(line[name_at:gen_at].strip() for line in rows) == LONG_NAME + "b"
    first = rows[0].split()
    assert (first[0], first[2:8]) == ("0", ["0", "8", "16", "2", "yes", "60"])


@pytest.mark.parametrize("columns", [60, 120])
def test_a_slot_name_that_reads_as_markup_shows_as_typed(packed: tuple[Path, dict],
                                                         tmp_path: Path, columns: int) -> None:
    """A NAME=PATH name is input: `[bold red]x` shows as typed in the slot table (120 columns)
    and in the lines that stand for it (60), not as a bare `x` in bold red."""
    result = metrale("show", named_image(packed, tmp_path, "[bold red]x"), columns=columns)
    assert result.code == 0, result.stderr
    assert "[bold red]x" in result.stdout


@pytest.mark.parametrize("name", [LONG_NAME, "a"])
def test_show_fits_60_columns_with_every_cell(packed: tuple[Path, dict], tmp_path: Path,
                                              name: str) -> None:
    """Narrower than the slot table (72 columns at 60, its figures never folding: it ran wide,
    or Rich dropped the name and overlays columns), each slot is key/value lines of the same
    cells: the name (a long one folded), then each column's header and cell; no line past the
    terminal but the head's paths."""
    columns = 60
    image = named_image(packed, tmp_path, name, "b")
    result = metrale("show", image, columns=columns)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(len(line) <= columns or is_field(line) for line in lines), lines
    assert not any(line.split() == list(SLOT_HEADERS) for line in lines)
    k = next(i for i, line in enumerate(lines) if line.startswith("slot 0  "))
    shown: dict[str, list[str]] = {}
    for line in lines[k:lines.index("", k)]:
        key, value = line[:6], line[8:]
        if key.strip():
            shown[key] = []
        shown[list(shown)[-1]].append(value)
    for s in metrale("show", image, "--json").json()["slots"]:
        if not s["name"]:
            continue
        *name, figures = shown.pop(f"slot {s['slot']}")
        # The name folded onto whole lines (nothing added inside it), then each column's cell.
        k = next(i for i, part in enumerate(name) if part.startswith("gen "))
        assert "".join(name[:k]) == s["name"] and all(len(p) <= columns - 8 for p in name[:k])
        assert " ".join([*name[k:], figures]) == (
            f"gen {s['generation']}; rank {s['rank']}; alpha {s['alpha']:g}; scale "
            f"{s['scale']:g}; pinned {'yes' if s['pinned'] else 'no'}; entries {s['entries']}; "
            "experts ·; overlays ·")
    assert shown == {}


def _layout_a_offset(path: Path, entry: int, slot: int) -> int:
    t = read_tables(path)
    return slot * t.layout.slot_bytes + t.layout.entries[entry].a_offset


def _swap(path: Path, tensor: str, i: tuple[int, int], j: tuple[int, int]) -> None:
    x, y = read_element(path, tensor, i), read_element(path, tensor, j)
    write_element(path, tensor, i, y)
    write_element(path, tensor, j, x)


# Entries 0 and 1 are out_proj of linear-attention layers 0 and 1: same dims, so swapping them
# keeps every offset in range, aligned and non-overlapping; only the layout can tell.
BREAKS = {
    "swapped offsets": (lambda p: _swap(p, "a_offsets", (0, 0), (1, 0)),
                        "slot 0 (a): layer 0 out_proj: a_offsets[0, 0] = "),
    "scale": (lambda p: write_element(p, "scales", (0,), 3.0),
              "slot 0 (a): scales[0] is 3; the slot's metadata says 2"),
    "rank": (lambda p: write_element(p, "ranks", (1,), 9),
             "slot 1 (b): ranks[1] is 9; the slot's metadata says 4"),
    "out of range": (lambda p: write_element(p, "a_offsets", (0, 0), 1 << 40),
                     "outside the slot"),
    "misaligned": (lambda p: write_element(p, "b_offsets", (0, 0),
                                           read_element(p, "b_offsets", (0, 0)) + 2),
                   "b_offsets[0, 0] = "),
    "overlap": (lambda p: write_element(p, "b_offsets", (0, 0),
                                        read_element(p, "a_offsets", (0, 0))),
                "overlap in pool"),
    "half pointer": (lambda p: write_element(p, "b_offsets", (0, 0), -1), "both -1"),
    "empty slot adapts": (lambda p: [write_element(p, "a_offsets", (0, 2),
                                                   _layout_a_offset(p, 0, 2)),
                                     write_element(p, "b_offsets", (0, 2), 0)],
                          "slot 2: an empty slot adapts layer 0 out_proj"),
    "fingerprint": (lambda p: edit_metadata(p, "metrale.layout", json.dumps(
        read_tables(p).layout_doc | {"fingerprint": "0" * 32}, separators=(",", ":"))),
        "the layout does not reproduce its fingerprint (recorded 000"),
    "active": (lambda p: edit_metadata(p, "metrale.active", "7"),
               "metrale.active is 7, outside [0, 3)"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_an_inconsistent_image_is_one_line_exit_1(image: Path, name: str) -> None:
    assert metrale("show", image).code == 0
    breaks, message = BREAKS[name]
    breaks(image)
    result = metrale("show", image, "--json")
    assert result.code == 1, (result.stdout, result.stderr)
    # The --json record says why, the error line names the first problem.
    assert result.json()["valid"] is False and message in result.json()["problems"][0]
    assert result.stderr.startswith(f"error: {image}: ") and result.stderr.count("\n") == 1
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(("field", "value"), [("head_dim", None), ("hidden_size", None),
                                              ("attn_gated", float("inf")),
                                              ("num_key_value_heads", "2")])
def test_a_model_summary_field_of_the_wrong_type_is_one_line_exit_2(
        image: Path, field: str, value: object) -> None:
    """The layout's entries are built from the summary's dims and the view prints it: a field
    missing or of the wrong type is bad metadata (exit 2), not an internal error (a TypeError
    where the entries were built, found by the hypothesis fuzzing of PoolImage.open; an
    infinite flag that reached show --json)."""
    summary = json.loads(read_tables(image).header.metadata["metrale.model"])
    edit_metadata(image, "metrale.model", json.dumps(summary | {field: value}))
    result = metrale("show", image)
    assert result.code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith(f"error: {image}: metadata does not describe a layout (")
    assert result.stderr.count("\n") == 1


def _slot_field(path: Path, field: str, value: object) -> None:
    slots = read_tables(path).slots_doc
    slots[0][field] = value
    edit_metadata(path, "metrale.slots", json.dumps(slots, separators=(",", ":")))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("alpha", float("nan"), "alpha nan is not a finite number"),
    ("alpha", [16], "alpha [16] is not a finite number"),
    ("name", 5, "name and source must be strings"),
    ("source", [1], "name and source must be strings"),
    ("generation", "1", "generation '1' is not an integer that fits 64 bits"),
    ("pinned", "yes", "pinned must be true or false"),
])
@pytest.mark.parametrize("command", ["show", "show --json", "verify", "unpack"])
def test_a_slot_record_of_the_wrong_type_is_one_line_exit_1(
        packed: tuple[Path, dict], image: Path, tmp_path: Path, command: str, field: str,
        value: object, message: str) -> None:
    """What the views print and verify matches adapters by is checked as PoolImage.open checks
    it: a NaN alpha or a list for a name is one line, never an internal error."""
    _slot_field(image, field, value)
    args = {"show": ["show", image], "show --json": ["show", image, "--json"],
            "verify": ["verify", image, packed[0].parent / "b"],
            "unpack": ["unpack", image, "--slot", "1", tmp_path / "out"]}[command]
    result = metrale(*args)
    assert result.code == 1, (result.stdout, result.stderr)
    assert result.stderr == f"error: {image}: metrale.slots entry 0: {message}\n"


def test_swapped_offsets_are_named(image: Path) -> None:
    _swap(image, "a_offsets", (0, 0), (1, 0))
    t = read_tables(image)
    want = t.layout.entries[0].a_offset
    got = t.layout.entries[1].a_offset
    result = metrale("show", image)
    assert (f"a_offsets[0, 0] = {got}; the layout puts its A at {want} (and 1 more)"
            in result.stderr), result.stderr


def test_not_a_pool_image_is_exit_2(packed: tuple[Path, dict], tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.safetensors"
    data = packed[0].read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    text = tmp_path / "notes.txt"
    text.write_text("not a pool image\n")
    adapter = packed[0].parent / "a" / "adapter_model.safetensors"
    for path, message in ((truncated, "fall outside the"), (text, "header length"),
                          (adapter, "not a metrale pool image"),
                          (tmp_path / "missing", "cannot read")):
        result = metrale("show", path)
        assert result.code == 2, (path, result.stderr)
        assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def _sparse_image(path: Path, max_loras: int) -> int:
    """An image of `max_loras` empty slots of a real model's layout as docs/pool-format.md
    writes it, with the pool a sparse hole; returns the file size."""
    model = ModelConfig.preset(MODEL)
    modules = [LoraModule(m) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")]
    layout = SlotLayout.build(model, modules, 64)
    n = len(layout.entries)
    minus_one = np.full((n, max_loras), -1, dtype="<i8").tobytes()
    tensors = [("pool", "U8", [max_loras * layout.slot_bytes], None),
               ("scales", "F32", [max_loras], np.zeros(max_loras, "<f4").tobytes()),
               ("ranks", "I32", [max_loras], np.zeros(max_loras, "<i4").tobytes()),
               ("a_offsets", "I64", [n, max_loras], minus_one),
               ("b_offsets", "I64", [n, max_loras], minus_one)]
    doc: dict = {"__metadata__": {
        "metrale.format": "pool/1",
        "metrale.layout": json.dumps(layout.record(max_loras)),
        "metrale.slots": json.dumps([AdapterSlot().record(k, False) for k in range(max_loras)]),
        "metrale.model": json.dumps(model.summary()),
        "metrale.active": "0"}}
    cursor = 0
    for name, dtype, shape, _ in tensors:
        size = int(np.prod(shape)) * {"U8": 1, "F32": 4, "I32": 4, "I64": 8}[dtype]
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + size]}
        cursor += size
    header = json.dumps(doc).encode()
    header += b" " * ((8 + len(header) + 255) // 256 * 256 - 8 - len(header))
    with path.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.seek(8 + len(header) + max_loras * layout.slot_bytes)  # the pool: a hole
        for *_, data in tensors[1:]:
            f.write(data)
    return path.stat().st_size


@pytest.mark.proc
def test_show_reads_only_the_header_and_tables(tmp_path: Path) -> None:
    """A 40 GB image shows reading the bytes a 40 MB one does, plus its larger tables."""
    sizes = {"huge": _sparse_image(tmp_path / "huge", 640),
             "tiny": _sparse_image(tmp_path / "tiny", 1)}
    assert sizes["huge"] > 39e9 and sizes["tiny"] < 70e6
    code = (
        "import sys\n"
        "from metrale_cli.cli.app import main\n"
        "sys.argv = ['metrale', 'show', sys.argv[1], '--json']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "io = dict(line.split(': ') for line in open('/proc/self/io').read().splitlines())\n"
        "sys.stderr.write(io['rchar'])\n"
    )
    read, tables = {}, {}
    for name in sizes:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["free_slots"] == list(range(doc["layout"]["max_loras"]))
        tables[name] = doc["bytes"]["header"] + doc["bytes"]["tables"]
        read[name] = int(done.stderr.strip().splitlines()[-1])
    # Python's own imports dominate rchar; what differs is the header and tables, read once.
    assert read["huge"] - read["tiny"] <= tables["huge"] - tables["tiny"] + 65536, read
    assert read["huge"] < sizes["huge"] / 1000, read


# -- hostile input: images whose metadata contradicts their tables ---------------------------------


def test_show_json_of_an_inconsistent_image_prints_its_record(tiny: Path,
                                                              tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image).code == 0
    slots = read_header(image).metadata["metrale.slots"]
    edit_metadata(image, "metrale.slots", slots.replace('"scaling":2.0', '"scaling":3.0', 1))
    result = metrale("show", image, "--json")
    one_line_error(result, 1)
    assert result.json() == {"path": str(image), "format": "pool/1", "valid": False,
                             "problems": ["slot 0 (a): scales[0] is 2; the slot's metadata "
                                          "says 3.0"]}
    assert result.stderr == f"error: {image}: slot 0 (a): scales[0] is 2; the slot's metadata " \
                            "says 3.0\n"


@pytest.mark.proc
def test_a_scale_past_float32_is_one_error_line(tiny: Path, tmp_path: Path) -> None:
    image = tmp_path / "pool.safetensors"
    assert metrale("pack", tiny / "a", "--model", tiny, "--max-loras", 2, "--out", image).code == 0
    slots = read_header(image).metadata["metrale.slots"]
    edit_metadata(image, "metrale.slots", slots.replace('"scaling":2.0', '"scaling":1e39', 1))
    # In a process of its own: NumPy's warnings go to the real stderr.
    result = run_cli("show", image)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and "Warning" not in result.stderr, result.stderr
    assert "the slot's metadata says 1e+39" in result.stderr


def test_an_image_whose_layout_this_metrale_builds_otherwise_says_so(image: Path) -> None:
    """An image whose recorded model and modules give another layout here (a family whose
    modules changed since it was packed: qwen2_moe's shared experts joined its gate/up/down)
    is one line saying so; it was the pool tensor's size against the new layout's."""
    doc = read_tables(image).layout_doc
    edit_metadata(image, "metrale.layout", json.dumps(
        doc | {"modules": ["q_proj"]}, separators=(",", ":")))
    result = metrale("show", image)
    assert result.code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"its layout ({doc['slot_bytes']} B a slot, fingerprint {doc['fingerprint']})" \
        in result.stderr and "packed by another metrale version, or edited" in result.stderr
