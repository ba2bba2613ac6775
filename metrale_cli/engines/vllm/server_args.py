"""vLLM 0.32.0's API server arguments as its own parser reads them, for `--engine-args`: every
option it has by the words it takes, and the first of the user's words it would read as no
option's value. `python -m vllm.entrypoints.openai.api_server` builds its parser in
`vllm/entrypoints/launchers/cli_args.py` `make_arg_parser` (a FlexibleArgumentParser,
`vllm/utils/argparse_utils.py`), whose one positional argument, `model_tag`, the API server
never reads: a word that lands there is dropped without a word. The table is that parser's
(`_option_string_actions`, each action's `nargs`); tests/test_engine_confirm.py holds it to
the installed vLLM's parser, and the reading of words to what the parser makes of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

# Options that take no value (store_true, BooleanOptionalAction's two spellings, --help).
NO_VALUE = frozenset({
    "--aggregate-engine-logging", "--allow-credentials", "--allow-deprecated-quantization",
    "--async-scheduling", "--cohere-is-reasoning-model", "--cudagraph-metrics",
    "--data-parallel-external-lb", "--data-parallel-hybrid-lb",
    "--data-parallel-multi-port-external-lb", "--dcp-q-replicate", "--disable-cascade-attn",
    "--disable-chunked-mm-input", "--disable-custom-all-reduce", "--disable-fastapi-docs",
    "--disable-hybrid-kv-cache-manager", "--disable-log-stats",
    "--disable-nccl-for-dp-synchronization", "--disable-sliding-window",
    "--disable-uvicorn-access-log", "--enable-auto-tool-choice",
    "--enable-batch-sharded-sampling", "--enable-chunked-prefill", "--enable-cumem-allocator",
    "--enable-dbo", "--enable-elastic-ep", "--enable-ep-weight-filter", "--enable-eplb",
    "--enable-expert-parallel", "--enable-fault-tolerance", "--enable-flash-late-interaction",
    "--enable-flashinfer-autotune", "--enable-force-include-usage", "--enable-hc-sp",
    "--enable-layerwise-nvtx-tracing", "--enable-log-deltas", "--enable-log-outputs",
    "--enable-log-requests", "--enable-logging-iteration-details", "--enable-lora",
    "--enable-mamba-cache-stochastic-rounding", "--enable-mamba-shared-prefix-checkpoint",
    "--enable-mfu-metrics", "--enable-mixed-moe-lora-format", "--enable-mm-embeds",
    "--enable-moe-shared-loras", "--enable-nccl-comm-suspend", "--enable-offline-docs",
    "--enable-per-request-metrics", "--enable-prefix-caching", "--enable-prompt-embeds",
    "--enable-prompt-tokens-details", "--enable-request-id-headers",
    "--enable-return-routed-experts", "--enable-scale-out", "--enable-server-load-tracking",
    "--enable-shm-tensor-arena", "--enable-sleep-mode", "--enable-ssl-refresh",
    "--enable-tokenizer-info-endpoint", "--enable-tower-connector-lora", "--enable-trace-replay",
    "--enforce-eager", "--exclude-tools-when-tool-choice-none", "--fail-on-environ-validation",
    "--fully-sharded-loras", "--grpc", "--headless", "--help", "--interleave-mm-strings",
    "--jit-monitor-verbose", "--kv-cache-metrics", "--kv-sharing-fast-prefill",
    "--language-model-only", "--log-error-stack", "--long-prefill-token-threshold-adaptive",
    "--mm-device-do-normalize", "--mm-encoder-only", "--no-allow-credentials",
    "--no-allow-deprecated-quantization", "--no-async-scheduling",
    "--no-cohere-is-reasoning-model", "--no-cudagraph-metrics", "--no-data-parallel-external-lb",
    "--no-data-parallel-hybrid-lb", "--no-dcp-q-replicate", "--no-disable-cascade-attn",
    "--no-disable-chunked-mm-input", "--no-disable-custom-all-reduce",
    "--no-disable-fastapi-docs", "--no-disable-hybrid-kv-cache-manager",
    "--no-disable-nccl-for-dp-synchronization", "--no-disable-sliding-window",
    "--no-disable-uvicorn-access-log", "--no-enable-auto-tool-choice",
    "--no-enable-batch-sharded-sampling", "--no-enable-chunked-prefill",
    "--no-enable-cumem-allocator", "--no-enable-dbo", "--no-enable-elastic-ep",
    "--no-enable-ep-weight-filter", "--no-enable-eplb", "--no-enable-expert-parallel",
    "--no-enable-fault-tolerance", "--no-enable-flash-late-interaction",
    "--no-enable-flashinfer-autotune", "--no-enable-force-include-usage", "--no-enable-hc-sp",
    "--no-enable-layerwise-nvtx-tracing", "--no-enable-log-deltas", "--no-enable-log-outputs",
    "--no-enable-log-requests", "--no-enable-logging-iteration-details", "--no-enable-lora",
    "--no-enable-mamba-cache-stochastic-rounding", "--no-enable-mamba-shared-prefix-checkpoint",
    "--no-enable-mfu-metrics", "--no-enable-mixed-moe-lora-format", "--no-enable-mm-embeds",
    "--no-enable-moe-shared-loras", "--no-enable-nccl-comm-suspend", "--no-enable-offline-docs",
    "--no-enable-per-request-metrics", "--no-enable-prefix-caching", "--no-enable-prompt-embeds",
    "--no-enable-prompt-tokens-details", "--no-enable-request-id-headers",
    "--no-enable-return-routed-experts", "--no-enable-scale-out",
    "--no-enable-server-load-tracking", "--no-enable-shm-tensor-arena", "--no-enable-sleep-mode",
    "--no-enable-ssl-refresh", "--no-enable-tokenizer-info-endpoint",
    "--no-enable-tower-connector-lora", "--no-enable-trace-replay", "--no-enforce-eager",
    "--no-exclude-tools-when-tool-choice-none", "--no-fail-on-environ-validation",
    "--no-fully-sharded-loras", "--no-interleave-mm-strings", "--no-jit-monitor-verbose",
    "--no-kv-cache-metrics", "--no-kv-sharing-fast-prefill", "--no-language-model-only",
    "--no-log-error-stack", "--no-long-prefill-token-threshold-adaptive",
    "--no-mm-device-do-normalize", "--no-mm-encoder-only", "--no-numa-bind",
    "--no-ray-workers-use-nsight", "--no-return-sampling-mask", "--no-return-tokens-as-token-ids",
    "--no-scheduler-reserve-full-isl", "--no-skip-mm-profiling", "--no-skip-tokenizer-init",
    "--no-sleep-mode-offload-cudagraph", "--no-specialize-active-lora", "--no-swa-bounded-replay",
    "--no-tokens-only", "--no-trust-remote-code", "--no-trust-request-chat-template",
    "--no-trust-request-mm-kwargs", "--no-use-fp64-gumbel", "--no-use-replayssm",
    "--no-use-tqdm-on-load", "--numa-bind", "--ray-workers-use-nsight", "--return-sampling-mask",
    "--return-tokens-as-token-ids", "--scheduler-reserve-full-isl", "--skip-mm-profiling",
    "--skip-tokenizer-init", "--sleep-mode-offload-cudagraph", "--specialize-active-lora",
    "--swa-bounded-replay", "--tokens-only", "--trust-remote-code",
    "--trust-request-chat-template", "--trust-request-mm-kwargs", "--use-fp64-gumbel",
    "--use-replayssm", "--use-tqdm-on-load", "-dpe", "-dph", "-dpm", "-ep", "-h"
})
# Options that take every word up to the next option (nargs "+").
MANY_VALUES = frozenset({
    "--allowed-media-domains", "--api-key", "--collect-detailed-traces", "--cpu-offload-params",
    "--cudagraph-capture-sizes", "--ignore-patterns", "--kv-cache-dtype-skip-layers",
    "--logits-processors", "--lora-modules", "--lora-target-modules", "--numa-bind-cpus",
    "--numa-bind-nodes", "--offload-params", "--served-model-name",
    "--sleep-preserve-parameter-names"
})
# Options that take one word where one follows (nargs "?").
OPTIONAL_VALUE = frozenset({
    "--hf-token"
})
# Options that take one word.
ONE_VALUE = frozenset({
    "--additional-config", "--all2all-backend", "--allowed-headers", "--allowed-local-media-path",
    "--allowed-methods", "--allowed-origins", "--anthropic-disabled-thinking-effort",
    "--api-server-count", "--attention-backend", "--attention-config", "--aux-output-config",
    "--block-size", "--chat-template", "--chat-template-content-format", "--code-revision",
    "--cohere-format", "--compilation-config", "--config", "--config-format", "--convert",
    "--cp-kv-cache-interleave-size", "--cpu-distributed-timeout-seconds", "--cpu-offload-gb",
    "--custom-histogram-buckets", "--data-parallel-address", "--data-parallel-backend",
    "--data-parallel-rank", "--data-parallel-rpc-port", "--data-parallel-size",
    "--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-supervisor-port",
    "--dbo-decode-token-threshold", "--dbo-prefill-token-threshold", "--dcp-comm-backend",
    "--dcp-kv-cache-interleave-size", "--decode-context-parallel-size",
    "--default-chat-template-kwargs", "--default-mm-loras", "--device-ids",
    "--device-memory-utilization", "--diffusion-config", "--disable-access-log-for-endpoints",
    "--distributed-executor-backend", "--distributed-timeout-seconds", "--download-dir",
    "--dp-supervisor-probe-failure-threshold", "--dp-supervisor-probe-interval-s",
    "--dp-supervisor-probe-timeout-s", "--dp-sync-interval", "--dtype", "--ec-manager-config",
    "--ec-transfer-config", "--elastic-ep-max-dp-size", "--engram-config", "--eplb-config",
    "--expert-placement-strategy", "--fault-tolerance-config", "--fingerprint-mode",
    "--fingerprint-value", "--gdn-prefill-backend", "--generation-config",
    "--gpu-memory-utilization", "--grpc-port", "--h11-max-header-count",
    "--h11-max-incomplete-event-size", "--hf-config-path", "--hf-overrides", "--host",
    "--io-processor-plugin", "--ir-op-priority", "--jit-monitor-mode", "--kda-decode-backend",
    "--kda-prefill-backend", "--kernel-config", "--kv-cache-dtype", "--kv-cache-memory-bytes",
    "--kv-cache-metrics-sample", "--kv-events-config", "--kv-offloading-backend",
    "--kv-offloading-size", "--kv-transfer-config", "--limit-mm-per-prompt", "--linear-backend",
    "--load-format", "--log-config-file", "--log-level", "--logging-config", "--logprobs-mode",
    "--long-prefill-token-threshold", "--lora-dtype", "--mamba-backend", "--mamba-block-size",
    "--mamba-cache-dtype", "--mamba-cache-mode", "--mamba-cache-philox-rounds",
    "--mamba-ssm-cache-dtype", "--mamba-ssu-algorithm", "--master-addr", "--master-port",
    "--max-cpu-loras", "--max-cudagraph-capture-size", "--max-log-len", "--max-logprobs",
    "--max-lora-cls-labels", "--max-lora-rank", "--max-loras", "--max-model-len",
    "--max-num-active-seqs", "--max-num-batched-tokens", "--max-num-queued-reqs",
    "--max-num-queued-tokens", "--max-num-scheduled-tokens", "--max-num-seqs",
    "--max-parallel-loading-workers", "--media-io-kwargs", "--middleware",
    "--mm-encoder-attn-backend", "--mm-encoder-attn-dtype", "--mm-encoder-fp8-scale-path",
    "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path",
    "--mm-encoder-tp-mode", "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb",
    "--mm-processor-cache-gb", "--mm-processor-cache-type", "--mm-processor-device",
    "--mm-processor-kwargs", "--mm-shm-cache-max-object-size-mb", "--mm-tensor-ipc", "--model",
    "--model-class-overrides", "--model-impl", "--model-loader-extra-config", "--moe-backend",
    "--nnodes", "--node-rank", "--num-gpu-blocks-override", "--offload-backend",
    "--offload-group-size", "--offload-num-in-group", "--offload-prefetch-step",
    "--optimization-level", "--otlp-traces-endpoint", "--override-generation-config",
    "--per-request-spec-decode-metrics", "--performance-mode", "--pipeline-parallel-size",
    "--pooler-config", "--port", "--prefill-context-parallel-size", "--prefill-schedule-interval",
    "--prefix-cache-retention-interval", "--prefix-caching-hash-algo", "--prefix-match-unit",
    "--profiler-config", "--pt-load-map-location", "--quantization", "--quantization-config",
    "--reasoning-config", "--reasoning-parser", "--reasoning-parser-plugin",
    "--renderer-num-workers", "--replayssm-buffer-len", "--response-role", "--revision",
    "--root-path", "--runner", "--safetensors-load-strategy", "--safetensors-prefetch-block-size",
    "--safetensors-prefetch-num-threads", "--scheduler-cls", "--scheduling-policy", "--seed",
    "--show-hidden-metrics-for-version", "--shutdown-timeout", "--sparse-indexer-topk-backend",
    "--spec-method", "--spec-model", "--spec-tokens", "--speculative-config",
    "--sse-keep-alive-interval", "--ssl-ca-certs", "--ssl-cert-reqs", "--ssl-certfile",
    "--ssl-ciphers", "--ssl-keyfile", "--stream-interval", "--structured-outputs-config",
    "--tensor-parallel-size", "--tokenizer", "--tokenizer-mode", "--tokenizer-revision",
    "--tool-call-parser", "--tool-parser-plugin", "--tool-server", "--tool-strict-level",
    "--ubatch-size", "--uds", "--uvicorn-log-level", "--video-pruning-method",
    "--video-pruning-rate", "--watermark", "--watermark-config", "--weight-transfer-config",
    "--worker-cls", "--worker-extension-cls", "-ac", "-asc", "-cc", "-dc", "-dcp", "-dp", "-dpa",
    "-dpb", "-dpl", "-dpn", "-dpp", "-dpr", "-n", "-pcp", "-pp", "-q", "-r", "-sc", "-tp"
})

OPTIONS = NO_VALUE | MANY_VALUES | OPTIONAL_VALUE | ONE_VALUE


def nargs(option: str) -> int | str:
    """The words `option` takes, as its parser declares them (`nargs`): 0, 1, "?" (one where
    one follows) or "+" (every word up to the next option)."""
    if option in NO_VALUE:
        return 0
    if option in MANY_VALUES:
        return "+"
    if option in OPTIONAL_VALUE:
        return "?"
    if option in ONE_VALUE:
        return 1
    raise KeyError(option)


# argparse reads a word like these as a value, not an option, where no option looks like one.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _rewritten(words: Sequence[str]) -> list[tuple[str, str]]:
    """`words` as FlexibleArgumentParser.parse_args hands them to argparse, each with the words
    it came from: `_` read as `-` in a long option's name up to its first `.`, `-O3` and `-O 3`
    as `--optimization-level 3`, and each dotted key (`--compilation-config.mode 3`, `-x.y=1`)
    taken out with its value and given back after the rest as its option and a JSON value."""
    out: list[tuple[str, str]] = []
    for i, word in enumerate(words):
        if word.startswith("--help="):
            out.append(("--help", word))
        elif word.startswith("--"):
            key, eq, value = word.partition("=")
            head, dot, tail = key[2:].partition(".")
            out.append((f"--{head.replace('_', '-')}{dot}{tail}{eq}{value}", word))
        elif word.startswith("-O") and word != "-O":
            out += [("--optimization-level", word),
                    (word[3:] if word[2:3] == "=" else word[2:], word)]
        elif word == "-O" and words[i + 1:i + 2] in (["0"], ["1"], ["2"], ["3"]):
            out.append(("--optimization-level", word))
        else:
            out.append((word, word))
    kept: list[tuple[str, str]] = []
    keys: dict[str, str] = {}  # option -> the words of its first dotted key
    taken = -1  # the index of a dotted key's value
    for i, (word, source) in enumerate(out):
        if i == taken:
            continue
        name, eq, _ = word.partition("=")
        if not word.startswith("-") or "." not in name:
            kept.append((word, source))
            continue
        if not eq:
            taken = i + 1
            source = " ".join([source, *(s for _, s in out[i + 1:i + 2])])
        keys.setdefault(name.removesuffix("+").split(".")[0], source)
    return kept + [w for key, source in keys.items() for w in ((key, source), ("{}", source))]


def _option(word: str) -> tuple[str | None, bool] | None:
    """What argparse (Python 3.11's `_parse_optional`) makes of `word`: None for a value (a
    positional word), else the option it names (None: none, or several of its prefixes) and
    whether its value is attached (`--port=1`, `-n2`)."""
    if not word.startswith("-"):
        return None
    if word in OPTIONS:
        return word, False
    if len(word) == 1:
        return None
    name, eq, _ = word.partition("=")
    if eq and name in OPTIONS:
        return name, True
    if word.startswith("--"):
        matches = [(o, bool(eq)) for o in OPTIONS if o.startswith(name)]
    else:  # `-n2`: the one-letter option with its value; else a prefix (`-t` for `-tp`)
        matches = [(o, o == word[:2]) for o in OPTIONS if o == word[:2] or o.startswith(word)]
    if len(matches) == 1:
        return matches[0]
    if not matches and (_NEGATIVE_NUMBER.match(word) or " " in word):
        return None
    return None, False  # unknown or ambiguous: vLLM refuses it itself


def bare_word(words: Sequence[str]) -> tuple[str, str | None] | None:
    """The first of `words` vLLM's parser would read as no option's value, and so as its
    positional model tag (which the API server ignores), with the option before it where that
    takes no value; None where every word is an option or an option's value."""
    room: float = 0  # the words the option before may still take
    before: str | None = None
    for word, source in _rewritten(words):
        found = _option(word)
        if found is None:
            if room:
                room -= 1
                continue
            return source, before
        name, attached = found
        # An option vLLM does not have, or a prefix of several: vLLM refuses it itself, and
        # what follows is not judged (another vLLM's option may take it).
        takes = math.inf if name is None else 0 if attached else nargs(name)
        before = name if takes == 0 and not attached else None
        room = math.inf if takes == "+" else 1 if takes == "?" else takes
    return None
