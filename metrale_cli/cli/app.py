"""The command line: the Typer app, every command registered on it, and the entry point.

The commands live one module per group (plan_cmds, pack_cmds, image_cmds, bench_cmds,
simulate_cmd): each parses its options, calls the library, and renders the record. Each imports
the core it calls inside itself, so `metrale --help` imports typer and little else (no numpy),
and `inspect` and `layout` import neither torch nor cupy.
"""

# No `from __future__ import annotations`: the callback's annotations are evaluated here, not
# compiled from strings each time Typer builds the command tree (scripts/bench_startup.py).

import sys
from typing import Annotated, Any

import typer

from metrale_cli import __version__
from metrale_cli.cli import bench_cmds, image_cmds, pack_cmds, plan_cmds, simulate_cmd
from metrale_cli.cli.console import say
from metrale_cli.cli.options import Command, Group, InspectCommand, LayoutCommand

try:  # typer >= 0.29 carries its own copy of Click
    from typer._click.exceptions import ClickException, MissingParameter, NoArgsIsHelpError
except ImportError:  # pragma: no cover - older typer on Click >= 8.2
    from click.exceptions import (  # type: ignore[no-redef]
        ClickException,
        MissingParameter,
        NoArgsIsHelpError,
    )


class OneLineUsageErrors(Group):
    """Click's own usage errors (a value that is not an integer, a missing option) as one line
    on stderr and exit 2, like every other error, instead of Click's usage block."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except NoArgsIsHelpError as exc:
            exc.show()  # the help, as Click gives it for a bare `metrale` or `metrale bench`
            sys.exit(exc.exit_code)
        except ClickException as exc:
            line = f"error: {' '.join(exc.format_message().split())}"
            ctx = getattr(exc, "ctx", None)
            if isinstance(exc, MissingParameter) and ctx is not None:
                # What the command takes, on the same line: `metrale inspect` alone.
                usage = " ".join(ctx.get_usage().split()).removeprefix("Usage: ")
                line += f" Usage: {usage} ({ctx.command_path} -h for help)"
            say(line)
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="metrale",
    cls=OneLineUsageErrors,
    help="Audit, lay out, pack and benchmark multi-LoRA adapter pools for LLM serving.\n\n"
    "Example: metrale layout -m qwen3-8b --modules q_proj,v_proj --max-rank 16 --budget 40GiB",
    no_args_is_help=True,
    # -h as well as --help, on every command (a subcommand's context inherits it).
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
bench_app = typer.Typer(help="Benchmarks, reported as ratios measured in one run.\n\n"
                        "Example: metrale bench kernels --model-only --rank 16 --tokens 1",
                        cls=Group, no_args_is_help=True)
app.add_typer(bench_app, name="bench")

app.command(cls=Command)(plan_cmds.models)
app.command(cls=InspectCommand)(plan_cmds.inspect)
app.command(cls=LayoutCommand)(plan_cmds.layout)
for command in (pack_cmds.synth, pack_cmds.pack, image_cmds.show, image_cmds.verify,
                image_cmds.unpack):
    app.command(cls=Command)(command)
bench_app.command("pack", cls=Command)(bench_cmds.bench_pack)
bench_app.command("kernels", cls=Command)(bench_cmds.bench_kernels)
bench_app.command("slots", cls=Command)(bench_cmds.bench_slots)
app.command(cls=simulate_cmd.SimulateCommand)(simulate_cmd.simulate)


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"metrale {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=version_callback,
                                          is_eager=True, help="Print the version.")] = False,
) -> None:
    """metrale: answers about a LoRA adapter pool before anything runs, then does the work."""



def main() -> None:
    for stream in (sys.stdout, sys.stderr):
        # PYTHONIOENCODING=ascii or a C locale: a '·' in a table must not end the run.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    app()


if __name__ == "__main__":
    main()
