"""Per-route output and prompt length distributions from logs: exact, mergeable histograms.

    histogram  integer, log-binned and joint histograms with nearest-rank quantiles
    routes     what is measured per route (censored outputs, tail class, arrivals) and per profile
    build      the streaming aggregation of normalized log batches into a profile
"""
