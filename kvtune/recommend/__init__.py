"""The policy: rules that each produce one recommended number with its reason, and the
recommendation they add up to.

    rules    small pure functions, one rule each
    policy   recommend(): the rules applied to a profile, a KV cost and a capacity
    saved    a recommendation.json read back strictly
"""
