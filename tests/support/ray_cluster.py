"""A two-node local Ray cluster for the data-service tests (one module each)."""

from __future__ import annotations

from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster


def two_node_cluster() -> Iterator[Cluster]:
    """A head of 1 CPU and a node of 2, the driver connected; torn down after."""
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False})
    nodes.add_node(num_cpus=2, object_store_memory=80 << 20)
    ray.init(address=nodes.address, log_to_driver=False, configure_logging=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()
