"""The options several commands share, declared once, and the steps of reading them: the shard
spec and the opt-ins; and the form every command's help takes (`Command`, `Group`). Adapters
and the base model are read by the library's plan pipeline (layout/pipeline.py)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from metrale_cli import env

if TYPE_CHECKING:
    from metrale_cli.engines.engine import Engine
    from metrale_cli.layout.sharding import ShardSpec


# -- the help's form ----------------------------------------------------------------------------

EXAMPLE = "Example:"
# What a value is called in the help, by its Python type (typer's name, or on a typer before
# 0.29 Click's): `--rank INT`, not typer's `--rank <int>`.
_VALUE_NAMES = {"int": "INT", "integer": "INT", "float": "FLOAT", "str": "TEXT", "text": "TEXT",
                "Path": "PATH", "path": "PATH"}


class _NamedArgument(TyperArgument):
    """An argument shown by its metavar alone: `ADAPTER...` (or `[ADAPTER...]` when optional)
    in the usage line, and no `<list[str]>` beside it in the list of arguments."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def get_usage_pieces(self, ctx: Any) -> list[str]:
        return [self.metavar if self.required else f"[{self.metavar}]"]


def _name_values(param: Any) -> None:
    """Give a parameter the metavar its help shows: an argument its name (or the one it
    declares) in capitals, `...` when it takes several; an option taking a value its type's
    name (INT, FLOAT, TEXT, PATH), unless it declares its own."""
    if isinstance(param, TyperArgument):
        name = (param.metavar or param.name or "value").upper()
        param.metavar = f"{name}..." if param.nargs != 1 and not name.endswith("...") else name
        # typer builds its parameters itself and offers no hook for their class.
        param.__class__ = _NamedArgument
    elif isinstance(param, TyperOption) and not param.is_flag and param.metavar is None:
        bare = param.bare_type() if hasattr(param, "bare_type") else param.type.name
        element = bare.removeprefix("list[").removesuffix("]")
        param.metavar = _VALUE_NAMES.get(element, element.upper())


def _split_examples(help_text: str | None) -> tuple[str | None, list[str]]:
    """A docstring's help and the commands of its closing `Example:` paragraph."""
    if help_text is None:
        return None, []
    text = inspect.cleandoc(help_text)
    at = text.find(EXAMPLE)
    if at < 0 or (at and not text[:at].endswith("\n\n")):
        return text, []
    examples = [line.strip() for line in text[at + len(EXAMPLE):].splitlines() if line.strip()]
    return text[:at].rstrip(), examples


class _HelpForm:
    """Help in the form of every metrale command: values named INT, FLOAT, TEXT or PATH and
    arguments by their metavar (not typer's Python types), and the docstring's `Example:`
    commands at the end, each on one line that is never folded (a pasted example runs)."""

    examples: list[str]
    # The option panels of a command with many options, in the order shown: title -> its
    # options' first flags. Options in none are shown last under "Options".
    panels: dict[str, tuple[str, ...]] = {}

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        help, self.examples = _split_examples(help)
        super().__init__(*args, help=help, **kwargs)  # type: ignore[call-arg]
        for param in self.params:  # type: ignore[attr-defined]
            _name_values(param)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        if not self.panels:
            return super().format_options(ctx, formatter)  # type: ignore[misc]
        place = {flag: (title, k) for title, flags in self.panels.items()
                 for k, flag in enumerate(flags)}
        arguments: list[tuple[str, str]] = []
        sections: dict[str, list[tuple[int, tuple[str, str]]]] = {
            title: [] for title in [*self.panels, "Options"]}
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            row = param.get_help_record(ctx)
            if row is None:
                continue
            if isinstance(param, TyperArgument):
                arguments.append(row)
            else:
                title, k = place.get(param.opts[0], ("Options", 0))
                sections[title].append((k, row))
        for title, rows in (("Arguments", arguments),
                            *((t, [row for _, row in sorted(placed, key=lambda p: p[0])])
                              for t, placed in sections.items())):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        super().format_epilog(ctx, formatter)  # type: ignore[misc]
        if self.examples:
            formatter.write_paragraph()
            formatter.write_text(EXAMPLE)
            for example in self.examples:  # written as is: write_text would fold it
                formatter.write(f"{' ' * (formatter.current_indent + 2)}{example}\n")


