"""One option parser for the engine integrations: the vLLM connector (`kv_connector_extra_config`), the vLLM tier
(its `secondary_tiers` entry) and the SGLang backend (`extra_config`).

    Field(name, kind, default, max, choices, forbid)   one option: kind STR (a non-empty string), INT (a positive
                                                        integer), NUMBER (a finite number > 0) or BOOL; NUMBER and
                                                        INT at most `max`; STR one of `choices` where given
    OptionTable(who, where, fields, foreign)            the options of one integration
      .parse(given) -> dict                             every option that is set or has a default; raises
                                                        OptionError naming the key
      .with_choices(name, choices) -> OptionTable       the same with one STR option limited to `choices`
    OptionError(ValueError)                             `.key`: the offending option

Unknown keys are errors (a typo would otherwise fall back to a default, silently), except the `foreign` ones, which
belong to the engine and are passed over. A None value is the option not given. bool is not an INT or a NUMBER.
NaN and Infinity (which JSON configs of both engines accept) are refused.

Nothing here imports an engine, Ray or the kvmesh client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

MAX_DEADLINE_S = 86400.0  # kvmesh.client.MAX_DEADLINE_S (a unit test checks they agree; the client is heavy)
STR, INT, NUMBER, BOOL = "str", "int", "number", "bool"


class OptionError(ValueError):
    """A bad integration option; `key` names it (for unknown keys, the first in sorted order)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # STR, INT, NUMBER or BOOL
    default: Any = None  # None: not set unless given (the integration's own fallback applies)
    max: float = math.inf  # INT and NUMBER: the largest value accepted
    choices: tuple[str, ...] = ()  # STR: the values accepted, where given
    forbid: str = ""  # STR: characters it must not contain

    def expected(self) -> str:
        if self.choices:
            return f"one of {self.choices}"
        if self.kind == STR:
            return "a non-empty string"
        if self.kind == BOOL:
            return "true or false"
        what = "a positive integer" if self.kind == INT else "a finite number > 0"
        return what + (f" and <= {self.max:g}" if self.max != math.inf else "")

    def accepts(self, v: Any) -> bool:
        if self.kind == BOOL:
            return isinstance(v, bool)
        if isinstance(v, bool):  # (an int subclass: True is not 1 second)
            return False
        if self.kind == STR:
            return isinstance(v, str) and bool(v) and (not self.choices or v in self.choices)
        if self.kind == INT:
            return isinstance(v, int) and 0 < v <= self.max
        if self.kind == NUMBER:
            return isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= self.max  # (NaN fails both)
        raise AssertionError(f"unknown option kind {self.kind!r}")


