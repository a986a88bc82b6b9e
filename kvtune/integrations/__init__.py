"""kvtune's admission inside gateways users already run: kvtune.integrations.litellm is a LiteLLM
proxy hook (installed with the `litellm` extra) that enforces the gateway.yaml kvtune's own
gateway reads. Nothing here is imported by kvtune itself: the gateway that loads it does."""
