"""The floor: plain shared types every feature package may import.

Frozen dataclasses and their strict (de)serialisation; no I/O, and no import of a feature
package (bench, policy, sim, gateway, deploy, …), so a type used by several of them lives here
rather than in one of them, and the feature packages never import each other for a type
(tests/unit/test_import_layers.py checks it):

  slo              Slo, parse_slo: latency objectives (bench, sim, policy)
  admission_policy AdmissionPolicy, parse_admission: which policy a gateway enforces
  output_law       OutputLaw, parse_output_law: a route's output lengths (the bound's maths stays
                   in kvtune.gateway.overflow)
  demand           Demand: what an admitted request may reach, for every ledger
  engine_settings  EngineSettings: the engine limits that change scheduling
  load_shape       LoadKind, LoadShape, Load: the load a sender puts on a server, and a run's
                   load as asked for (shape, bounds, seed: bench and simulate)
  retry_policy     RetryPolicy: how a client retries a 429
  deployment       Deployment, Measurement: the model on its GPUs and engine settings, and where its
                   measured capacity comes from (kvtune.api, planning, the CLI)
  choices          Policy, Objective: the rules' choices and the objective a search meets (kvtune.api)
  log_reading      LogReading, LogReplay: how logs are read into a profile (kvtune.api.profile_logs),
                   and logs replayed at their own timestamps
  simulated_server SimulatedServer: what simulate serves the traffic on besides the deployment
  bench_target     BenchTarget, Expectations: the server bench sends to, and what it holds the run to
  route            Route, RouteMatch, Api: one route type for the gateway, deploy and policy
  fields           Fields, MAX_INTEGER: the strict reader of kvtune's own files, and the
                   checks every strict reader makes
  step_time        StepTimeModel, FrontEndModel: how long an engine step takes (capacity fits
                   it, sim evaluates it, the what-if objective records it)
  tail_class       TailClass: light or heavy (profile decides it, the rules and
                   recommendation.json use it)
  censored_lengths CensoredLengths: a route's logged output lengths, plain (the Kaplan–Meier
                   estimate over them is kvtune.profile.routes.CensoredHistogram)
  feasibility      Reason, Verdict: whether a deployment runs the traffic (kvtune.policy.
                   feasibility decides it)
  whatif           the what-if table (WhatIfRow, Predicted, …) and the Objective it was searched
                   for, generic in its traffic profile (kvtune.policy.search builds the rows)
  recommendation   Recommendation: recommendation.json as a document (kvtune.policy.recommendation.
                   read_recommendation reads one back: traffic reader, verdict decided again)
"""
