"""What `kvtune simulate` serves the traffic on besides the deployment: where the pool comes from,
the gateway in front, the engine limits it overrides, and the path and header each request
carries; one value kvtune.api.simulate takes whole."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SIMULATED_ENGINES", "SimulatedServer"]

#: The engines whose scheduler `kvtune simulate --engine` runs: kvtune.sim.rules.ENGINE_NAMES (a
#: test ties them), named here so that the command's options load no simulator.
SIMULATED_ENGINES = ("vllm", "sglang", "trtllm-gne", "trtllm-maxutil")


@dataclass(frozen=True, slots=True)
class SimulatedServer:
    """`capacity_file` is a capacity file (`kvtune calibrate`, `kvtune capacity --json`) holding
    the pool and the settings it was measured at (None: the deployment's estimate, or the
    measurement's token or block count); `gateway` a gateway.yaml whose admission runs in front
    of the engine (None: straight to it); `max_num_seqs` overrides the engine's (as the
    deployment's max_num_batched_tokens does); `endpoint` "chat" or "completions" picks the gateway's route, and with
    `route_header` each request carries its route there. `tensor_parallel_size` is the step
    time's beside a capacity file (None: the file's, else 1; one the file contradicts is refused)."""

    capacity_file: str | None = None
    gateway: str | None = None
    max_num_seqs: int | None = None
    endpoint: str = "chat"
    route_header: str | None = None
    tensor_parallel_size: int | None = None
