"""The policy: rules that each produce one recommended number with its reason, and the
recommendation they add up to.

    rules           small pure functions, one rule each
    recommend       recommend(): the rules applied to a profile and a plan
    recommendation  the Recommendation document (recommendation.json), written and read back strictly
"""
