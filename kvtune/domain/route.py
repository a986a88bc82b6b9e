"""Which requests a route holds, and a route as a deployed gateway config states it: the gateway
matches requests with RouteMatch, deploy reads deployed routes back, policy's search simulates
them, so both live on the floor. (gateway.config.GatewayRoute, which adds the API a path speaks
and where it is forwarded, stays in the gateway: one route type for all three is not done yet.)"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtune.domain.output_law import OutputLaw

__all__ = ["RouteMatch", "DeployedRoute"]


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """A request belongs to a route when every given key matches; none given matches everything.
    `path` is literal (a `*` in it is just a character); only `path_prefix`, which a user writes
    in their own config, matches a family of paths. `header` (a lower-case name) and `value`:
    the request carries that header once with exactly that value (a group such as a team, set by
    a trusted layer in front: a client that sets it itself picks its own cap)."""

    path: str | None = None
    model: str | None = None
    path_prefix: str | None = None
    header: str | None = None
    value: str | None = None

    def matches(self, path: str | None, model: str | None, headers: Mapping[str, str] | None = None) -> bool:
        """Exact path, path prefix, model equality and the header's exact value (`headers`: the
        request's route headers by lower-case name, absent or empty ones left out); a request
        without a known path never matches a route that names one."""
        if self.path is not None and path != self.path:
            return False
        if self.path_prefix is not None and (path is None or not path.startswith(self.path_prefix)):
            return False
        if not self.header_matches(headers):
            return False
        return self.model is None or self.model == model

    def header_matches(self, headers: Mapping[str, str] | None) -> bool:
        """No header named, or the request's value of it is exactly `value`."""
        return self.header is None or (headers is not None and headers.get(self.header) == self.value)


@dataclass(frozen=True, slots=True)
class DeployedRoute:
    name: str
    path: str | None
    model: str | None
    max_new_tokens: int
    path_prefix: str | None = None
    output_law: OutputLaw | None = None  # output_histogram: what the statistical policy bets on
    header: str | None = None  # match.header (lower-case) and the value it selects
    value: str | None = None

    def matches(self, path: str | None, model: str | None, headers: Mapping[str, str] | None = None) -> bool:
        """Same rule as the gateways (RouteMatch)."""
        match = RouteMatch(self.path, self.model, self.path_prefix, self.header, self.value)
        return match.matches(path, model, headers)
