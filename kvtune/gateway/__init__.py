"""The reference admission gateway: a block ledger, prompt counting and an aiohttp proxy that
enforce kvtune's reservation policy in front of vLLM. aiohttp is imported only by `proxy`."""

from kvtune.gateway.ledger import BlockLedger, Reservation

__all__ = ["BlockLedger", "Reservation"]
