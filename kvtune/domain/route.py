"""A route: which requests it holds (RouteMatch), the output cap it enforces and the law of its
output lengths. One type for every layer that speaks of routes: the gateway matches and caps
requests with it (gateway.config reads gateway.yaml into Routes), deploy reads deployed files back
into Routes, policy builds the route table a recommendation deploys (policy.route_table) and its
search and check simulate it; a recommendation's routes say how they match with a RouteMatch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from kvtune.domain.output_law import OutputLaw

__all__ = ["Api", "RouteMatch", "Route"]


class Api(enum.Enum):
    """The field rules a request is read by: where its prompt is, which fields cap its output."""

    CHAT = "chat"                # messages (+ tools, documents, template fields); max_tokens, max_completion_tokens
    CHAT_BATCH = "chat-batch"    # messages: a list of conversations, one output each
    COMPLETIONS = "completions"  # prompt: text, texts, token ids or lists of them; max_tokens
    RESPONSES = "responses"      # input + instructions; max_output_tokens
    MESSAGES = "messages"        # Anthropic: messages + system + tools; max_tokens
    INVOCATIONS = "invocations"  # SageMaker: vLLM tries chat, then completions, then pooling
    TOKENS = "tokens"            # token_ids; sampling_params.max_tokens (/inference/v1/generate)
    ANY = "any"                  # a route path that is not a vLLM endpoint: every prompt field counts
    EMBED = "embed"              # pooling: input (or messages)
    SCORE = "score"              # pooling pairs: data_1/data_2, text_1/text_2, queries/documents|items
    RERANK = "rerank"            # pooling pairs: query x documents
    COHERE_EMBED = "cohere-embed"  # pooling: texts / inputs


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

    @property
    def headers(self) -> dict[str, str] | None:
        """The route headers a request of this route carries, as `matches` reads them."""
        return None if self.header is None or self.value is None else {self.header: self.value}

    def to_dict(self) -> dict:
        """recommendation.json's `match`: path and model always, the others when set."""
        out: dict = {"path": self.path, "model": self.model}
        if self.path_prefix is not None:
            out["path_prefix"] = self.path_prefix
        if self.header is not None:
            out |= {"header": self.header, "value": self.value}
        return out


@dataclass(frozen=True, slots=True)
class Route:
    """A route of a gateway's table: the requests it matches, the output cap it enforces, and
    where they go. `api` and `upstream_path`: for a literal path that is not one of vLLM's
    endpoints, the API its requests speak (how they are counted; `any` charges every prompt
    field) and the path they are forwarded to. `output_law`: the route's measured output lengths
    (output_histogram), which the statistical policy bets on; None: its requests are assumed to
    reach their cap. `band`: the flow-control band its requests wait in; None: the default."""

    name: str
    match: RouteMatch
    max_new_tokens: int
    upstream: str | None = None
    api: Api | None = None
    upstream_path: str | None = None
    output_law: OutputLaw | None = None
    # The flow-control band its requests wait in (gateway.yaml `flow:`); None: flow.default_band.
    band: str | None = None

    def matches(self, path: str | None, model: str | None, headers: Mapping[str, str] | None = None) -> bool:
        return self.match.matches(path, model, headers)

    # what the route matches on, read as the route's own (a deployed route's path, say)
    @property
    def path(self) -> str | None:
        return self.match.path

    @property
    def model(self) -> str | None:
        return self.match.model

    @property
    def path_prefix(self) -> str | None:
        return self.match.path_prefix

    @property
    def header(self) -> str | None:
        return self.match.header

    @property
    def value(self) -> str | None:
        return self.match.value