class Command(_HelpForm, TyperCommand):
    """A metrale command (`app.command(cls=Command)`)."""


# The options every command that answers for an engine shares, in one panel of its help.
ENGINE_PANEL = {"Engine (--engine vllm or sglang)": (
    "--engine", "--max-cpu-loras", "--dtype", "--lora-dtype", "--max-loaded-loras",
    "--eviction-policy", "--lora-backend")}


class InspectCommand(Command):
    """`metrale inspect`'s help: its options in panels by what they set."""

    panels = {"Pool": ("--model", "--modules", "--max-rank", "--max-loras", "--experts",
                       "--online", "--tp", "--fully-sharded"),
              **ENGINE_PANEL,
              "Checking the engine (--confirm)": ("--confirm", "--engine-python",
                                                  "--engine-args", "--confirm-timeout")}


class LayoutCommand(Command):
    """`metrale layout`'s help: its options in panels by what they set."""

    panels = {"Pool": ("--model", "--modules", "--max-rank", "--max-loras", "--budget",
                       "--align", "--experts", "--online"),
              "Tensor parallel": ("--tp", "--ep", "--fully-sharded"),
              **ENGINE_PANEL}


class Group(_HelpForm, TyperGroup):
    """A group of metrale commands (`typer.Typer(cls=Group)`)."""


# Each option is one typer.Option, used through its alias; a command that requires it or gives
# it another default annotates its own type with the same option (typer copies it per use).

MODEL = typer.Option(
    "--model", "-m", help="Base model: a preset (`metrale models`), a config.json, a model "
    "directory, or a hub id (org/name[@revision]) in the local HF cache (--online: the hub).")
# --modules of the commands that build metrale's pool alone (synth, pack, bench), and of those
# that also answer for an engine (inspect, layout, simulate), whose help names its values.
# Written out, not read from LoraModule (that would import the model into --help);
# tests/test_help.py holds it to the vocabulary.
_POOL_MODULES = ("those the model's family has, of q_proj, k_proj, v_proj, o_proj, gate_proj, "
                 "up_proj, down_proj (llama-like layers), out_proj (Gated-DeltaNet layers), "
                 "qkv_proj, gate_up_proj (phi3, glm4), q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
                 "kv_b_proj (DeepSeek's latent attention), c_fc, c_proj (starcoder2), "
                 "per_layer_input_gate, per_layer_projection (gemma4); or 'all', every module "
                 "the model has")
POOL_MODULES = typer.Option("--modules", help=f"Comma-separated modules: {_POOL_MODULES}.")
MODULES = typer.Option(
    "--modules", help=f"Comma-separated modules. metrale's pool: {_POOL_MODULES}. --engine "
    "vllm: vLLM's --lora-target-modules, its module names (qkv_proj, o_proj, gate_up_proj, "
    "down_proj, lm_head, embed_tokens, ...) or the adapter names packed into them (q_proj); "
    "no 'all'. --engine sglang: SGLang's --lora-target-modules (q_proj, ..., qkv_proj, "
    "gate_up_proj, embed_tokens, lm_head, or all).")
MAX_LORAS = typer.Option("--max-loras", help="Slots in the pool.")
ModelOpt = Annotated[str | None, MODEL]
ModulesOpt = Annotated[str | None, MODULES]
PoolModulesOpt = Annotated[str | None, POOL_MODULES]
MaxLorasOpt = Annotated[int | None, MAX_LORAS]
MaxRankOpt = Annotated[int | None, typer.Option(
    "--max-rank", help="The pool's max rank: every slot pads to it; higher ranks are not "
    "servable. Default: the adapters' largest rank rounded up to a multiple of 8, as the CUDA "
    "kernels need.")]
