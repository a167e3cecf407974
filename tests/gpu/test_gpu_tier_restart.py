"""A KVNode that Ray restarts before the GPU memory of its old process is freed (or while another process holds
it): no room for its GPU tier. A first start says so and fails; a restart comes back without the tier (Ray does not
retry a failed re-creation: the node would lose its CPU and disk tiers too, for good). Real Redis, real GPU."""

import pytest
import torch

from kvmesh.config import KVMeshConfig
from kvmesh.local import RedisServer
from kvmesh.node import KVNode

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SLOT = 1 << 20


def test_a_restarted_node_without_room_for_its_gpu_tier_starts_without_it(tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    with RedisServer() as rs:
        cfg = KVMeshConfig(redis_url=rs.url, key_prefix="oom", cpu_bytes=8 * SLOT, slot_bytes=SLOT,
                           gpu_bytes=(2 * total // SLOT) * SLOT, gpu_device="cuda:0", shm_dir=str(tmp_path))
        with pytest.raises(Exception, match="(?i)memory"):
            KVNode(cfg, "node-oom" * 3, "kvnode-oom")  # a first start: the operator hears of it
        node = KVNode(cfg, "node-oom" * 3, "kvnode-oom", restarted=True)  # (as KVNodeActor on a restart)
        try:
            assert node.cascade.gpu is None
            assert node.stats()["gpu_unavailable"] == 1
        finally:
            node.shutdown()
