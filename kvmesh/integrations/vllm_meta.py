"""What the vLLM connector's scheduler side hands its workers each step, and what they report back (vLLM carries
both between its processes: `KVConnectorMetadata` and `KVConnectorWorkerMetadata`).

    LoadJob       fetch chunks of one prompt and one KV cache group, and write them into vLLM's blocks
    SaveJob       save chunks of one prompt and one group from its blocks
    StepMeta      one step's loads, saves and preempted requests, and whether it is a lone prompt's prefill
    WorkerReport  prefill and transfer times for the cost model, failed loads
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadJob:
    """Fetch chunks [first_chunk, end_chunk) of a prompt and write them into its blocks."""

    req_id: str
    tokens: bytes  # the prompt's token ids through chunk end_chunk, little-endian uint32 (for the chunk hashes)
    first_chunk: int
    end_chunk: int
    block_ids: list[int]  # the engine blocks of chunks [first_chunk, end_chunk), in token order
    skip_blocks: int  # leading blocks of block_ids vLLM already has (its own prefix cache) or keeps none of (a
    # sliding window's null blocks): never written
    fill_blocks: int  # block_ids[skip_blocks:fill_blocks] are written; vLLM treats them as computed
    salt: str | None
    lora_id: str | None
    sync: bool  # written during this step's forward pass (layer by layer) instead of between steps
    group: int = 0  # the KV cache group (index into the connector's specs) whose blocks these are


@dataclass
class SaveJob:
    """Save chunks [first_chunk, end_chunk) of a prompt, computed by the end of this step, from its blocks."""

    req_id: str
    tokens: bytes
    first_chunk: int
    end_chunk: int
    block_ids: list[int]
    salt: str | None
    lora_id: str | None
    group: int = 0


@dataclass
class StepMeta(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests whose blocks vLLM reuses from this step on
    prefill: tuple[int, int] | None = None  # (new, past) tokens when the step is one prompt's prefill, from 0


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Measurements the workers send back for the scheduler's cost model."""

    prefills: list[tuple[int, int, float]] = field(default_factory=list)  # (new, past, seconds)
    transfers: list[tuple[str, int, float]] = field(default_factory=list)  # (source, bytes, seconds)
    failed_loads: list[tuple[str, str]] = field(default_factory=list)  # (request, unreachable holder node or "")
    resave: list[str] = field(default_factory=list)  # requests whose saves of a step were dropped: save them again

    def aggregate(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(
            self.prefills + other.prefills,
            self.transfers + other.transfers,
            self.failed_loads + other.failed_loads,
            self.resave + other.resave,
        )
