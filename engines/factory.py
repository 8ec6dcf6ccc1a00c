"""Build any in-house engine from the same model directory and the same KV budget."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engines.kv import make_policy
from engines.kv.faults import inject
from engines.memory.kinds import make_memory
from engines.oom import OnOOM
from engines.registry import IN_HOUSE, REGISTRY, memory_refusal, names
from engines.scheduled.scheduler import SchedulerConfig
from engines.shapes import ModelShape, batched_tokens, forward_headroom_bytes


class EngineConfigError(ValueError):
    """A configuration that cannot serve: said at start, before any request."""


@dataclass
class EngineSpec:
    engine: str
    model_dir: str
    kv_budget_bytes: int
    max_seq_len: int | None = None
    block_size: int = 16
    reserve: Literal["max", "pow2", "oracle"] = "max"
    preflight: bool = True  # contiguous: wait for free bytes before admitting (Orca); False: try, and OOM
    on_oom: OnOOM | None = None  # crash for hf, reject otherwise
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_batch: int = 8  # hf: requests per static batch
    prefix_caching: bool = True
    memory: str = "arena"
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF's syntax: the caching emulator's settings
    device: str = "cpu"
    kv_fault: str | None = None  # fault injection (engines/kv/faults.py): tests of the integrity and memory gates only


def cfg_shape(spec: EngineSpec, hf_model) -> ModelShape:
    return ModelShape.from_config(spec.model_dir, hf_model.config.to_dict())


def device_memory(spec: EngineSpec, capacity_bytes: int, headroom_bytes: int):
    """The KV's memory on the model's device; one line where it cannot be (no CUDA, a CPU model)."""
    try:
        return make_memory(spec.memory, capacity_bytes, spec.device, headroom_bytes=headroom_bytes,
                           alloc_conf=spec.alloc_conf)
    except (ValueError, RuntimeError) as e:
        raise EngineConfigError(f"--memory {spec.memory}: {e}") from None


def make_engine(spec: EngineSpec):
    # torch and transformers load when an engine is built, not on `import engines.factory` (which loads neither);
    # looked up here, so tests/test_transformers_api.py's patch of load_hf_model shows a refusal comes first
    from engines.scheduled.model import load_hf_model

    known = REGISTRY.get(spec.engine)
    if known is None or not known.in_house:
        raise EngineConfigError(f"unknown engine {spec.engine!r}; engines: {', '.join(names(*IN_HOUSE))}")
    if refused := memory_refusal([spec.engine], spec.memory):
        # a contiguous policy's rows index one store; the caching allocator hands every sequence a tensor of
        # its own, which the runner cannot read as rows of one buffer
        raise EngineConfigError(refused)
    if not (Path(spec.model_dir) / "config.json").is_file():
        raise EngineConfigError(f"model directory {spec.model_dir!r} has no config.json")
    if spec.engine == "hf-cb":
        # transformers loads with the hf-cb engine alone (engines/peers/transformers_api.py imports it)
        from engines.peers.transformers_api import continuous_batching_refusal

        if refused := continuous_batching_refusal():
            raise EngineConfigError(refused)
    with out_of_device_memory(spec):
        hf_model = load_hf_model(spec.model_dir, spec.device)
    cfg = hf_model.config
    max_seq_len = spec.max_seq_len or cfg.max_position_embeddings
    if max_seq_len > cfg.max_position_embeddings:
        raise EngineConfigError(
            f"--max-seq-len {max_seq_len} exceeds the model's context of {cfg.max_position_embeddings}"
        )
    kvb = cfg_shape(spec, hf_model).kv_bytes_per_token(str(hf_model.dtype).split(".")[-1])
    if refused := known.budget.refusal(spec.kv_budget_bytes, max_seq_len, kvb):
        raise EngineConfigError(f"KV budget {spec.kv_budget_bytes} B is {refused}")
    if spec.kv_fault and spec.engine != "paged":
        raise EngineConfigError(f"--inject-kv-fault {spec.kv_fault} is a paged pool's bug: it needs the paged engine, "
                                f"not {spec.engine}")
    if spec.engine == "hf":
        # each engine's module (torch, transformers) loads when that engine is built
        from engines.peers.hf import HFEngine

        headroom = cfg_shape(spec, hf_model).activation_bytes(hf_model.dtype.itemsize, spec.max_batch * max_seq_len,
                                                              spec.max_batch)
        with out_of_device_memory(spec):
            return HFEngine(hf_model, spec, max_seq_len, kvb, device_memory(spec, spec.kv_budget_bytes, headroom))
    if spec.engine == "hf-cb":
        # each engine's module (torch, transformers) loads when that engine is built
        from engines.peers.hf_cb import HFContinuousBatchingEngine

        return HFContinuousBatchingEngine(hf_model, spec, max_seq_len, kvb)
    # torch: the scheduled engines' modules load when one is built, not with the factory
    from engines.scheduled.engine import ScheduledEngine
    from engines.scheduled.model import fused_weights

    policy = f"static-{spec.reserve}" if spec.engine == "static" else spec.engine
    batched = batched_tokens(max_seq_len, spec.max_num_batched_tokens)
    with out_of_device_memory(spec):
        # the weights re-laid for the runner before a cuda memory sets its cap: the cap is what is in use then
        # + the KV + a forward's headroom, and the copies are not the forward's (Llama-3-8B's lm_head alone held
        # 1.96 GiB more where the cap left 0.85)
        fused_weights(hf_model)
        if str(spec.device).startswith("cuda"):
            # each original weight was freed into PyTorch's cache as it was fused (8.15 GiB of 23.11 reserved for
            # Llama-3-8B bf16, in the allocator emulator): given back, so that no reserved figure (samples, the
            # debug pass, NVML) carries what is neither the weights, the KV nor fragmentation
            import torch

            torch.cuda.empty_cache()
        memory = device_memory(spec, spec.kv_budget_bytes,
                               forward_headroom_bytes(cfg_shape(spec, hf_model), hf_model.dtype.itemsize, batched,
                                                      spec.max_num_seqs, spec.kv_budget_bytes // kvb, max_seq_len))
        try:
            kv = make_policy(policy, memory, kvb, max_seq_len, spec.block_size, spec.preflight, spec.prefix_caching)
            if spec.kv_fault:
                kv = inject(kv, spec.kv_fault)
        except ValueError as e:
            memory.close()
            raise EngineConfigError(str(e)) from None
        except BaseException:  # the device refused the KV's pool: the process's cap as it was
            memory.close()
            raise
    if kv.longest_sequence_tokens() < max_seq_len:
        raise EngineConfigError(
            f"KV budget {spec.kv_budget_bytes} B holds {kv.longest_sequence_tokens()} tokens in one sequence as the "
            f"{kv.name} policy allocates them, fewer than max_seq_len {max_seq_len}"
        )
    config = SchedulerConfig(
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=batched,
        on_oom=spec.on_oom or "reject",
    )
    return ScheduledEngine(spec.engine, hf_model, kv, config, max_seq_len)


@contextmanager
def out_of_device_memory(spec: EngineSpec):
    """torch's OutOfMemoryError while an engine is built (its weights' layout, its KV pool) as one line: the
    engine does not fit the device as asked."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as e:
        said = str(e).split(". GPU")[0].split("\n")[0]
        raise EngineConfigError(f"{spec.engine} does not fit on {spec.device} with a KV budget of "
                                f"{spec.kv_budget_bytes} B ({said}): a smaller --kv-budget or model, or a device "
                                "with more free memory") from None


__all__ = ["EngineConfigError", "EngineSpec", "forward_headroom_bytes", "make_engine"]
