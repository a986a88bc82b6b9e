"""`recommend --objective` for several engine replicas (one `--capacity FILE` each): the whole
deployment searched, every replica with its own budget and engine limits, and its own figures.

The gateway has one route table and one admission policy (gateway.yaml `routes`, `admission`),
so caps, policy and ε are one choice for the deployment; each replica's block budget,
max_num_seqs and max_num_batched_tokens are `recommend()` on its own capacity at that choice
(the same rules, the same safety fraction). Each grid row is then simulated on every replica at
once, and the row chosen on the deployment's totals: rates summed over the replicas, the
preemption and 429 shares and the latency percentiles over all of its requests.

Why each replica serves its share of the traffic, in proportion to its budget, instead of one
simulation of the gateway's router (a reservation to the replica where it fits with the most
free budget, ties by fewest in flight): under load, the only regime where the settings differ,
that router keeps every replica's budget full and hands each the requests it frees budget for,
which is its budget's share when the replicas run at the same speed (the spread the live
gateway's pool is tested for: tests/integration/test_gateway_upstreams.py, load in proportion to budgets);
below it no replica is near its budget and the split changes nothing. A split also keeps each
replica's simulation whole (the event loop's fast path jumps many decode steps at once, which a
router consulted at every arrival would cut at every other replica's step), so the grid costs
what it costs for one engine, times the replicas, and each replica's figures are its own.
Where it is less faithful, stated here: replicas of different speeds. The router then gives the
faster one more than its budget's share; the split does not, so the deployment's totals err on
the pessimistic side (less throughput, more queueing and 429s on the slower replica) and the
faster replica's own figures on the optimistic one. And a request refused by its replica here
would be refused by the router only if it fit on none. (The faithful alternative, the gateway's
own kvtune.gateway.pool.UpstreamPool as the simulated admission over N engines in one event
loop, needs kvtune.sim.engine to step several schedulers on one clock.)

The split is deterministic (`interleave`: stride scheduling over the drawn requests, in send
order, vectorized), so each replica's arrivals are as even as the router makes them, and every
row serves the same requests on the same replica. In a closed loop (--concurrency) the clients
are split the same way (largest remainder), and each replica's requests in proportion to its
clients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtune.domain.engine_settings import EngineSettings
from kvtune.domain.recommendation import Recommendation
from kvtune.domain.whatif import Objective, PolicyKind, Predicted, ReplicaBasis, ReplicaRow
from kvtune.errors import KvtuneError
from kvtune.planning import Plan
from kvtune.policy import rules
from kvtune.policy.recommend import RecommendOptions, recommend
from kvtune.policy.replicas import check_replica
from kvtune.policy.search import (
    TAIL_LEVEL,
    Candidate,
    Deployment,
    Draws,
    ObjectiveSpec,
    Progress,
    SearchGrid,
    build_objective,
    chosen_recommendation,
    draw_requests,
    engine_candidates,
    grid_candidates,
    mean_predicted,
    objective_seeds,
    predicted_of,
    searched_grid,
    simulate_run,
    truncation_share,
)
from kvtune.profile.routes import Profile
from kvtune.sim.requests import Workload
from kvtune.sim.results import RequestColumns
from kvtune.sim.traffic import Traffic


@dataclass(frozen=True, slots=True)
class Replica:
    """One engine replica: the capacity file it was measured in, its plan, and the objective
    with the simulator's footing on its own capacity (its timing, its pool)."""

    capacity_file: str
    plan: Plan
    objective: Objective


def traffic_shares(weights: Sequence[int]) -> tuple[float, ...]:
    """Each replica's share of the traffic: its weight (usable blocks) over all of them."""
    total = sum(weights)
    return tuple(w / total for w in weights)


def interleave(weights: Sequence[float], n: int) -> np.ndarray:
    """The replica of each of `n` requests, in order: with share = weight / all weights, each
    replica's k-th request placed at (k + ½) / share and all of them merged by place, the first
    replica of equal places first (stride scheduling, vectorized), so each one's requests are
    spread evenly through the sequence, in proportion to its share."""
    share = np.asarray(weights, dtype=np.float64)
    share = share / share.sum()
    live = np.flatnonzero(share > 0)
    counts = np.ceil(n * share[live]).astype(np.int64) + 1  # more than each one's part of any n
    owner = np.repeat(live, counts)
    k = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner[np.argsort((k + 0.5) / share[owner], kind="stable")[:n]]


def split_clients(concurrency: int, shares: Sequence[float]) -> list[int]:
    """`concurrency` clients over the replicas by their shares (largest remainder, the first of equals)."""
    exact = [concurrency * s for s in shares]
    out = [int(e) for e in exact]
    for i in sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))[:concurrency - sum(out)]:
        out[i] += 1
    return out


