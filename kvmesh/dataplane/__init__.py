"""The data plane: one pipeline for every fetch in kvmesh (a worker's `fetch`/`fetch_to_device`, a KVNode's
pull-through, the vLLM loader, SGLang's batch reads).

    planner.plan_runs   pure: the chunks of a match, as runs by holder, split into batches
    sources             two-phase transfers: begin (pin / request) -> complete (land, verify) -> release
    sinks               where chunks land: a new CPU tensor or a caller's `out=`, a device, a node's own slots
    fetcher.Fetcher     runs a plan: every source begins at once, runs land in order-independent places, the
                        result is the leading run of chunks that arrived intact

See docs/architecture.md for the paths and which thread owns what.
"""
