"""What vLLM's own argument parser makes of words: the parser `python -m
vllm.entrypoints.openai.api_server` builds, its spellings as vLLM reads them. Runs under
`.venv-vllm`'s python, never under the suite's (it imports no metrale and no test helper).

    .venv-vllm/bin/python tests/support/vllm_argparse.py IN.json OUT.json

IN:  {"words": [WORD, ...], "argv": [ARG, ...], "commands": [[ARG, ...], ...]}
OUT: {"options": {OPTION: DEST, ...} (every option string the parser has),
      "nargs": {OPTION: NARGS, ...} (the words each takes: 0, 1, "?" or "+"),
      "max_lora_ranks": [RANK, ...] (the values --max-lora-rank takes),
      "tags": [TAG | null, ...] (per command, what the parser put in its positional model_tag,
              values neither converted nor checked: where a word no option takes lands),
      "resolved": {WORD: DEST | "ambiguous" | null, ...} (the option each word, followed by a
                  value, is read as: after FlexibleArgumentParser's rewriting (`_` for `-`, the
                  dotted JSON keys, `-O3`) and argparse's own matching (prefixes included)),
      "parsed": {"host": ..., "port": ..., ...} (the options `argv` sets, parsed whole)}
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import Any

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

PARSED = ("model", "host", "port", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
          "lora_dtype", "dtype", "lora_target_modules", "tensor_parallel_size",
          "fully_sharded_loras", "lora_modules")


class _Rewritten(Exception):
    def __init__(self, args: list[str]) -> None:
        self.args_after = args


class Resolver(FlexibleArgumentParser):
    """vLLM's parser that stops after its own rewriting of the words, before argparse's parse."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        raise _Rewritten(list(args))


def resolve(parser: Resolver, word: str) -> str | None:
    try:
        parser.parse_args([word, "1"])
    except _Rewritten as done:
        rewritten = done.args_after
    except (ValueError, OSError):  # `--config 1`: the file is read (and fails) here
        return parser._option_string_actions["--config"].dest
    option = next((a for a in rewritten if a.startswith("-")), None)
    if option is None:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            found = parser._parse_optional(option)
    except SystemExit:  # argparse's error: ambiguous
        return "ambiguous"
    if isinstance(found, list):  # Python 3.12.7+: one tuple per interpretation
        found = found[0] if len(found) == 1 else None
    if not found or found[0] is None:
        return None
    return str(found[0].dest)


def raw_parser() -> FlexibleArgumentParser:
    """vLLM's parser with every option's value taken as the raw word, unchecked: which words
    an option takes, not what it accepts, decides."""
    parser = make_arg_parser(FlexibleArgumentParser())
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            action.type, action.choices = None, None
            action.__class__ = type(f"Raw{type(action).__name__}", (type(action),),
                                    {"__call__": lambda *_args, **_kwargs: None})
    return parser


def model_tag(parser: FlexibleArgumentParser, command: list[str]) -> str | None:
    """The positional model tag `parser` reads in `command` (with `--model /m` after it)."""
    namespace = argparse.Namespace()
    with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args([*command, "--model", "/m"], namespace)
    return getattr(namespace, "model_tag", None)


def main() -> None:
    with open(sys.argv[1]) as f:
        given = json.load(f)
    parser = make_arg_parser(Resolver())
    real = make_arg_parser(FlexibleArgumentParser())
    raw = raw_parser()
    parsed = vars(real.parse_args(given["argv"])) if given.get("argv") else {}
    out = {"options": {o: a.dest for o, a in parser._option_string_actions.items()},
           "nargs": {o: 1 if a.nargs is None else a.nargs
                     for o, a in parser._option_string_actions.items()},
           "max_lora_ranks": list(parser._option_string_actions["--max-lora-rank"].choices),
           "tags": [model_tag(raw, c) for c in given.get("commands", [])],
           "resolved": {w: resolve(parser, w) for w in given["words"]},
           "parsed": {k: parsed[k] for k in PARSED if k in parsed}}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main()