def split_draws(draws: Draws, replica: np.ndarray, count: int) -> list[Draws]:
    """Each replica's requests of `draws`, in their order (send times kept)."""
    order = np.argsort(replica, kind="stable")
    ends = np.cumsum(np.bincount(replica, minlength=count))
    route = np.array(draws.route, dtype=object)
    out = []
    for i in range(count):
        own = order[ends[i - 1] if i else 0:ends[i]]
        out.append(Draws(tuple(route[own].tolist()), draws.prompt[own], draws.output[own],
                         None if draws.send_s is None else draws.send_s[own]))
    return out


def replicas_for(profile: Profile, plans: Sequence[tuple[str, Plan]], spec: ObjectiveSpec) -> list[Replica]:
    """Every replica with the objective resolved on its own measured capacity; a capacity the
    simulator cannot run names its file."""
    out = []
    for path, plan in plans:
        try:
            out.append(Replica(path, plan, build_objective(profile, plan, spec)))
        except KvtuneError as exc:
            if exc.path is None:
                exc.path = path
            raise
    return out


@dataclass(frozen=True, slots=True)
class Split:
    """The objective's requests over the replicas: each one's share, its clients (closed loop),
    and for every seed each replica's draws."""

    shares: tuple[float, ...]
    clients: tuple[int, ...] | None  # None: open loop
    per_seed: tuple[tuple[Draws, ...], ...]


def split_load(objective: Objective, usable_blocks: Sequence[int]) -> Split:
    """Every seed's requests split over replicas in proportion to their usable KV blocks (in a
    closed loop, the clients, and the requests in proportion to them)."""
    shares = traffic_shares(usable_blocks)
    clients = None
    if objective.load.concurrency is not None:
        clients = tuple(split_clients(objective.load.concurrency, shares))
        shares = tuple(c / objective.load.concurrency for c in clients)
    per_seed = []
    for seed in objective_seeds(objective):
        draws = draw_requests(objective, seed)
        per_seed.append(tuple(split_draws(draws, interleave(shares, len(draws.route)), len(shares))))
    return Split(shares, clients, tuple(per_seed))


def simulate_replicas(objective: Objective, objectives: Sequence[Objective], deployments: Sequence[Deployment],
                      split: Split) -> tuple[Predicted, list[Predicted]]:
    """Each replica's deployment serving its part of the split on its own footing (objectives[i]:
    its step time and pool), and the deployment's total: the mean over the seeds of each."""
    totals: list[Predicted] = []
    parts: list[list[Predicted]] = [[] for _ in deployments]
    for seed_draws in split.per_seed:
        runs = []
        for i, (own, dep, draws) in enumerate(zip(objectives, deployments, seed_draws, strict=True)):
            clients = None if split.clients is None else split.clients[i]
            if not len(draws.route) or clients == 0:
                parts[i].append(_nothing(objective, dep))
                continue
            result, traffic = simulate_run(own, dep, draws, clients)
            parts[i].append(predicted_of(own, dep, result, traffic))
            runs.append((result, traffic))
        totals.append(_total(objective, deployments[0], runs, [p[-1] for p in parts]))
    return mean_predicted(totals), [mean_predicted(p) for p in parts]


def search_replicas(profile: Profile, primary: int, replicas: Sequence[Replica], options: RecommendOptions, *,
                    grid: SearchGrid | None = None, progress: Progress | None = None) -> Recommendation:
    """The grid on `replicas[primary]` (the smallest: its caps and max_model_len every replica
    runs, as `per_replica` requires), every row simulated on all the replicas; the chosen row's
    recommendation (the primary's) with the what-if table, each row carrying each replica's part,
    and the objective each replica's footing (so `kvtune check` simulates them again).
    InfeasibleObjectiveError as `search`."""
    main = replicas[primary]
    objective = dataclasses.replace(main.objective, replicas=tuple(
        ReplicaBasis(r.capacity_file, r.objective.basis) for r in replicas))
    grid = searched_grid(grid, options, objective)
    candidates = grid_candidates(profile, main.plan, options, objective, grid)
    split = split_load(objective, [r.objective.basis.engine.num_blocks - 1 for r in replicas])
    defaults = [_default(profile, r, options) for r in replicas]
    for r in replicas:  # before any simulation, each error naming its replica's file
        check_replica(r.capacity_file, r.plan.capacity, block_size=defaults[primary].capacity.block_size,
                      max_model_len=defaults[primary].max_model_len)
    objectives = [r.objective for r in replicas]

    def evaluate(c: Candidate) -> tuple[Predicted, tuple[ReplicaRow, ...]]:
        deployments = [_replica_deployment(profile, c, r, d, options, split.shares[i])
                       for i, (r, d) in enumerate(zip(replicas, defaults, strict=True))]
        total, parts = simulate_replicas(objective, objectives, deployments, split)
        return total, tuple(ReplicaRow(r.capacity_file, dep.budget_blocks, dep.engine.max_num_seqs,
                                       dep.engine.max_num_batched_tokens, round(split.shares[i], 6), parts[i])
                            for i, (r, dep) in enumerate(zip(replicas, deployments, strict=True)))

    rec = chosen_recommendation(objective, grid, candidates, evaluate, progress)
    note = (f"{len(replicas)} engine replicas simulated together, each on its share of the load (in proportion to "
            "its usable KV blocks: "
            + ", ".join(f"{r.capacity_file} {s:.0%}" for r, s in zip(replicas, split.shares, strict=True))
            + "), each with its own budget and engine limits; the what-if figures are the deployment's totals")
    return dataclasses.replace(rec, notes=(*rec.notes, note))


