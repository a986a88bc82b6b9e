"""The traffic a run sends and how it went, shared by the live benchmark (kvtune.bench) and
the simulator (kvtune.sim), which both import it and neither the other:

  draw       what to send: (route, prompt, output) pairs from a profile, replayed log rows,
             prompt text of a given length (PromptSynth)
  arrivals   when to send it: arrival_offsets for a LoadShape
  requests   one request and its result: RequestSpec, RequestResult, Outcome, FAILURE_KINDS
  stats      latency percentiles, throughput and goodput of the results
"""