ExpertsOpt = Annotated[bool, typer.Option(
    "--experts", help="Serve routed-expert and router LoRA from the expert pool, a second "
    "allocation beside the slot pool (also METRALE_LORA_EXPERTS=1).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the JSON record instead.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")]
TP = typer.Option("--tp", help="Tensor-parallel degree: one pool per rank, each holding its "
                  "shard of every LoRA weight (docs/tensor-parallel.md).")
TpOpt = Annotated[int | None, TP]
EpOpt = Annotated[int | None, typer.Option(
    "--ep", help="With --tp: expert-parallel degree; experts split over it contiguously, each "
    "sharded over tp / ep ranks. Default 1.")]
FullyShardedOpt = Annotated[bool, typer.Option(
    "--fully-sharded", help="With --tp: also slice column layers' A by rank and row layers' B "
    "by output row (vLLM fully_sharded_loras).")]


def shard_spec(tp: int | None, ep: int | None, fully_sharded: bool) -> ShardSpec | None:
    """Rank 0 of the deployment --tp/--ep/--fully-sharded name, or None without --tp."""
    from metrale_cli.layout.sharding import ShardSpec  # the layout stage: not at --help

    return ShardSpec.from_options(tp, ep, fully_sharded)


def experts_on(flag: bool) -> bool:
    """The expert-pool opt-in: --experts or METRALE_LORA_EXPERTS=1."""
    return flag or env.experts_enabled()


OnlineOpt = Annotated[bool, typer.Option(
    "--online", help="Hub ids (org/name[@revision]) not in the local Hugging Face cache are "
    "fetched from the hub (also METRALE_ONLINE=1).")]


def online_on(flag: bool) -> bool:
    """The hub opt-in: --online or METRALE_ONLINE=1."""
    return flag or env.online()


ENGINE = typer.Option(
    "--engine", help="Whose answer: metrale (its own pool, the default), vllm (what vLLM "
    "0.32.0 does with the adapters, its flags and LoRA memory; vllm==0.32.0 names the "
    "version) or sglang (SGLang 0.5.23; sglang==0.5.23); docs/engines.md. Each engine takes "
    "its own options.")
EngineOpt = Annotated[str, ENGINE]
DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="With --engine vllm or sglang: the engine's --dtype (auto, float16, "
    "bfloat16, float32); auto reads the model's config.")]
LoraDtypeOpt = Annotated[str | None, typer.Option(
    "--lora-dtype", help="With --engine vllm: vLLM's --lora-dtype (auto, float16, bfloat16); "
    "auto is the model's dtype.")]
MaxCpuLorasOpt = Annotated[int | None, typer.Option(
    "--max-cpu-loras", help="With --engine vllm: vLLM's --max-cpu-loras, the host cache of "
    "adapters (default: --max-loras).")]

MaxLoadedLorasOpt = Annotated[int | None, typer.Option(
    "--max-loaded-loras", help="With --engine sglang: SGLang's --max-loaded-loras, the "
    "adapters held in CPU memory (default: no limit).")]
EvictionPolicyOpt = Annotated[str | None, typer.Option(
    "--eviction-policy", help="With --engine sglang: SGLang's --lora-eviction-policy of its "
    "GPU slots, lru (default) or fifo.")]
LoraBackendOpt = Annotated[str | None, typer.Option(
    "--lora-backend", help="With --engine sglang: SGLang's --lora-backend (csgmv, the "
    "default, triton, ascend, torch_native, triton_v2).")]


def engine_name(engine: str) -> Engine | None:
    """--engine: None for metrale's own pool, else the registered engine it names (`vllm`,
    `vllm==0.32.0`); an unknown name or version is a usage error listing the known ones."""
    from metrale_cli.engines import get_engine

    return None if engine.strip() == "metrale" else get_engine(engine)
