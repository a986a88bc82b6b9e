"""`kvtune bench`: replay profiled traffic against a live endpoint, scrape /metrics, judge.

    prompts.py   prompts of exact length, calibrated on the server's tokenizer (what to send,
                 and when: kvtune.workload, which the simulator shares)
    client.py    how one request is sent, streamed and timed (SSE)
    loads.py     when requests are sent (synchronous, concurrent, poisson, gamma, replay)
    scrape.py    the server's /metrics before, during and after
    report.py    aggregates, goodput, verdict (pure)
    run.py       `run_bench`, which ties them together over one aiohttp session
"""