@dataclass(frozen=True)
class OptionTable:
    who: str  # "kvmesh vLLM connector": the start of every message
    where: str  # "kv_connector_extra_config": what the options are called in the engine's config
    fields: tuple[Field, ...]
    foreign: tuple[str, ...] = ()  # the engine's own keys in the same dict, accepted and left out of the result

    def with_choices(self, name: str, choices: tuple[str, ...]) -> OptionTable:
        """This table with option `name` limited to `choices` (values known only where the engine is imported)."""
        fields = tuple(replace(f, choices=choices) if f.name == name else f for f in self.fields)
        return replace(self, fields=fields)

    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def defaults(self) -> dict[str, Any]:
        return {f.name: f.default for f in self.fields if f.default is not None}

    def parse(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """The options in `given`, checked, with the defaults of those not given."""
        given = dict(given or {})
        known = set(self.names())
        unknown = sorted(k for k in given if k not in known and k not in self.foreign)
        if unknown:
            raise OptionError(
                f"{self.who}: unknown {self.where} key(s) {unknown}; known: {sorted(known)}", str(unknown[0])
            )
        out = self.defaults()
        for f in self.fields:
            v = given.get(f.name)
            if v is None:
                continue
            if not f.accepts(v):
                raise OptionError(f"{self.who}: {self.where}[{f.name!r}] must be {f.expected()}, got {v!r}", f.name)
            bad = [c for c in f.forbid if c in v]
            if bad:
                raise OptionError(f"{self.who}: {self.where}[{f.name!r}] must not contain {bad[0]!r}", f.name)
            out[f.name] = v
        return out


# -- the three integrations' tables ---------------------------------------------------------------------------------
# (the vLLM connector's ConnectorOptions, vllm_options.py, has the same defaults: a unit test checks they agree)
VLLM_CONNECTOR = OptionTable(
    "kvmesh vLLM connector",
    "kv_connector_extra_config",
    (
        Field("ray_address", STR),  # Ray cluster to join when this process has no Ray connection yet
        Field("ray_node_id", STR),  # the node whose KVNode is this engine's local one
        Field("redis_url", STR),  # the directory, if not the one the local KVNode uses
        Field("cache_salt", STR, forbid="\x00"),  # engine-wide tenant salt (joined to a request's with NUL)
        Field("model_id", STR),  # the model's identity; replaces the model name and revision or fingerprint
        Field("model_revision", STR),  # revision of a hub model (default: vLLM's --revision)
        Field("chunk_tokens", INT),  # tokens per kvmesh chunk, a multiple of vLLM's block size
        Field("load_mode", STR, "async", choices=("async", "sync")),
        Field("cost_model", BOOL, True),
        Field("fetch_timeout_s", NUMBER, max=MAX_DEADLINE_S),  # deadline of one load
        Field("save_copy", STR, choices=("inline", "background")),
        Field("kv_format", STR, "engine", choices=("engine", "neutral")),
    ),
    foreign=("connectors",),  # (vLLM's MultiConnector passes its own through)
)

VLLM_TIER = OptionTable(
    "kvmesh vLLM tier",
    "secondary_tiers entry",
    (
        Field("ray_address", STR),
        Field("ray_node_id", STR),
        Field("redis_url", STR),
        Field("model_id", STR),
        Field("model_revision", STR),
        Field("fetch_timeout_s", NUMBER, max=MAX_DEADLINE_S),
        Field("verdict_ttl_s", NUMBER, 10.0, max=3600.0),  # how long a lookup's answer is trusted
        Field("enable_kv_events", BOOL),
        Field("locality", STR),  # one of vLLM's Locality values (vllm_tier.TIER_OPTIONS: this module imports no vLLM)
    ),
)

# SGLang's own keys that reach the backend's extra_config (SGLang 0.5.23): the dynamic loader's (backend_name,
# module_path, class_name), the cache controller's interface_v1, and the radix cache's prefetch settings and prefix-key
# switch: its own parser pops these four, but the PD-disaggregation decode offload manager hands the controller the
# JSON as given. (tp_lcm_size, the one other key SGLang reads, is popped before every backend is built.)
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)

SGLANG = OptionTable(
    "kvmesh SGLang backend",
    "extra_config",
    (
        Field("ray_address", STR),  # Ray cluster to join when this process has no Ray connection yet
        Field("ray_node_id", STR),  # the node whose KVNode is this engine's local one
        Field("redis_url", STR),  # the directory, if not the one the local KVNode uses
        Field("cache_salt", STR),  # tenant salt: engines with different salts never share
        Field("model_id", STR),  # the model's identity ("name@revision"); replaces name + revision/fingerprint
        Field("model_revision", STR),  # revision of a hub model (`model_name` is not a local directory)
        Field("lora_id", STR),  # adapter merged into the weights, if any
        Field("kv_cache_dtype", STR),  # SGLang's --kv-cache-dtype, where this process's server args do not say it
        Field("fetch_timeout_s", NUMBER, max=MAX_DEADLINE_S),  # deadline of one batch_get
        # how often the generation is re-read (another engine may clear)
        Field("generation_refresh_s", NUMBER, 1.0, max=3600.0),
    ),
    foreign=SGLANG_KEYS,
)