def _default(profile: Profile, replica: Replica, options: RecommendOptions) -> Recommendation:
    """The rules' recommendation on one replica; a capacity they cannot serve names its file."""
    try:
        return recommend(profile, replica.plan, options)
    except KvtuneError as exc:
        if exc.path is None:
            exc.path = replica.capacity_file
        raise


def _replica_deployment(profile: Profile, c: Candidate, replica: Replica, default: Recommendation,
                        options: RecommendOptions, share: float) -> Deployment:
    """Row `c` as one replica deploys it: the route caps, laws and max_model_len every replica
    runs (the primary's), its own budget and engine limits, its share of the gateway's queue."""
    basis = replica.objective.basis
    d = c.deployment
    queue = replica_queue(d.queue_max_waiting, share)
    kind = c.policy.kind
    if kind is PolicyKind.DIRECT:
        return dataclasses.replace(d, engine=basis.engine)
    if kind is PolicyKind.ENGINE:
        assert c.policy.engine is not None
        uncapped: dict[str, int | None] = {r.route: None for r in profile.routes}
        return engine_candidates(default, basis, uncapped, [c.policy.engine], c.cap_level or TAIL_LEVEL)[0].deployment
    if kind is PolicyKind.WORST_CASE:
        safety = c.safety_fraction if c.safety_fraction is not None else default.safety_fraction.fraction
        budget = rules.block_budget(replica.plan.capacity.num_blocks, safety).tokens
        return dataclasses.replace(d, engine=basis.engine, budget_blocks=budget, queue_max_waiting=queue)
    own = recommend(profile, replica.plan, dataclasses.replace(
        options, cap_level=None if c.cap_level == TAIL_LEVEL else c.cap_level, safety_fraction=c.safety_fraction,
        searched=options.safety_fraction is None, admission=c.policy.admission()))
    engine = EngineSettings(num_blocks=basis.engine.num_blocks, block_size=own.capacity.block_size,
                            max_num_seqs=own.setting("max_num_seqs").tokens,
                            max_num_batched_tokens=own.setting("max_num_batched_tokens").tokens,
                            max_model_len=d.engine.max_model_len,
                            enable_prefix_caching=basis.engine.enable_prefix_caching)
    return dataclasses.replace(d, engine=engine, budget_blocks=own.budget_blocks, queue_max_waiting=queue)


def replica_queue(max_waiting: int, share: float) -> int:
    """A replica's part of the gateway's one wait queue: its share of the places, at least one."""
    return 0 if max_waiting == 0 else max(1, round(max_waiting * share))


def _nothing(objective: Objective, deployment: Deployment) -> Predicted:
    """A replica no request was sent to (fewer clients than replicas)."""
    return Predicted(0.0, 0.0, None if objective.slo is None else 0.0, None, None, None, None, 0.0, 0.0,
                     truncation_share(objective.traffic, deployment.caps), 0, 0)


def _total(objective: Objective, deployment: Deployment, runs: list, parts: Sequence[Predicted]) -> Predicted:
    """One seed's figures for the whole deployment: its rates the sums of the replicas', its
    shares and latency percentiles over all of its requests."""
    if not runs:
        return _nothing(objective, deployment)
    results = [r for r, _ in runs]
    traffics = [t for _, t in runs]
    columns = RequestColumns(*(np.concatenate([getattr(r.requests, f.name) for r in results])
                               for f in dataclasses.fields(RequestColumns)))
    merged = dataclasses.replace(results[0], requests=columns, duration_s=max(r.duration_s for r in results),
                                 preemptions=sum(r.preemptions for r in results))
    w = [t.workload for t in traffics]
    workload = Workload.from_columns(np.concatenate([x.arrival_s for x in w]),
                                     np.concatenate([x.prompt_tokens for x in w]),
                                     np.concatenate([x.output_tokens for x in w]),
                                     np.concatenate([x.max_tokens for x in w]))
    first = traffics[0]
    traffic = Traffic(workload, np.concatenate([t.requested_output for t in traffics]),
                      tuple(r for t in traffics for r in t.route), first.routes, first.closed_loop, first.overhead_s,
                      first.clamped)
    total = predicted_of(objective, deployment, merged, traffic)
    goodput = [p.goodput_rps for p in parts]
    return dataclasses.replace(
        total, output_tokens_per_s=round(sum(p.output_tokens_per_s for p in parts), 3),
        requests_per_s=round(sum(p.requests_per_s for p in parts), 3),
        goodput_rps=None if any(g is None for g in goodput) else round(sum(g or 0.0 for g in goodput), 3))


__all__ = ["Replica", "Split", "replicas_for", "search_replicas", "split_load", "simulate_replicas",
           "replica_queue", "traffic_shares", "interleave", "split_clients", "split_draws"]
