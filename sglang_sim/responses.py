"""JSON bodies the simulator sends back: /generate results, server info and Prometheus metrics.

Kept apart from the routes so the contract invariants (completion_tokens == len(output_ids), EOS
last on a stop and absent from the text, length == max_new_tokens on a length finish) live in one
small function that tests can read next to reference/sglang-generate.md.
"""
from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from typing import Any, Mapping

from sglang_sim.config import SimConfig
from sglang_sim.engine import EngineStats, Outcome
from sglang_sim.textgen import Lexicon, OutputPlan, render

VERSION = "0.5.23-sim"
MODEL_PATH = "sglang-sim"
WEIGHT_VERSION = "default"  # SGLang's --weight-version default
# finish_reason messages as SGLang words them.
ABORT_QUEUED_MESSAGE = "Abort before prefill"
ABORT_RUNNING_MESSAGE = "Aborted"  # recorded from 0.5.23 (tests/fixtures/sglang_real/generate_abort.json)


def generate_body(
    lexicon: Lexicon,
    cfg: SimConfig,
    rid: str,
    plan: OutputPlan,
    stops: bool,
    max_new_tokens: int,
    prompt_tokens: int,
    outcome: Outcome,
    e2e_latency: float,
    abort_message: str | None = None,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """The 200 body of one /generate request (finished or aborted; `abort_message` overrides SGLang's)."""
    finish: dict[str, Any]
    if outcome.aborted:
        message = abort_message or (ABORT_RUNNING_MESSAGE if outcome.started else ABORT_QUEUED_MESSAGE)
        finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
        text, output_ids = render(lexicon, plan, outcome.generated, None, skip_special_tokens)
        if not outcome.started:
            prompt_tokens = 0  # SGLang reports a request aborted in the queue with zero counts
    elif stops:
        text, output_ids = render(lexicon, plan, plan.body_len(), cfg.eos_id, skip_special_tokens)
        finish = {"type": "stop", "matched": output_ids[-1]}
    else:
        finish = {"type": "length", "length": max_new_tokens}
        text, output_ids = render(lexicon, plan, max_new_tokens, None, skip_special_tokens)
    # meta_info's keys in SGLang 0.5.23's order (tokenizer_manager._handle_batch_output), as recorded from the real
    # engine (tests/fixtures/sglang_real). Only id, finish_reason and the counts mean anything here: one weight
    # version ("default", its span the whole output), no retraction, no data parallelism, no reasoning parser.
    completion = len(output_ids)
    cached = outcome.cached_tokens if outcome.started else 0
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "weight_version": WEIGHT_VERSION,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": completion,
            "cached_tokens": cached,
            "cached_tokens_details": {"device": cached, "host": 0} if cached else None,  # null when none, as 0.5.23
            "weight_versions": [{"version": WEIGHT_VERSION, "start": 0, "end": completion}],
            "dp_rank": None,
            "e2e_latency": e2e_latency,
            "response_sent_to_client_ts": time.time(),
        },
    }


def model_info(cfg: SimConfig) -> dict[str, Any]:
    """/model_info (= /get_model_info): SGLang 0.5.23's keys (http_server.model_info); the model is the
    simulator's own, so model_type and architectures name it."""
    return {
        "model_path": MODEL_PATH, "served_model_name": MODEL_PATH, "tokenizer_path": cfg.tokenizer, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": WEIGHT_VERSION, "load_format": "auto",
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False, "model_type": MODEL_PATH,
        "architectures": ["SGLangSim"],
        "embedding": EMBEDDING,
    }


#: /model_info's ``embedding`` block as 0.5.23 answers it for a generation model (recorded): nothing enabled.
EMBEDDING: dict[str, Any] = {"family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined", "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default", "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False, "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled", "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False, "enabled": False, "matryoshka_dimensions": [], "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096, "capture_batch_sizes": [4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1280, 1536, 1792, 2048, 2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096]}, "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False}}



