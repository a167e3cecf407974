"""SGLang HiCache L3 storage backend: `KVMeshStorage`, so SGLang engines on different nodes share prefix KV.

SGLang keeps its L1 (GPU) and L2 (host) tiers private to each engine; its L3 `HiCacheStorage` backend is the one
tier that can span nodes. Load it with

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "kvmesh", "module_path": "kvmesh.integrations.sglang", "class_name": "KVMeshStorage",
        "interface_v1": 1, "ray_address": "auto", ...}'

SGLang constructs it as `KVMeshStorage(storage_config, kwargs)` in its scheduler process, then registers the host
pool, whose geometry completes the kvmesh spec. Primitives (the backend never raises out of a batch call and never
answers one with None: failures become misses or False entries, counted in `counts`):

    batch_exists(keys, extra_info) -> int      read, one directory round trip: leading pages with a live holder
    batch_get_v1(keys, host_indices) -> [bool] reads: pages from this node's slab or a peer into the host pool
    batch_set_v1(keys, host_indices) -> [bool] mutates: pages from the host pool into this node's tier, waited for
    get/set/exists, batch_get/batch_set         the same through flat page tensors (SGLang's older interface)
    clear()                                     mutates: a new generation for this spec and salt, cluster-wide
    get_stats() -> StorageMetrics               pages and bandwidth per call since the last get_stats

Identity. SGLang names pages by chained SHA-256 page hashes (seeded by the request's extra_key/cache_salt); token
ids never reach an L3 backend. A kvmesh chunk is one SGLang page (`chunk_tokens` = page size), and its key mixes
SGLang's page key into kvmesh's own namespace, so engines whose specs differ never share a page, whatever SGLang's
keys say. Byte layout (written down once):

    root  = hashing.root_hash(spec.namespace, cache_salt)
    gen   = the generation of (spec, salt): an integer in Redis at  P:sglang:{<root hex>}:gen  (created at a random
            number: see kvmesh.directory.generations)
    group = BLAKE2b-128(root ‖ gen as <u8,                        person=b"kvmesh.sglgrp")
    key_i = BLAKE2b-128(group ‖ SGLang page key i as UTF-8,       person=b"kvmesh.sglang")

SGLang's page key already names its whole prefix, so key_i does too. The spec comes from the storage config, the
host pool and SGLang's server args: model id (name plus revision, or a fingerprint of a local model directory's
files; then `--load-format dummy`, `--quantization`, a `--json-model-override-args` digest, a `--dtype` other than
the pool's, and `--kv-cache-dtype` where it is not "auto" — a pool stored as uint8, as every fp8 format is, is refused
unless that or extra_config kv_cache_dtype names the format, and refused where the two differ: e4m3 and e5m2 pages are
the same bytes and other values), dtype, layers, KV heads, head dim, page size, TP rank and size (pipeline stages
add their layer range to the model id, attention-CP ranks their CP rank, and a NextN draft model that SGLang packs
into the pool, other than the target's checkpoint, its identity), and the KV format (`sglang_kv_format`: "sglang",
the host pool's layout and `SGLANG_FORMAT_VERSION`, bumped whenever this backend changes how it writes a page), so
engines whose pools differ in layout never share a page.

Weight updates. SGLang's `update_weights_from_*` change the weights under a running engine (and flush its own
tiers, not L3): the backend follows them (`follow_weight_updates`), from then on with the new weights' identity (a
local checkpoint directory's fingerprint, else one no other engine shares), and writes nothing until SGLang has
emptied its tiers of the old weights' pages.

Sliding-window models. SGLang keeps a Mistral- or Gemma-2-style model's KV in one uniform pool (every token of every
layer; the window is applied by attention), which this backend stores and loads whole. Its hybrid pools (an SWA
pool beside the full one, Mamba state, DSA indexer keys, DeepSeek-V4's compressed KV, draft-model KV) are refused
when SGLang registers them, at start-up, with an error naming the feature.

The directory group. All pages of one (spec, salt, generation) are registered in one directory group, so a lookup
is one HMGET whatever pages SGLang asks about: SGLang queries and writes from any page of a sequence, not just the
first, and passes the preceding keys only when `hicache_storage_pass_prefix_keys` is set. The cost is one Redis
Cluster slot per model shard and salt.

Ray. The backend runs inside SGLang's scheduler process and needs a Ray connection (`ray_address`, default
`$RAY_ADDRESS` or "auto") and the node whose KVNode is its local one (`ray_node_id`, default
`$KVMESH_RAY_NODE_ID`, else the node that connection lands on: on a real cluster with one raylet per host, the
engine's own). An engine started inside a Ray actor can export its node id as `KVMESH_RAY_NODE_ID` for its
children.
"""

# The parts: what a host pool's pages are (spec, keys, layout views), the generation counter, and the backend.
# SGLang loads the backend from this module by name (module_path "kvmesh.integrations.sglang", class_name
# "KVMeshStorage"), and the names below are what tests and users import from it.
from kvmesh.directory.generations import GEN_START, generation_group, generation_key
from kvmesh.integrations.identity import local_model_id, model_fingerprint  # noqa: F401 (API)
from kvmesh.integrations.sglang_generation import GenerationCounter
from kvmesh.integrations.sglang_spec import (
    LAYOUTS,
    SGLANG_FORMAT_VERSION,
    chunk_view,
    compute_dtype,
    draft_identity,
    kv_cache_dtype,
    model_identity,
    page_keys,
    parse_options,
    pool_feature,
    server_args,
    sglang_kv_format,
    spec_for_pool,
)
from kvmesh.integrations.sglang_storage import KVMeshStorage, follow_weight_updates

__all__ = [
    "GEN_START",
    "LAYOUTS",
    "SGLANG_FORMAT_VERSION",
    "GenerationCounter",
    "KVMeshStorage",
    "chunk_view",
    "compute_dtype",
    "draft_identity",
    "follow_weight_updates",
    "generation_group",
    "generation_key",
    "kv_cache_dtype",
    "local_model_id",
    "model_fingerprint",
    "model_identity",
    "page_keys",
    "parse_options",
    "pool_feature",
    "server_args",
    "sglang_kv_format",
    "spec_for_pool",
]
