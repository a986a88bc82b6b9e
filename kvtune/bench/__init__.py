"""`kvtune bench`: replay profiled traffic against a live endpoint, scrape /metrics, judge.

    workload.py  what to send (pairs from a profile, replayed rows, prompts of exact length)
    client.py    how one request is sent, streamed and timed (SSE)
    loads.py     when requests are sent (synchronous, concurrent, poisson, gamma, replay)
    scrape.py    the server's /metrics before, during and after
    report.py    aggregates, goodput, verdict (pure)
    run.py       `run_bench`, which ties them together over one aiohttp session
"""