def server_info(cfg: SimConfig, stats: EngineStats) -> dict[str, Any]:
    """/get_server_info: server args (api key masked), internal_states and version, as SGLang."""
    args = dataclasses.asdict(cfg)
    args["api_key"] = None if cfg.api_key is None else "***"
    return {
        **args,
        "model_path": MODEL_PATH,
        "served_model_name": MODEL_PATH,
        "tokenizer_path": cfg.tokenizer,
        "max_running_requests": cfg.max_running,
        # What budgetq (budget/serverinfo.py) and SGLang's router read, with 0.5.23's types. No KV-cache limit is
        # modelled: max_total_num_tokens never binds (producer/launch.py reads it as a per-request cap).
        "max_total_num_tokens": cfg.context_length * cfg.max_running,
        "max_req_input_len": cfg.context_length - 6,
        "tp_size": 1, "dp_size": 1, "random_seed": cfg.seed, "reasoning_parser": None, "tool_call_parser": None,
        "enable_deterministic_inference": False, "page_size": 1, "chunked_prefill_size": 8192, "device": "cuda",
        # The scheduler's own limit, per data-parallel rank (0.5.23 reports it here; the top-level
        # max_running_requests is the --max-running-requests argument, null unless set)
        "internal_states": [{"last_gen_throughput": stats.last_gen_throughput,
                             "effective_max_running_requests_per_dp": cfg.max_running}],
        "version": VERSION,
    }


def loads_body(cfg: SimConfig, stats: EngineStats) -> dict[str, Any]:
    """/v1/loads (SGLang 0.5.23, sglang/srt/entrypoints/v1_loads.py): one entry per data-parallel rank of the
    scheduler's LoadSnapshot core keys. Only the request counts and the limits mean anything: no KV cache is
    modelled, so the token counts are 0."""
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": VERSION,
        "accelerator": None,
        "num_accelerators": 1,
        "loads": [{
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": stats.running, "num_waiting_reqs": stats.queued,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 0, "num_active_tokens": 0,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": cfg.context_length * cfg.max_running, "max_running_requests": cfg.max_running,
            "token_usage": 0.0, "gen_throughput": stats.last_gen_throughput, "cache_hit_rate": 0.0,
            "utilization": stats.running / cfg.max_running,
            "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0,
        }],
    }


def get_load_body(stats: EngineStats) -> list[dict[str, Any]]:
    """/get_load: the legacy shape (SGLang before /v1/loads, and the deprecated shim after it): per rank,
    ``num_reqs`` = running + waiting, ``num_waiting_reqs`` = waiting."""
    return [{"dp_rank": 0, "num_reqs": stats.running + stats.queued, "num_waiting_reqs": stats.queued,
             "num_tokens": 0, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}]


def stats_body(cfg: SimConfig, stats: EngineStats, faults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """/sim/stats: counters plus occupancy integrals for benchmarks, and the fault counters."""
    body = {**dataclasses.asdict(stats), **(faults or {})}
    body["mean_running"] = stats.running_integral / stats.uptime if stats.uptime > 0 else 0.0
    body["time_scale"] = cfg.time_scale
    return body


def metrics_text(stats: EngineStats) -> str:
    """/metrics in Prometheus text format with SGLang's metric names."""
    label = f'{{model_name="{MODEL_PATH}"}}'
    rows = [
        ("num_running_reqs", "gauge", "The number of running requests.", stats.running),
        ("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", stats.queued),
        ("gen_throughput", "gauge", "The generation throughput (token/s).", stats.last_gen_throughput),
        ("prompt_tokens_total", "counter", "Number of prefill tokens processed.", stats.prompt_tokens_total),
        ("generation_tokens_total", "counter", "Number of generation tokens processed.", stats.completion_tokens_total),
        ("cached_tokens_total", "counter", "Number of cached prompt tokens.", stats.cached_tokens_total),
        ("num_requests_total", "counter", "Number of requests processed.", stats.completed + stats.aborted),
        ("num_aborted_requests_total", "counter", "Number of requests aborted.", stats.aborted),
    ]
    lines: list[str] = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} {kind}", f"sglang:{name}{label} {float(value)}"]
    return "\n".join(lines) + "\n"
