"""Per-route output and prompt length distributions from logs: exact, mergeable histograms.

    histogram  integer, log-binned and joint histograms with nearest-rank quantiles
    routes     what is measured per route (censored outputs, tail class, arrivals) and per profile
    build      the streaming aggregation of normalized log batches into a profile
"""

#: Routes a profile keeps by default; the rest (the least busy) fold into `*`. A deployment
#: serves a few dozen routes; thousands mean the route key holds ids (/v1/users/123/...), and
#: a gateway config or nginx.conf with a location per id would be neither readable nor useful.
#: Named here, where nothing heavy is imported, so the CLI's --help and kvtune.api read it
#: without numpy.
MAX_ROUTES = 2000
