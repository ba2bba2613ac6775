"""`metrale show`, `verify` and `unpack`: reading pool images back."""

# No `from __future__ import annotations`: the options' annotations are evaluated once, here
# (cached in the .pyc), not compiled from strings by Typer each time the command tree is built,
# which was most of what `metrale --help` took beyond importing typer (scripts/bench_startup.py).

from pathlib import Path
from typing import Annotated

import typer

from metrale_cli.cli.console import emit, handles_errors, progress, say
from metrale_cli.cli.options import ForceOpt, JsonOpt, OnlineOpt, online_on
from metrale_cli.errors import refused_line

ImageArg = Annotated[Path, typer.Argument(help="A pool image (format pool/1).",
                                          show_default=False)]


def _note_no_digests(image: Path, state: str) -> None:
    if state == "none":
        from metrale_cli.image.digest import NO_DIGESTS

        say(f"note: {image} {NO_DIGESTS}")


@handles_errors
def show(image: ImageArg,
         check: Annotated[bool, typer.Option(
             "--check", help="Also read the pool bytes and check them against the image's "
             "digests.")] = False,
         json_out: JsonOpt = False) -> None:
    """What a pool image holds, checked without reading its pool bytes (with --check, with
    them). Exit 1 if its metadata and tables contradict each other or its bytes their digests,
    2 if it is not a pool image.

    Example: metrale show pool.safetensors --check"""
    from metrale_cli.cli import render
    from metrale_cli.image.show import show_image

    shown = show_image(image, contents=check)
    refusal = shown.refusal()
    if refusal is not None:
        raise refusal  # under --json its record, which says why, is printed first
    record = shown.record()
    _note_no_digests(image, record["digests"])
    emit(record, json_out, render.show_view)


@handles_errors
def verify(
    image: ImageArg,
    adapters: Annotated[list[str], typer.Argument(
        metavar="ADAPTER",
        help="Adapter directories or hub ids (matched to slots by name), or NAME=either.",
        show_default=False)],
    online: OnlineOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Recompute what pack writes for each adapter and compare it with the image's bytes. Exit
    1 on any difference.

    Example: metrale verify pool.safetensors chat code"""
    from metrale_cli.adapters.loading import load_adapters
    from metrale_cli.cli import render
    from metrale_cli.image.verify import Verifier

    verifier = Verifier.open(image, load_adapters(adapters, online_on(online), weights=True))
    with progress("verifying", verifier.total_bytes, not json_out) as shown:
        result = verifier.run(None if shown is None else shown.advance)
    _note_no_digests(image, result.digests)
    record = result.record()
    emit(record, json_out, render.verify_view)
    if not result.ok:
        # The last line says why the exit is 1, as every command's does (stdout may be long).
        differing = [a["name"] for a in record["adapters"] if not a["ok"]]
        why = [refused_line(differing, len(record["adapters"]), "differ from their slot")
               ] if differing else []
        if record["digest_differences"]:
            n = len(record["digest_differences"])
            why.append(f"{n} tensor{'s differ' if n != 1 else ' differs'} from the digest the "
                       "image records")
        say(f"error: {'; '.join(why)}")
        raise typer.Exit(1)


@handles_errors
def unpack(
    image: ImageArg,
    out_dir: Annotated[str, typer.Argument(help="The adapter directory to write.",
                                           show_default=False)],
    slot: Annotated[int | None, typer.Option("--slot", help="The slot to unpack.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="The slot holding this adapter.")]
    = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write one slot of a pool image back as a PEFT LoRA adapter directory.

    Example: metrale unpack pool.safetensors --slot 1 code-again"""
    from metrale_cli.image.unpack import unpack as unpack_slot

    result = unpack_slot(image, out_dir, slot, name, force)
    from metrale_cli.cli import render

    _note_no_digests(image, result.digests)
    emit(result.record(), json_out, render.unpack_view)
