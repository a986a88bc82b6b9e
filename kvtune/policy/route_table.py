"""The route table a recommendation deploys: one Route per recommended route, in order, then a
catch-all capped at the backstop so no request is ever uncapped. Built once here, as typed
Routes: render writes it into gateway.yaml and nginx.conf, the what-if search simulates it.
"""

from __future__ import annotations

import numpy as np

from kvtune.domain.output_law import OutputLaw
from kvtune.domain.recommendation import Decision, Recommendation, RouteRecommendation
from kvtune.domain.route import Api, Route, RouteMatch
from kvtune.gateway.endpoints import GENERATE
from kvtune.profile.routes import CensoredHistogram

__all__ = ["CATCH_ALL_ROUTE", "route_output_law", "route_table", "route_decisions"]

CATCH_ALL_ROUTE = "default"


def route_output_law(route: RouteRecommendation) -> OutputLaw:
    """The route's measured output lengths as the statistical policy reads them: binned, truncated
    at its cap, and every cut-off (censored) response counted at the cap, since it ran at least
    that long as far as anyone knows."""
    lengths = CensoredHistogram.from_lengths(route.output_lengths)
    values = np.concatenate([lengths.uncensored.values, np.full(lengths.censored.values.size, route.cap)])
    counts = np.concatenate([lengths.uncensored.counts, lengths.censored.counts])
    return OutputLaw.from_samples(values, counts, route.cap)


def route_decisions(rec: Recommendation) -> list[tuple[Route, Decision]]:
    """Each route of the table with the decision behind its cap (its rule and reason), the
    catch-all's being the backstop's, said to be the catch-all's."""
    table: list[tuple[Route, Decision]] = []
    for route in rec.routes:
        if route.match is None:
            continue  # routes from a field no gateway sees: the catch-all below serves them
        path = route.match.path or None
        match = RouteMatch(path=path, model=route.match.model or None, header=route.match.header,
                           value=route.match.value)
        # a path that is no vLLM endpoint: gateway.yaml says how its requests are read
        api = Api.ANY if path is not None and path not in GENERATE else None
        table.append((Route(str(route.route) or "(unnamed)", match, route.cap, api=api,
                            output_law=route_output_law(route)), route.max_new_tokens))
    backstop = rec.setting("max_new_tokens_backstop")
    table.append((Route(CATCH_ALL_ROUTE, RouteMatch(), backstop.tokens),
                  Decision(backstop.value, backstop.rule, "catch-all: " + backstop.reason)))
    return table


def route_table(rec: Recommendation) -> tuple[Route, ...]:
    """The gateway's route table for `rec`, in the order the gateways match it."""
    return tuple(route for route, _ in route_decisions(rec))
