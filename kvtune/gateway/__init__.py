"""The reference admission gateway: a block ledger, prompt counting and an aiohttp proxy that
enforce kvtune's reservation policy in front of vLLM.

A request flows one way: intake (classify, read the body) -> admission (read by its API, cap,
count, reserve) -> relay (forward, stream back); proxy wires them, with admin's endpoints, into
the served application. aiohttp is imported only by those server modules (intake, relay, admin,
connections, proxy), never by the ledger, counting, the API readers or admission.
"""

from kvtune.gateway.ledger import BlockLedger, Reservation

__all__ = ["BlockLedger", "Reservation"]
