"""Engine integrations: thin adapters that translate an engine's KV layout and requests into kvmesh chunks."""
