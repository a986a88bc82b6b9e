"""What a LiteLLM proxy forwards to an OpenAI-compatible engine (provider `hosted_vllm`), as a
request body kvtune's gateway reads: the prompt is counted and the cap clamped on this body, not
on what the client sent, because LiteLLM rewrites the request on the way (checked on LiteLLM
1.108 against the fake engine's received bodies):
  * its own parameters (metadata, the proxy's request record, the call id, keys, retries, …:
    LiteLLM's `all_litellm_params`) never reach the engine;
  * `extra_body` is spread into the top level and wins over a top-level member of the same name
    (an `extra_body.max_tokens` of 1000 beside a clamped `max_tokens` of 5 reaches vLLM as 1000);
  * members LiteLLM does not know (vLLM's `min_tokens`, `ignore_eos`, `best_of`, …) are
    forwarded at the top level;
  * Anthropic-style `thinking` becomes `reasoning_effort` (LiteLLM's own mapping), which the chat
    template renders.
The hook writes the admitted body back into the request LiteLLM goes on with (`apply`), so what
it counted is what is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from litellm.litellm_core_utils.reasoning_effort_utils import reasoning_effort_from_thinking_budget
from litellm.types.utils import all_litellm_params

#: Members of a proxy request that are LiteLLM's own and never forwarded.
LITELLM_ONLY = frozenset(all_litellm_params) | {"user_api_key_dict"}


def forwarded_body(data: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body LiteLLM sends the engine for this request (its `model` left as the client's)."""
    body = {k: v for k, v in data.items() if k not in LITELLM_ONLY and not k.startswith("_") and k != "extra_body"}
    thinking = body.pop("thinking", None)
    if (isinstance(thinking, dict) and thinking.get("type") == "enabled" and "reasoning_effort" not in body):
        body["reasoning_effort"] = reasoning_effort_from_thinking_budget(thinking.get("budget_tokens", 0))
    extra = data.get("extra_body")
    if isinstance(extra, Mapping):
        body.update(extra)
    return body


def apply(data: MutableMapping[str, Any], admitted: Mapping[str, Any]) -> None:
    """Make `data` forward exactly `admitted` (a body forwarded_body gave, with its caps written):
    extra_body and thinking are folded into the top level, every admitted member written."""
    data.pop("extra_body", None)
    data.pop("thinking", None)
    for key, value in admitted.items():
        if key != "model":  # LiteLLM routes on the client's model name
            data[key] = value


__all__ = ["LITELLM_ONLY", "apply", "forwarded_body"]
